"""The backends the benchmark races: flexlab's own kernels and its peers, each in its native calling convention.

Every peer is prepared once per row (compile, layout conversion) outside the timed region; what is timed is one
call as a user would write it. Tensors come in as (B, H, S, D); FA4 wants (B, S, H, D) (or packed (B·S, H, D) for
documents), so it gets contiguous copies in its own layout and its outputs are viewed back for the check.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from .cases import Case


class Unavailable(Exception):
    """This backend cannot run this row here (missing package or device, or the variant has no spelling for it)."""


@dataclass
class Prepared:
    """A ready-to-time call. `call()` returns the output in the backend's layout; `to_bhsd` converts it (and the
    gradients of `inputs`) back to (B, H, S, D) for the correctness check."""

    call: Callable[[], torch.Tensor]
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    to_bhsd: Callable[[torch.Tensor], torch.Tensor]
    from_bhsd: Callable[[torch.Tensor], torch.Tensor]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _leaves(q, k, v, grad: bool):
    return tuple(t.detach().clone().requires_grad_(grad) for t in (q, k, v))


def _need_cuda(q: torch.Tensor, name: str) -> None:
    if q.device.type != "cuda":
        raise Unavailable(f"{name} needs a CUDA device (inputs are on {q.device})")


def _flex_output(result):
    return result[0] if isinstance(result, tuple) else result


def prepare_flexlab(case: Case, q, k, v, block_mask, grad: bool, deterministic: bool = False) -> Prepared:
    from .. import flex_attention
    from ..backends import cute
    ql, kl, vl = _leaves(q, k, v, grad)
    ok, reason = cute.is_supported(ql, kl, vl, case.score_mod, block_mask, None, False)
    if not ok:
        raise Unavailable(f"backend='cute': {reason}")
    call = partial(flex_attention, ql, kl, vl, case.score_mod, block_mask, backend="cute", deterministic=deterministic)
    return Prepared(call, (ql, kl, vl), _same, _same)


def prepare_flexlab_deterministic(case: Case, q, k, v, block_mask, grad: bool) -> Prepared:
    """flexlab with bitwise-reproducible gradients: next to "flexlab" on a forward+backward row, it prices
    deterministic mode (ordered dQ accumulation, fixed-point captured-tensor grads)."""
    if not grad:
        raise Unavailable("deterministic mode changes only the backward; measured on forward+backward rows")
    return prepare_flexlab(case, q, k, v, block_mask, grad, deterministic=True)


def prepare_reference(case: Case, q, k, v, block_mask, grad: bool) -> Prepared:
    """flexlab's dense reference backend: only for tiny shapes (CPU tests), never a peer at benchmark sizes."""
    from .. import flex_attention
    ql, kl, vl = _leaves(q, k, v, grad)
    call = partial(flex_attention, ql, kl, vl, case.score_mod, block_mask, backend="reference")
    return Prepared(call, (ql, kl, vl), _same, _same)


def _prepare_torch_flex(case: Case, q, k, v, block_mask, grad: bool, name: str, kernel_options=None,
                        mode: str | None = None) -> Prepared:
    _need_cuda(q, name)
    from torch.nn.attention.flex_attention import flex_attention
    fn = flex_attention if kernel_options is None else partial(flex_attention, kernel_options=kernel_options)
    compiled = torch.compile(fn, dynamic=False, mode=mode)
    ql, kl, vl = _leaves(q, k, v, grad)

    def call():
        return _flex_output(compiled(ql, kl, vl, score_mod=case.score_mod, block_mask=block_mask))

    return Prepared(call, (ql, kl, vl), _same, _same)


def prepare_flex_triton(case, q, k, v, block_mask, grad):
    return _prepare_torch_flex(case, q, k, v, block_mask, grad, "flex-triton")


def prepare_flex_triton_autotune(case, q, k, v, block_mask, grad):
    # Autotuning costs about 20 s of compile per forward row and a minute per backward row, so it is measured
    # where the performance issue asks for it: the forward document-mask rows.
    if not case.autotune_peer or grad:
        raise Unavailable("max-autotune is measured on the forward document rows only")
    return _prepare_torch_flex(case, q, k, v, block_mask, grad, "flex-triton-autotune",
                               mode="max-autotune-no-cudagraphs")


