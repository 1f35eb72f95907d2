"""Row sets and FLOP accounting of the benchmark."""
import pytest

from flexlab.bench.rows import FWD, FWD_BWD, ROW_SETS, Row, attention_flops, select_rows


def test_forward_flops_count_both_matmuls_over_kept_pairs():
    # QKᵀ and PV are each 2·Sq·Skv·D multiply-adds per head.
    assert attention_flops(2, 3, 5, 7, 11) == 4 * 2 * 3 * 5 * 7 * 11
    assert attention_flops(1, 1, 128, 128, 64, density=0.25) == pytest.approx(4 * 128 * 128 * 64 * 0.25)


def test_forward_backward_is_three_and_a_half_forwards():
    fwd = attention_flops(4, 16, 4096, 4096, 128, 0.5, FWD)
    assert attention_flops(4, 16, 4096, 4096, 128, 0.5, FWD_BWD) == pytest.approx(3.5 * fwd)
    assert Row("causal", 4, 4096, mode=FWD_BWD).flops(0.5) == pytest.approx(3.5 * fwd)


def test_density_outside_unit_interval_is_rejected():
    with pytest.raises(ValueError, match="density"):
        attention_flops(1, 1, 8, 8, 8, density=1.5)


def test_default_rows_are_the_issue_rows():
    fwd = {(r.variant, r.B, r.S, r.D) for r in ROW_SETS["fwd-default"]}
    for v in ("dense", "causal"):
        assert {(v, 8, 1024, 128), (v, 4, 4096, 128), (v, 1, 16384, 128), (v, 4, 4096, 64), (v, 1, 16384, 64)} <= fwd
    for v in ("sliding_window", "document", "alibi_causal", "softcap_causal"):
        assert {(v, 4, 4096, 128), (v, 1, 16384, 128)} <= fwd
    assert len(ROW_SETS["fwd-default"]) == 18
    bwd = ROW_SETS["bwd-default"]
    assert all(r.mode == FWD_BWD for r in bwd) and len(bwd) == 16
    assert {(r.variant, r.S) for r in bwd if r.D == 64} == {(v, 16384) for v in ("dense", "causal", "sliding_window", "document")}
    assert all(r.H == 16 and r.dtype == "bf16" for r in ROW_SETS["all"])


def test_select_rows_filters_and_rejects_unknown_sets():
    rows = select_rows("fwd-default,bwd-default", only="S16k")
    assert rows and all("S16k" in r.name for r in rows)
    either = select_rows("bwd-default", only="+bwd dense|+bwd causal")
    assert {r.name.split()[1] for r in either} == {"dense", "causal"}
    with pytest.raises(ValueError, match="unknown row set 'nope'"):
        select_rows("nope")
    with pytest.raises(ValueError, match="selects no rows"):
        select_rows("validate", only="no-such-row")


def test_row_validation_and_shrinking():
    with pytest.raises(ValueError, match="mode"):
        Row("causal", 1, 128, mode="bwd")
    with pytest.raises(ValueError, match="Row.S"):
        Row("causal", 1, 0)
    tiny = Row("document", 4, 4096, mode=FWD_BWD).shrunk()
    assert (tiny.B, tiny.S, tiny.H, tiny.variant, tiny.mode) == (1, 256, 2, "document", FWD_BWD)
    assert Row("causal", 1, 16384).name == "fwd causal B1 S16k H16 D128 bf16"
