"""The inspector's counts are the BlockMask's own, re-tiling agrees with a fresh build, and the scheduler is LPT."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

pytest.importorskip("plotly")

from flexlab import create_block_mask  # noqa: E402
from flexlab.viz.sparsity import (coarsen_states, compare_blocks, inspect_blocks, lpt_order,  # noqa: E402
                                  simulate_sms)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def per_head_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 64 * (h + 1))


@pytest.mark.parametrize("q_len,kv_len", [(256, 256), (1000, 777)])
def test_counts_equal_block_mask_tensors(q_len, kv_len):
    bm = create_block_mask(per_head_window, 2, 3, q_len, kv_len, BLOCK_SIZE=128)
    rep = inspect_blocks(bm)
    for b in range(2):
        for h in range(3):
            c = rep.counts(b, h)
            assert c["partial"] == int(bm.kv_num_blocks[b, h].sum())
            assert c["full"] == int(bm.full_kv_num_blocks[b, h].sum())
            assert c["total"] == -(-q_len // 128) * -(-kv_len // 128)
            assert c["empty"] == c["total"] - c["partial"] - c["full"]
    total = rep.counts()
    assert total["partial"] == int(bm.kv_num_blocks.sum()) and total["full"] == int(bm.full_kv_num_blocks.sum())


def test_states_match_dense_mask_per_tile():
    q_len, kv_len, t = 300, 200, 64
    rep = inspect_blocks(per_head_window, 1, 2, q_len, kv_len, tile=t)
    dense = create_mask(per_head_window, 1, 2, q_len, kv_len, device="cpu")
    for h in range(2):
        for i in range(rep.states.shape[2]):
            for j in range(rep.states.shape[3]):
                block = dense[0, h, i * t:(i + 1) * t, j * t:(j + 1) * t]
                whole = block.shape == (t, t)          # like torch, a ragged edge tile is never full
                want = 0 if not block.any() else (2 if block.all() and whole else 1)
                assert int(rep.states[0, h, i, j]) == want


@pytest.mark.parametrize("tile", [(256, 128), (128, 256), (512, 384)])
def test_coarser_tile_equals_fresh_build(tile):
    q_len, kv_len = 1100, 900
    bm = create_block_mask(causal, 1, 1, q_len, kv_len, BLOCK_SIZE=128)
    fresh = inspect_blocks(causal, 1, 1, q_len, kv_len, tile=tile)
    coarse = inspect_blocks(bm, tile=tile)
    assert coarse.tile == tile and torch.equal(coarse.states, fresh.states)


def test_non_multiple_tile_rebuilds_from_mask_mod():
    bm = create_block_mask(causal, 1, 1, 500, 500, BLOCK_SIZE=128)
    rep = inspect_blocks(bm, tile=(96, 80))
    assert rep.states.shape[-2:] == (6, 7) and rep.build_cost is not None
    assert torch.equal(rep.states, inspect_blocks(causal, 1, 1, 500, tile=(96, 80)).states)


def test_flops_and_density():
    # 4 x 4 tiles of causal: 4 partial (diagonal), 6 full, 6 empty; edge tiles are whole.
    rep = inspect_blocks(causal, 1, 1, 512, tile=128, head_dim=64)
    st = rep.stats()
    assert (st["empty"], st["partial"], st["full"]) == (6, 4, 6)
    assert st["density"] == pytest.approx(10 / 16) and st["partial_share"] == pytest.approx(0.4)
    assert st["flops_dense"] == pytest.approx(4 * 64 * 512 * 512)
    assert st["flops_skipped"] == pytest.approx(4 * 64 * 6 * 128 * 128)
    assert st["build_seconds"] > 0 and st["build_peak_host_bytes"] >= 0


def test_edge_tiles_count_only_real_pairs():
    rep = inspect_blocks(lambda b, h, q, kv: q >= 0, 1, 1, 200, 130, tile=128, head_dim=1)
    assert rep.stats()["flops_dense"] == pytest.approx(4 * 200 * 130)
    assert rep.stats()["flops_skipped"] == 0


def test_q_tile_work_histogram_and_lpt_schedule():
    rep = inspect_blocks(causal, 2, 1, 1024, tile=128)
    work = rep.q_tile_work()
    assert work.shape == (2, 1, 8) and work[0, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    sched = rep.schedule()
    ordered = work[sched[:, 0], sched[:, 1], sched[:, 2]]
    assert torch.all(ordered[:-1] >= ordered[1:]) and len(sched) == 16
    assert sched[0].tolist() == [0, 0, 7] and sched[1].tolist() == [1, 0, 7]   # stable among ties


def test_lpt_balances_better_than_row_major():
    work = torch.tensor([1.0, 1, 1, 1, 1, 1, 6])
    lpt = simulate_sms(work, lpt_order(work), 2)
    naive = simulate_sms(work, torch.arange(7), 2)
    assert sorted(lpt.tolist()) == [6.0, 6.0] and max(naive.tolist()) == 9.0
    rep = inspect_blocks(causal, 4, 8, 2048, num_sms=16)
    st = rep.stats()
    assert 1.0 <= st["sm_imbalance"] <= st["sm_imbalance_naive"]
    assert float(rep.sm_loads().sum()) == pytest.approx(float(rep.q_tile_work().sum()))


def test_coarsen_rules():
    E, P, F = 0, 1, 2
    s = torch.tensor([[E, E, F, F], [E, E, F, F], [P, F, F, F], [F, F, E, F]], dtype=torch.int8)[None, None]
    assert coarsen_states(s, 2, 2)[0, 0].tolist() == [[E, F], [P, P]]
    # Tiles sticking out of the sequence are never full (torch pads them with masked-out pairs).
    assert coarsen_states(torch.full((1, 1, 3, 3), F, dtype=torch.int8), 2, 2)[0, 0].tolist() == [[F, P], [P, P]]


def test_figure_and_html():
    rep = inspect_blocks(per_head_window, 1, 2, 512, tile=128)
    fig = rep.figure(h=1)
    z = torch.tensor(fig.data[0].z)
    assert torch.equal(z, rep.states[0, 1].long())
    names = {0: "empty", 1: "partial", 2: "full"}
    assert [[c[4] for c in row] for row in fig.data[0].customdata] == [[names[v] for v in r] for r in z.tolist()]
    assert list(fig.data[0].customdata[1][0][:4]) == [128, 255, 0, 127]
    html = rep._repr_html_()
    assert "empty / partial / full" in html and "SM load imbalance" in html


def test_compare_two_masks():
    cmp = compare_blocks(causal, per_head_window, 1, 1, 1024)
    assert cmp.a.name == "causal" and cmp.b.name == "per_head_window"
    fig = cmp.figure()
    assert len(fig.data) == 2
    assert cmp.a.counts()["full"] > cmp.b.counts()["full"]
    assert "<th>causal</th>" in cmp._repr_html_()


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="needs Q_LEN"):
        inspect_blocks(causal)
    with pytest.raises(TypeError, match="BlockMask or a mask_mod"):
        inspect_blocks(42)
    with pytest.raises(ValueError, match="tile must be"):
        inspect_blocks(causal, Q_LEN=64, tile=(0, 128))


def test_shared_mask_expands_to_the_launch_batch_and_heads():
    bm = create_block_mask(causal, 1, 1, 1024, 1024)
    rep = inspect_blocks(bm, B=2, H=4, num_sms=8)
    assert rep.states.shape == (2, 4, 8, 8) and rep.counts()["full"] == 8 * 28
    assert rep.schedule().shape == (64, 3) and float(rep.sm_loads().sum()) == 8 * 36
    with pytest.raises(ValueError, match="cannot view it as 3"):
        inspect_blocks(create_block_mask(causal, 2, 1, 256, 256), B=3)


def test_widget_walks_heads():
    pytest.importorskip("ipywidgets")
    rep = inspect_blocks(per_head_window, 1, 3, 512)
    box = rep.widget()
    box.h_slider.value = 2
    assert torch.equal(torch.tensor(box.figure.data[0].z), rep.states[0, 2].long())
    assert "h=2" in box.figure.layout.annotations[0].text
    assert not torch.equal(rep.states[0, 0], rep.states[0, 2])


def test_issue_order_groups_heads_for_l2_like_the_kernel():
    # 4 (b, h) pairs in groups of 2: the first group's tiles all come before the second group's.
    work = torch.tensor([[[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]], [[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]]])
    order = lpt_order(work, group=2)
    rows = [(int(i) // 3, int(i) % 3) for i in order]            # (b*H + h, q tile)
    assert rows[:6] == [(0, 1), (1, 1), (0, 2), (1, 2), (0, 0), (1, 0)]
    assert {hb for hb, _ in rows[6:]} == {2, 3}
    naive = lpt_order(work, group=4, ranked=False)
    assert [int(i) % 3 for i in naive[:4]] == [0, 0, 0, 0]


def test_long_sequences_split_heads_into_l2_groups():
    rep = inspect_blocks(create_block_mask(causal, 1, 1, 8192, 8192), B=1, H=32, num_sms=132)
    assert 1 <= rep.head_group() < 32
    assert rep.schedule().shape == (32 * 64, 3)


def test_hover_shows_issue_rank_of_q_tile():
    rep = inspect_blocks(causal, 1, 1, 512)
    custom = rep.states_trace().customdata
    assert [row[0][5] for row in custom] == [3, 2, 1, 0]          # the last (longest) Q tile is issued first


def test_report_says_how_partial_tiles_are_masked():
    doc = torch.tensor([0] * 300 + [1] * 400 + [2] * 324, dtype=torch.int32)

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]
    rep = inspect_blocks(document, 1, 1, 1024, 1024)
    # partial tiles per Q tile at most 2 here: 8 Q tiles x 2 x 128 rows x 16 bytes
    longest = int((rep.states == 1).sum(-1).max())
    assert rep.partial_masking.startswith(f"stored bits, {8 * longest * 128 * 16 / 1024:,.0f} KiB")
    assert ("partial tiles masked by", rep.partial_masking) in rep.table_rows()
    assert inspect_blocks(causal, 1, 1, 512, 512).partial_masking == "mask_mod evaluated per score in registers"