def prepare_flex_flash(case, q, k, v, block_mask, grad):
    return _prepare_torch_flex(case, q, k, v, block_mask, grad, "flex-flash", kernel_options={"BACKEND": "FLASH"})


def prepare_fa4(case: Case, q, k, v, block_mask, grad: bool) -> Prepared:
    _need_cuda(q, "fa4")
    if case.fa4 is None:
        raise Unavailable(f"FA4's own API has no spelling for {case.variant!r}")
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception as err:  # ImportError, or a CUDA/cutlass problem raised at import
        raise Unavailable(f"flash_attn.cute cannot be imported: {type(err).__name__}: {err}") from err
    B, H, S, D = q.shape
    kwargs = dict(case.fa4)
    if "cu_seqlens" in kwargs:
        cu, max_len = kwargs.pop("cu_seqlens"), kwargs.pop("max_seqlen")

        def from_bhsd(t):
            return t.transpose(1, 2).reshape(B * S, H, D).contiguous()

        def to_bhsd(t):
            return t.view(B, S, H, D).transpose(1, 2)

        ql, kl, vl = (from_bhsd(t).requires_grad_(grad) for t in (q.detach(), k.detach(), v.detach()))

        def call():
            return _flex_output(flash_attn_varlen_func(ql, kl, vl, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                       max_seqlen_q=max_len, max_seqlen_k=max_len, **kwargs))
    else:
        def from_bhsd(t):
            return t.transpose(1, 2).contiguous()

        def to_bhsd(t):
            return t.transpose(1, 2)

        ql, kl, vl = (from_bhsd(t).requires_grad_(grad) for t in (q.detach(), k.detach(), v.detach()))

        def call():
            return _flex_output(flash_attn_func(ql, kl, vl, **kwargs))

    return Prepared(call, (ql, kl, vl), to_bhsd, from_bhsd)


def prepare_sdpa(case: Case, q, k, v, block_mask, grad: bool) -> Prepared:
    if case.sdpa is None:
        raise Unavailable(f"SDPA has no score_mod and a mask tensor would be a different (dense) algorithm; "
                          f"{case.variant!r} is n/a")
    ql, kl, vl = _leaves(q, k, v, grad)
    kwargs = dict(case.sdpa)
    call = partial(torch.nn.functional.scaled_dot_product_attention, ql, kl, vl, **kwargs)
    return Prepared(call, (ql, kl, vl), _same, _same)


# name -> (prepare, substrings one of which the largest GPU kernel's name must contain; None: no expectation).
# A compiled flex call that silently ran torch's unfused path shows cuBLAS/softmax kernels instead.
PEERS: dict[str, tuple[Callable, tuple[str, ...] | None]] = {
    "flexlab": (prepare_flexlab, None),
    "flexlab-deterministic": (prepare_flexlab_deterministic, None),
    "flex-triton": (prepare_flex_triton, ("triton_tem", "flex")),
    "flex-triton-autotune": (prepare_flex_triton_autotune, ("triton_tem", "flex")),
    "flex-flash": (prepare_flex_flash, ("flash", "fmha", "cutlass", "cute")),
    "fa4": (prepare_fa4, ("flash", "fmha", "cutlass", "cute")),
    "sdpa": (prepare_sdpa, None),
    "reference": (prepare_reference, None),
}
DEFAULT_BACKENDS = ("flexlab", "flexlab-deterministic", "flex-triton", "flex-triton-autotune", "flex-flash", "fa4",
                    "sdpa")
PEER_BACKENDS = tuple(b for b in DEFAULT_BACKENDS if not b.startswith("flexlab"))


def parse_backends(spec: str) -> list[str]:
    """`all` (flexlab and every peer), `peers` (peers only), or a comma-separated list of names."""
    if spec == "all":
        return list(DEFAULT_BACKENDS)
    if spec == "peers":
        return list(PEER_BACKENDS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown or not names:
        raise ValueError(f"--backends: unknown backend(s) {unknown or spec!r}; choose from all, peers, "
                         f"{', '.join(PEERS)}")
    return names
