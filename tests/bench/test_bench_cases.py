"""Each peer's spelling of a variant must be the same function as the flex mods it is compared with."""
import pytest
import torch

import flexlab
from flexlab.bench.cases import SLIDING_WINDOW, SOFTCAP, VARIANTS, build_case, document_cu_seqlens
from flexlab.bench.peers import PEERS, Unavailable, parse_backends, prepare_fa4, prepare_sdpa
from flexlab.bench.runner import _kernel_note


def _fa_style_mask(S, causal, window_left=None):
    """The mask FA4's flags describe: kv <= q when causal, kv >= q - window_left with a left window."""
    q = torch.arange(S)[:, None]
    kv = torch.arange(S)[None, :]
    keep = torch.ones(S, S, dtype=torch.bool)
    if causal:
        keep &= kv <= q
    if window_left is not None:
        keep &= kv >= q - window_left
    return keep


@pytest.mark.parametrize("variant", ["causal", "sliding_window"])
def test_fa4_flags_describe_the_gallery_mask(variant):
    S = 1500  # longer than the window, so the window actually cuts
    case = build_case(variant, 1, 1, S, "cpu")
    window = case.fa4.get("window_size", (None, None))[0]
    expected = _fa_style_mask(S, case.fa4["causal"], window)
    assert torch.equal(flexlab.create_mask(case.mask_mod, 1, 1, S, S)[0, 0], expected)
    if variant == "sliding_window":
        assert window == SLIDING_WINDOW - 1


def test_fa4_varlen_offsets_pack_each_batch_rows_documents():
    S, B = 1000, 3
    case = build_case("document", B, 2, S, "cpu")
    cu, max_len = case.fa4["cu_seqlens"], case.fa4["max_seqlen"]
    doc = case.tensors["document_id"]
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == B * S
    lengths = cu.diff()
    assert len(lengths) == 8 * B and int(lengths.max()) == max_len
    # Within one batch row, the segments are exactly the runs of equal document ids.
    starts = cu[:8].tolist()
    assert all(doc[s] != doc[s - 1] for s in starts[1:]) and starts[0] == 0
    assert torch.equal(document_cu_seqlens(doc, 1)[0], cu[:9])


def test_softcap_case_uses_the_cap_fa4_is_given():
    case = build_case("softcap_causal", 1, 1, 64, "cpu")
    score = torch.tensor(55.0)
    zero = torch.tensor(0)
    assert case.fa4["softcap"] == SOFTCAP
    assert case.score_mod(score, zero, zero, zero, zero).item() == pytest.approx(SOFTCAP * torch.tanh(score / SOFTCAP))


def test_peers_without_a_spelling_are_unavailable_not_wrong():
    q = torch.randn(1, 2, 64, 16)
    alibi = build_case("alibi_causal", 1, 2, 64, "cpu")
    with pytest.raises(Unavailable, match="SDPA"):
        prepare_sdpa(alibi, q, q, q, None, False)
    with pytest.raises(Unavailable, match="CUDA"):
        prepare_fa4(alibi, q, q, q, None, False)
    assert build_case("document", 1, 2, 64, "cpu").sdpa is None
    with pytest.raises(ValueError, match="unknown benchmark variant"):
        build_case("nope", 1, 1, 8, "cpu")
    assert set(VARIANTS) == {"dense", "causal", "sliding_window", "document", "alibi_causal", "softcap_causal"}


def test_parse_backends():
    assert parse_backends("all")[0] == "flexlab"
    assert "flexlab" not in parse_backends("peers") and "fa4" in parse_backends("peers")
    assert parse_backends("sdpa, fa4") == ["sdpa", "fa4"]
    with pytest.raises(ValueError, match="unknown backend"):
        parse_backends("sdpa,flash3")
    assert set(parse_backends("all")) <= set(PEERS)


def test_kernel_names_reveal_an_unfused_fallback():
    expect = PEERS["flex-triton"][1]
    assert _kernel_note(expect, [("triton_tem_fused_flex_attention_0", 0.7)]) is None
    note = _kernel_note(expect, [("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNT", 3.0), ("triton_poi_fused_0", 1.0)])
    assert note and "fall-back" in note
    assert _kernel_note(PEERS["fa4"][1], [("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90", 0.4)]) is None
    assert _kernel_note(None, [("anything", 1.0)]) is None


def test_cases_name_the_gallery_variants_they_run():
    assert build_case("softcap_causal", 1, 1, 64, "cpu").gallery_variants == ["softcap", "causal"]
    assert build_case("document", 1, 1, 64, "cpu").gallery_variants == ["document"]
    assert build_case("dense", 1, 1, 64, "cpu").gallery_variants == []


def test_deterministic_flexlab_is_measured_on_training_rows_only():
    from flexlab.bench.peers import PEER_BACKENDS, prepare_flexlab_deterministic
    assert "flexlab-deterministic" in parse_backends("all") and "flexlab-deterministic" not in PEER_BACKENDS
    with pytest.raises(Unavailable, match="only the backward"):
        prepare_flexlab_deterministic(None, None, None, None, None, grad=False)
