"""Block-sparsity inspector: what the kernel will actually do with a BlockMask at its tile size.

torch's ``print(block_mask)`` merges partial and full tiles, yet they cost different amounts: a full tile skips the
mask_mod, a partial one masks every element (evaluating the mask_mod, or testing bits stored once per mask where the
mask_mod reads captured tensors), an empty one is never loaded. This module counts the three
states per (b, h), turns them into work (FLOPs computed and skipped, kv tiles per Q tile), simulates how our
kernel's CTAs, issued heaviest Q tile first, spread over the SMs, and measures what building the mask cost.
"""
from __future__ import annotations

import heapq
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch.nn.attention.flex_attention import BlockMask

from ..errors import FlexlabTypeError, FlexlabValueError, check_positive_int
from ..kernels.config import H200_SMS
from ..mask import BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL, block_states, create_block_mask

#: Streaming multiprocessors of an H200 (SXM); the default for the load-balance simulation.
STATE_NAMES = {BLOCK_EMPTY: "empty", BLOCK_PARTIAL: "partial", BLOCK_FULL: "full"}
STATE_COLORS = {BLOCK_EMPTY: "#f2f2f2", BLOCK_PARTIAL: "#f4a259", BLOCK_FULL: "#2a6f97"}


# ----------------------------------------------------------------------------------------------- build cost
@dataclass(frozen=True)
class BuildCost:
    """Wall time and peak memory growth of building a BlockMask (host RSS, plus CUDA allocator when on GPU)."""

    seconds: float
    peak_host_bytes: int
    peak_device_bytes: int = 0


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_build(fn: Callable[[], BlockMask], device="cpu", interval_s: float = 0.002) -> tuple[BlockMask, BuildCost]:
    """Call ``fn`` while a thread samples the process RSS; returns its result and the cost."""
    base = _rss_bytes()
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            stop.wait(interval_s)

    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        dev_base = torch.cuda.memory_allocated(device)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        result = fn()
        if cuda:
            torch.cuda.synchronize(device)
    finally:
        seconds = time.perf_counter() - t0
        stop.set()
        sampler.join()
    peak[0] = max(peak[0], _rss_bytes())
    dev_peak = torch.cuda.max_memory_allocated(device) - dev_base if cuda else 0
    return result, BuildCost(seconds, max(0, peak[0] - base), max(0, dev_peak))


# ----------------------------------------------------------------------------------------------- tiles
def coarsen_states(states: torch.Tensor, q_factor: int, kv_factor: int) -> torch.Tensor:
    """States at a tile ``q_factor`` x ``kv_factor`` times larger: empty if all parts are empty, full if all full.

    Parts past the end of the sequence are padding: like torch, a tile that sticks out of the sequence is never full.
    """
    if q_factor == 1 and kv_factor == 1:
        return states
    B, H, nq, nkv = states.shape
    pq, pk = (-nq) % q_factor, (-nkv) % kv_factor
    padded = torch.nn.functional.pad(states, (0, pk, 0, pq), value=-1)
    parts = padded.view(B, H, (nq + pq) // q_factor, q_factor, (nkv + pk) // kv_factor, kv_factor)
    parts = parts.permute(0, 1, 2, 4, 3, 5).reshape(B, H, (nq + pq) // q_factor, (nkv + pk) // kv_factor, -1)
    out = torch.full(parts.shape[:-1], BLOCK_EMPTY, dtype=torch.int8)
    out[((parts == BLOCK_PARTIAL) | (parts == BLOCK_FULL)).any(-1)] = BLOCK_PARTIAL
    out[(parts == BLOCK_FULL).all(-1)] = BLOCK_FULL
    return out


def lpt_order(work: torch.Tensor, group: Optional[int] = None, ranked: bool = True) -> torch.Tensor:
    """Flat indices into ``work`` (B, H, n_q_tiles) in the order our forward kernel issues its CTAs.

    The kernel's rule (``flexlab.runtime.schedule.issue_order``): Q tiles are ranked longest-processing-time first
    by their work summed over batch and heads (stable for ties); (batch, head) pairs are dealt out in groups of
    ``group`` (default: all of them) whose K/V fit in L2, and inside a group the rank is the slow index and the
    head the fast one. ``ranked=False`` keeps Q tiles in index order (no block-mask ranking). A 1-D ``work`` is
    treated as (1, 1, n).
    """
    from ..runtime.schedule import issue_order

    w = work.reshape(1, 1, -1) if work.dim() == 1 else work
    B, H, nq = w.shape
    rank = torch.argsort(-w.to(torch.float64).sum(dim=(0, 1)), stable=True) if ranked else None
    rows = issue_order(nq, B * H, group or B * H, rank)
    return rows[:, 1] * nq + rows[:, 0]


def simulate_sms(work: torch.Tensor, order: torch.Tensor, num_sms: int) -> torch.Tensor:
    """Per-SM total work when each SM, as soon as it is free, takes the next item of ``order`` (float64, (num_sms,))."""
    flat = work.reshape(-1).to(torch.float64).tolist()
    heap = [(0.0, sm) for sm in range(num_sms)]
    loads = [0.0] * num_sms
    for i in order.tolist():
        load, sm = heapq.heappop(heap)
        loads[sm] = load + flat[i]
        heapq.heappush(heap, (loads[sm], sm))
    return torch.tensor(loads, dtype=torch.float64)


def _imbalance(loads: torch.Tensor) -> float:
    mean = float(loads.mean())
    return float(loads.max()) / mean if mean > 0 else 1.0


# ----------------------------------------------------------------------------------------------- report
@dataclass
class SparsityReport:
    """Tile states of a mask at one kernel tile size and what they mean for the kernel.

    ``states`` is int8 (B, H, n_q_tiles, n_kv_tiles) with 0 empty, 1 partial, 2 full; everything else is derived.
    """

    states: torch.Tensor
    tile: tuple[int, int]
    seq_lengths: tuple[int, int]
    head_dim: int = 128
    num_sms: int = H200_SMS
    partial_cost: float = 1.0
    build_cost: Optional[BuildCost] = None
    name: str = "mask"
    # how our kernels mask a partial tile (`partial_tile_masking`); "" when unknown (no mask_mod)
    partial_masking: str = ""
    _cache: dict = field(default_factory=dict, repr=False)

    # -- counts ----------------------------------------------------------------------------------------------
    def counts(self, b: Optional[int] = None, h: Optional[int] = None) -> dict[str, int]:
        """Number of empty / partial / full tiles, over everything or for one (b, h)."""
        s = self._select(b, h)
        return {"empty": int((s == BLOCK_EMPTY).sum()), "partial": int((s == BLOCK_PARTIAL).sum()),
                "full": int((s == BLOCK_FULL).sum()), "total": int(s.numel())}

    def _select(self, b, h) -> torch.Tensor:
        s = self.states
        if b is not None:
            s = s[min(b, s.shape[0] - 1)]
        if h is not None:
            s = s[..., min(h, s.shape[-3] - 1), :, :]
        return s

    def _tile_elems(self) -> torch.Tensor:
        """(n_q, n_kv) number of real (q, kv) pairs per tile: edge tiles are clipped by the sequence lengths."""
        key = "tile_elems"
        if key not in self._cache:
            (tq, tk), (sq, sk) = self.tile, self.seq_lengths
            nq, nk = self.states.shape[-2:]
            rows = torch.clamp(sq - torch.arange(nq) * tq, max=tq).to(torch.float64)
            cols = torch.clamp(sk - torch.arange(nk) * tk, max=tk).to(torch.float64)
            self._cache[key] = rows[:, None] * cols[None, :]
        return self._cache[key]

    def stats(self, b: Optional[int] = None, h: Optional[int] = None) -> dict[str, float]:
        """Density, partial share, FLOPs and load balance; per (b, h) when given, else over the whole mask."""
        s = self._select(b, h)
        c = self.counts(b, h)
        nonempty = c["partial"] + c["full"]
        elems = self._tile_elems().expand(s.shape)
        flops_per_pair = 4.0 * self.head_dim              # QK^T and PV, 2 FLOPs per multiply-add each
        dense = float(elems.sum()) * flops_per_pair
        computed = float(elems[s != BLOCK_EMPTY].sum()) * flops_per_pair
        loads = self.sm_loads() if (b is None and h is None) else None
        out = {
            "tiles": c["total"], "empty": c["empty"], "partial": c["partial"], "full": c["full"],
            "density": nonempty / c["total"] if c["total"] else 0.0,
            "partial_share": c["partial"] / nonempty if nonempty else 0.0,
            "flops_dense": dense, "flops_computed": computed, "flops_skipped": dense - computed,
            "flops_skipped_share": (dense - computed) / dense if dense else 0.0,
        }
        if loads is not None:
            out["sm_imbalance"] = _imbalance(loads)
            out["sm_imbalance_naive"] = _imbalance(self.sm_loads(order="naive"))
        if self.build_cost is not None:
            out["build_seconds"] = self.build_cost.seconds
            out["build_peak_host_bytes"] = float(self.build_cost.peak_host_bytes)
            out["build_peak_device_bytes"] = float(self.build_cost.peak_device_bytes)
        return out

    # -- work and scheduling ---------------------------------------------------------------------------------
    def q_tile_work(self) -> torch.Tensor:
        """(B, H, n_q_tiles) float64: kv tiles each Q tile visits, a partial tile weighted by ``partial_cost``."""
        s = self.states
        return ((s == BLOCK_FULL).sum(-1).to(torch.float64)
                + self.partial_cost * (s == BLOCK_PARTIAL).sum(-1).to(torch.float64))

    def head_group(self) -> int:
        """(batch, head) pairs the kernel keeps in flight together so their K/V share L2 (bf16 K/V, no GQA)."""
        from ..runtime.schedule import heads_per_group
        B, H = self.states.shape[:2]
        return heads_per_group(self.seq_lengths[1], self.head_dim, 2, 1, B * H)

    def schedule(self) -> torch.Tensor:
        """(n_items, 3) int64 rows (b, h, q_tile) in the order the kernel issues them (heaviest Q tiles first)."""
        work = self.q_tile_work()
        order = lpt_order(work, self.head_group())
        B, H, nq = work.shape
        return torch.stack([order // (H * nq), (order // nq) % H, order % nq], dim=1)

    def sm_loads(self, order: str = "lpt") -> torch.Tensor:
        """Work per SM (in kv tiles) for the kernel's ranked order or Q tiles in index order (``order="naive"``)."""
        key = f"loads_{order}"
        if key not in self._cache:
            work = self.q_tile_work()
            if order not in ("lpt", "naive"):
                raise FlexlabValueError(f"order must be 'lpt' or 'naive', got {order!r}")
            idx = lpt_order(work, self.head_group(), ranked=order == "lpt")
            self._cache[key] = simulate_sms(work, idx, self.num_sms)
        return self._cache[key]

    # -- figures ---------------------------------------------------------------------------------------------
    def states_trace(self, b: int = 0, h: int = 0, showscale: bool = True):
        import plotly.graph_objects as go

        s = self._select(b, h).to(torch.int64)
        (tq, tk), (sq, sk) = self.tile, self.seq_lengths
        nq, nk = s.shape
        q0, k0 = torch.arange(nq) * tq, torch.arange(nk) * tk
        names = [[STATE_NAMES[int(v)] for v in row] for row in s.tolist()]
        ranking = torch.argsort(-self.q_tile_work().sum(dim=(0, 1)), stable=True)
        rank_of = torch.empty_like(ranking)
        rank_of[ranking] = torch.arange(nq)
        custom = [[[int(q0[i]), min(sq, int(q0[i]) + tq) - 1, int(k0[j]), min(sk, int(k0[j]) + tk) - 1, names[i][j],
                    int(rank_of[i])] for j in range(nk)] for i in range(nq)]
        scale = [[0.0, STATE_COLORS[0]], [1 / 3, STATE_COLORS[0]], [1 / 3, STATE_COLORS[1]],
                 [2 / 3, STATE_COLORS[1]], [2 / 3, STATE_COLORS[2]], [1.0, STATE_COLORS[2]]]
        return go.Heatmap(
            z=s.numpy(), x=list(range(nk)), y=list(range(nq)), customdata=custom, zmin=-0.5, zmax=2.5,
            colorscale=scale, xgap=1 if nk <= 64 else 0, ygap=1 if nq <= 64 else 0, showscale=showscale,
            colorbar=dict(tickvals=[0, 1, 2], ticktext=["empty", "partial", "full"], len=0.6),
            hovertemplate=("q tile %{y} (q %{customdata[0]}–%{customdata[1]})<br>"
                           "kv tile %{x} (kv %{customdata[2]}–%{customdata[3]})<br>%{customdata[4]}"
                           "<br>Q tile issued at rank %{customdata[5]}"
                           f"<extra>{self.name}</extra>"))

    def figure(self, b: int = 0, h: int = 0):
        """Tile states for (b, h), the per-Q-tile work histogram, and per-SM load under LPT vs naive order."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        st = self.stats()
        fig = make_subplots(rows=1, cols=3, column_widths=[0.44, 0.28, 0.28], horizontal_spacing=0.08,
                            subplot_titles=[f"tiles {self.tile[0]}×{self.tile[1]} (b={b}, h={h})",
                                            "kv tiles per Q tile", f"load on {self.num_sms} SMs"])
        fig.add_trace(self.states_trace(b, h), row=1, col=1)
        _tile_axes(fig, self.states.shape[-2:], 1)
        work = self.q_tile_work().reshape(-1)
        values, freq = torch.unique(work, return_counts=True)
        fig.add_trace(go.Bar(x=values.tolist(), y=freq.tolist(), name="Q tiles", marker_color="#2a6f97",
                             hovertemplate="%{y} Q tiles visit %{x} kv tiles<extra></extra>"), row=1, col=2)
        fig.update_xaxes(title_text="kv tiles visited", row=1, col=2)
        fig.update_yaxes(title_text="Q tiles", row=1, col=2)
        for order, color in (("naive", "#c9c9c9"), ("lpt", "#f4a259")):
            loads = self.sm_loads(order).sort(descending=True).values
            fig.add_trace(go.Bar(x=list(range(self.num_sms)), y=loads.tolist(), name=f"{order} order",
                                 marker_color=color, hovertemplate="SM %{x}: %{y} kv tiles<extra>" + order
                                 + "</extra>"), row=1, col=3)
        fig.update_xaxes(title_text="SM (sorted by load)", row=1, col=3)
        fig.update_layout(
            barmode="overlay", height=430, width=1000, legend=dict(x=0.7, y=1.16, orientation="h"),
            title=dict(text=(f"{self.name}: density {st['density']:.1%}, partial {st['partial_share']:.1%} of "
                             f"visited tiles, {st['flops_skipped_share']:.1%} FLOPs skipped, SM imbalance "
                             f"{st['sm_imbalance']:.2f}× (naive {st['sm_imbalance_naive']:.2f}×)"),
                       font=dict(size=13)),
            margin=dict(t=110))
        fig.layout.meta = dict(flexlab="sparsity", tile=list(self.tile))
        return fig

    def widget(self):
        """The figure with b / h sliders (ipywidgets) to walk through the batches and heads of the mask."""
        import plotly.graph_objects as go

        from .bh_sliders import figure_with_bh_sliders

        def redraw(fig, b, h):
            trace = self.states_trace(b, h)
            with fig.batch_update():
                fig.data[0].z, fig.data[0].customdata = trace.z, trace.customdata
                fig.layout.annotations[0].text = f"tiles {self.tile[0]}×{self.tile[1]} (b={b}, h={h})"

        B, H = self.states.shape[:2]
        return figure_with_bh_sliders(go.FigureWidget(self.figure()), B, H, redraw, "flexlab-sparsity-widget")

    def table_rows(self) -> list[tuple[str, str]]:
        st = self.stats()
        rows = [("tile (q × kv)", f"{self.tile[0]} × {self.tile[1]}"),
                ("sequence (q × kv)", f"{self.seq_lengths[0]} × {self.seq_lengths[1]}"),
                ("(B, H)", f"({self.states.shape[0]}, {self.states.shape[1]})"),
                ("tiles", f"{st['tiles']:,}"),
                ("empty / partial / full", f"{st['empty']:,} / {st['partial']:,} / {st['full']:,}"),
                ("density (visited tiles)", f"{st['density']:.2%}"),
                ("partial share of visited", f"{st['partial_share']:.2%}"),
                ("FLOPs computed / dense", f"{st['flops_computed']:.3g} / {st['flops_dense']:.3g}"),
                ("FLOPs skipped", f"{st['flops_skipped']:.3g} ({st['flops_skipped_share']:.2%})"),
                (f"SM load imbalance ({self.num_sms} SMs, max/mean)",
                 f"{st['sm_imbalance']:.3f}× ranked order, {st['sm_imbalance_naive']:.3f}× index order")]
        if self.partial_masking:
            rows.append(("partial tiles masked by", self.partial_masking))
        if self.build_cost is not None:
            rows.append(("mask build", f"{self.build_cost.seconds * 1e3:.1f} ms, peak +"
                                       f"{self.build_cost.peak_host_bytes / 2**20:.1f} MiB host"
                                       + (f", +{self.build_cost.peak_device_bytes / 2**20:.1f} MiB device"
                                          if self.build_cost.peak_device_bytes else "")))
        return rows

    def _repr_html_(self) -> str:
        body = "".join(f"<tr><th style='text-align:left'>{k}</th><td style='text-align:left'>{v}</td></tr>"
                       for k, v in self.table_rows())
        return (f"<table class='flexlab-sparsity' data-testid='flexlab-sparsity'>"
                f"<caption style='text-align:left'><b>{self.name}</b></caption>{body}</table>")


def _tile_axes(fig, shape, col: int) -> None:
    """Matrix orientation (q tiles down, kv tiles across) with integer ticks."""
    nq, nk = (int(n) for n in shape)
    fig.update_yaxes(autorange="reversed", title_text="q tile", dtick=1 if nq <= 16 else None, row=1, col=col)
    fig.update_xaxes(title_text="kv tile", dtick=1 if nk <= 16 else None, row=1, col=col)


# ----------------------------------------------------------------------------------------------- entry points
def _tile_pair(tile) -> tuple[int, int]:
    pair = (tile, tile) if isinstance(tile, int) else tuple(tile)
    if len(pair) != 2 or not all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in pair):
        raise FlexlabValueError(f"tile must be a positive int or (q_tile, kv_tile), got {tile!r}")
    return pair


def inspect_blocks(mask, B: Optional[int] = None, H: Optional[int] = None, Q_LEN: Optional[int] = None,
                   KV_LEN: Optional[int] = None, *, tile=(128, 128), head_dim: int = 128, num_sms: int = H200_SMS,
                   partial_cost: float = 1.0, device="cpu", name: Optional[str] = None) -> SparsityReport:
    """Inspect a ``BlockMask`` or a mask_mod at a kernel tile size.

    Args:
        mask: a ``BlockMask`` (its own block size must divide ``tile``, or its mask_mod is re-blocked at ``tile``)
            or a ``mask_mod(b, h, q_idx, kv_idx)`` (then ``Q_LEN`` is required; the build cost is measured).
        tile: (q_tile, kv_tile); 128×128 is our Hopper forward tile, (256, 128) a Blackwell-style one.
        head_dim: D, used for FLOP counts.
        num_sms: SMs in the load-balance simulation (132 on an H200).
        partial_cost: relative cost of a partial tile vs a full one in the work model.
    """
    tq, tk = _tile_pair(tile)
    for arg, value in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if value is not None:
            check_positive_int(arg, value, "inspect_blocks")
    check_positive_int("head_dim", head_dim, "inspect_blocks")
    check_positive_int("num_sms", num_sms, "inspect_blocks")
    if not (isinstance(partial_cost, (int, float)) and 0 < partial_cost < math.inf):
        raise FlexlabValueError(f"inspect_blocks: partial_cost must be a positive number, got {partial_cost!r}")
    cost = None
    if isinstance(mask, BlockMask):
        bq, bk = (int(x) for x in mask.BLOCK_SIZE)
        seq = tuple(int(x) for x in mask.seq_lengths)
        if tq % bq == 0 and tk % bk == 0:
            states = coarsen_states(block_states(mask).cpu(), tq // bq, tk // bk)
        elif mask.mask_mod is not None:
            Bm, Hm = mask.kv_num_blocks.shape[:2]
            mask, cost = measure_build(
                lambda: create_block_mask(mask.mask_mod, Bm, Hm, seq[0], seq[1], device=device,
                                          BLOCK_SIZE=(tq, tk)), device)
            states = block_states(mask).cpu()
        else:
            raise FlexlabValueError(f"tile {tq}×{tk} is not a multiple of the BlockMask's block size {bq}×{bk} "
                                    "and it has no mask_mod to rebuild from")
        label = name or getattr(mask.mask_mod, "__name__", "mask")
    elif callable(mask):
        if Q_LEN is None:
            raise FlexlabValueError("inspect_blocks(mask_mod, ...) needs Q_LEN (and KV_LEN if different)")
        seq = (int(Q_LEN), int(KV_LEN if KV_LEN is not None else Q_LEN))
        built, cost = measure_build(
            lambda: create_block_mask(mask, B or 1, H or 1, seq[0], seq[1], device=device, BLOCK_SIZE=(tq, tk)),
            device)
        states = block_states(built).cpu()
        label = name or getattr(mask, "__name__", "mask_mod")
    else:
        raise FlexlabTypeError(f"mask must be a BlockMask or a mask_mod callable, got {type(mask).__name__}")
    # A mask shared over batch/heads (size 1 there) still launches B*H CTAs per Q tile: expand it for the
    # load-balance simulation when the caller says how many there are.
    for dim, want in ((0, B), (1, H)):
        if want is not None and states.shape[dim] != want:
            if states.shape[dim] != 1:
                raise FlexlabValueError(f"the mask has {states.shape[dim]} {'batches' if dim == 0 else 'heads'}, "
                                        f"cannot view it as {want}")
            states = states.expand(*[want if d == dim else n for d, n in enumerate(states.shape)])
    if seq[1] % tk and states.shape[-1] * tk > seq[1]:
        # The kernel runs the ragged last KV tile as partial (its key tail is masked there), full or not.
        states = states.clone()
        last = states[..., -1]
        last[last == BLOCK_FULL] = BLOCK_PARTIAL
    mask_mod = mask.mask_mod if isinstance(mask, BlockMask) else mask
    return SparsityReport(states, (tq, tk), seq, head_dim=head_dim, num_sms=num_sms, partial_cost=partial_cost,
                          build_cost=cost, name=label, partial_masking=partial_tile_masking(mask_mod, states, tq))


def partial_tile_masking(mask_mod, states: torch.Tensor, tile_q: int = 128) -> str:
    """How flexlab's kernels mask the partial tiles of this mask: the mask_mod evaluated per score in registers, or
    (where it reads captured tensors) bits stored once per block mask (`runtime.mask_bits`), with their size for
    these tile states ((B, H, Q tiles, KV tiles) as `inspect_blocks` builds them); "" without a mask_mod."""
    from torch.nn.attention.flex_attention import noop_mask
    if mask_mod is None or mask_mod is noop_mask:
        return ""
    try:
        from ..backends.cute import _lowered
        store = _lowered(None, mask_mod).stored_masks
    except Exception as e:  # noqa: BLE001 - a mask the code generator cannot lower still has tile states
        return f"mask_mod per score (the code generator cannot lower it: {type(e).__name__})"
    if store is None:
        return "mask_mod evaluated per score in registers"
    longest = int((states == BLOCK_PARTIAL).sum(-1).max()) if states.numel() else 0
    copies = (states.shape[0] if store.varies_b else 1) * (states.shape[1] if store.varies_h else 1)
    size = copies * states.shape[2] * max(1, longest) * tile_q * 16  # 4 words of 4 bytes per row
    return (f"stored bits, {size / 1024:,.0f} KiB (its mask_mod reads captured tensors: evaluated once per block "
            f"mask, one bit per score)")


@dataclass
class SparsityComparison:
    """Two inspected masks side by side: a figure and a stats table with both columns."""

    a: SparsityReport
    b: SparsityReport

    def figure(self, b: int = 0, h: int = 0):
        from plotly.subplots import make_subplots

        fig = make_subplots(rows=1, cols=2, subplot_titles=[self.a.name, self.b.name], horizontal_spacing=0.08)
        fig.add_trace(self.a.states_trace(b, h, showscale=False), row=1, col=1)
        fig.add_trace(self.b.states_trace(b, h), row=1, col=2)
        _tile_axes(fig, self.a.states.shape[-2:], 1)
        _tile_axes(fig, self.b.states.shape[-2:], 2)
        sa, sb = self.a.stats(), self.b.stats()
        fig.update_layout(height=440, width=940, margin=dict(t=110),
                          title=dict(text=f"density {sa['density']:.1%} vs {sb['density']:.1%}, SM imbalance "
                                          f"{sa['sm_imbalance']:.2f}× vs {sb['sm_imbalance']:.2f}×",
                                     font=dict(size=13)))
        fig.layout.meta = dict(flexlab="sparsity_compare")
        return fig

    def _repr_html_(self) -> str:
        ra, rb = dict(self.a.table_rows()), dict(self.b.table_rows())
        keys = list(dict.fromkeys(list(ra) + list(rb)))
        body = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{ra.get(k, '')}</td><td>{rb.get(k, '')}</td>"
                       f"</tr>" for k in keys)
        return (f"<table class='flexlab-sparsity-compare'><tr><th></th><th>{self.a.name}</th><th>{self.b.name}"
                f"</th></tr>{body}</table>")


def compare_blocks(mask_a, mask_b, B: Optional[int] = None, H: Optional[int] = None, Q_LEN: Optional[int] = None,
                   KV_LEN: Optional[int] = None, *, names: Sequence[str] | None = None, **kwargs) -> SparsityComparison:
    """Inspect two masks with the same options (see :func:`inspect_blocks`) for a side-by-side comparison."""
    names = list(names) if names else [None, None]
    a = inspect_blocks(mask_a, B, H, Q_LEN, KV_LEN, name=names[0], **kwargs)
    b = inspect_blocks(mask_b, B, H, Q_LEN, KV_LEN, name=names[1], **kwargs)
    if a.name == b.name:
        a.name, b.name = f"A: {a.name}", f"B: {b.name}"
    return SparsityComparison(a, b)
