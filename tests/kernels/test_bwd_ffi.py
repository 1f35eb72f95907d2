"""The backward launch calls its three kernels through TVM-FFI with torch tensors, in the compiled layouts (no GPU).

`backward` runs here on CPU tensors with each compiled kernel replaced by a recorder, so the arguments it would hand
to TVM-FFI can be inspected:
  * the kernels are compiled for sm_90a with `--enable-tvm-ffi` and the environment stream, exactly as `backward`
    compiles them, and the TVM-FFI signature each compile produced is captured;
  * every recorded argument is checked against that signature the way TVM-FFI's generated wrapper checks it at the
    call (rank, dtype, static sizes and strides, shared symbolic sizes, divisibility, alignment, tuple lengths, None
    for inputs compiled as absent), and by name against the tensors the other kernels got (order);
  * a warm call reads nothing back from the device (no `.item()`, no `bool(tensor)`).
"""
from __future__ import annotations

import dataclasses
import re
import shutil
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from flexlab import _ops  # noqa: E402
from flexlab.kernels import bwd_launch  # noqa: E402

_TORCH_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                 torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8", torch.int8: "int8"}


# ---------------------------------------------------------------------------------------------- TVM-FFI signatures
@pytest.fixture
def signatures(monkeypatch):
    """Captures the TVM-FFI parameter list of every kernel compiled while the test runs (in compile order)."""
    from cutlass.cute._tvm_ffi_args_spec_converter import attach_args_spec_converter
    from cutlass.cutlass_dsl import CuTeDSL
    dsl = CuTeDSL._get_dsl()
    if dsl._tvm_ffi_args_spec_converter is None:
        attach_args_spec_converter(dsl)
    convert, seen = dsl._tvm_ffi_args_spec_converter, []

    def recording(*args, **kwargs):
        result = convert(*args, **kwargs)
        seen.append(result[0])
        return result

    monkeypatch.setattr(dsl, "_tvm_ffi_args_spec_converter", recording)
    return seen


def _same_dtype(spec_dtype, t: torch.Tensor) -> bool:
    want, got = str(spec_dtype), _TORCH_DTYPES.get(t.dtype, str(t.dtype))
    if want == got:
        return True
    # TVM-FFI accepts signed for unsigned integers of the same width (MLIR integers are signless)
    ints = re.compile(r"u?int(\d+)$")
    return bool(ints.match(want) and ints.match(got) and ints.match(want).group(1) == ints.match(got).group(1))


class _Binder:
    """What TVM-FFI's wrapper checks for one call: every symbolic size/stride bound once, equal wherever reused."""

    def __init__(self):
        self.bound: dict[int, tuple] = {}

    def bind(self, var, value: int, where: str, skip: bool = False):
        from cutlass.base_dsl.tvm_ffi_builder import spec
        if isinstance(var, int):
            assert skip or value == var, f"{where} = {value}, compiled as the constant {var}"
            return
        assert isinstance(var, spec.Var), (where, var)
        if id(var) in self.bound:
            first, first_where = self.bound[id(var)]
            assert skip or value == first, f"{where} = {value} must equal {first_where} = {first} (one symbol)"
            return
        if var.divisibility and not skip:
            assert value % var.divisibility == 0, f"{where} = {value} is not a multiple of {var.divisibility}"
        self.bound[id(var)] = (value, where)


def check_call(params: list, args: tuple) -> dict:
    """Asserts that `args` pass the TVM-FFI signature `params`; returns {parameter name: argument}."""
    from cutlass.base_dsl.tvm_ffi_builder import spec
    params = [p for p in params if not isinstance(p, spec.EnvStream)]  # torch's current stream, not an argument
    assert not any(isinstance(p, spec.Stream) for p in params), "an explicit stream would have to be passed"
    assert len(args) == len(params), f"{len(args)} arguments for {spec.signature('kernel', params)}"
    binder, devices = _Binder(), set()

    def check(p, a, where):
        if isinstance(p, spec.ConstNone):
            assert a is None, f"{where} was compiled as None but gets {type(a).__name__}"
        elif isinstance(p, spec.TupleParam):
            assert isinstance(a, (tuple, list)), f"{where}: a tuple was compiled, got {type(a).__name__}"
            assert len(a) == len(p.params), f"{where}: {len(a)} elements, compiled for {len(p.params)}"
            for i, (pp, aa) in enumerate(zip(p.params, a)):
                check(pp, aa, f"{where}[{i}]")
        elif isinstance(p, spec.Tensor):
            assert isinstance(a, torch.Tensor), f"{where}: a torch tensor goes to TVM-FFI, got {type(a).__name__}"
            devices.add(a.device)
            assert a.dim() == len(p.shape), f"{where}: rank {a.dim()}, compiled for {len(p.shape)}"
            assert _same_dtype(p.dtype, a), f"{where}: {a.dtype}, compiled for {p.dtype}"
            assert p.strides is not None, f"{where}: compiled without strides (contiguity only)"
            assert p.strides[-1] == 1, f"{where}: the last mode must be compiled with the static unit stride"
            if p.data_alignment:
                assert a.data_ptr() % p.data_alignment == 0, f"{where}: base not {p.data_alignment}-byte aligned"
            for i, n in enumerate(a.shape):
                binder.bind(p.shape[i], n, f"{where}.shape[{i}]")
            for i, s in enumerate(a.stride()):
                binder.bind(p.strides[i], s, f"{where}.strides[{i}]", skip=a.shape[i] == 1)
        elif isinstance(p, spec.Var):
            kind = str(p.dtype)
            if kind.startswith(("int", "uint")):
                assert isinstance(a, int) and -2 ** 31 <= a < 2 ** 31, f"{where}: an int32 was compiled, got {a!r}"
            else:
                assert kind.startswith("float") and isinstance(a, (int, float)), f"{where}: {kind}, got {a!r}"
        else:
            raise AssertionError(f"{where}: unexpected parameter kind {type(p).__name__}")

    named = {}
    for p, a in zip(params, args):
        check(p, a, p.name)
        named[p.name] = a
    assert len(devices) <= 1, f"one call, one device: {devices}"
    return named


def test_the_checker_rejects_what_tvm_ffi_rejects(signatures):
    """The checker itself: a static stride, a shared size, alignment and None must be enforced."""
    from flexlab.runtime.launch import tma_ready
    bwd_launch.compile_postprocess("bfloat16", 64)
    params = signatures[-1]
    acc = torch.zeros(2, 3, 64, 64)
    dq = torch.empty(2, 3, 50, 64, dtype=torch.bfloat16)
    check_call(params, (acc, dq, 0.125))
    with pytest.raises(AssertionError, match=r"mdQ\.strides"):
        check_call(params, (acc, torch.empty(2, 3, 64, 50, dtype=torch.bfloat16).transpose(2, 3), 0.125))
    with pytest.raises(AssertionError, match="compiled as the constant 64"):
        check_call(params, (torch.zeros(2, 3, 64, 128), dq, 0.125))
    with pytest.raises(AssertionError, match="aligned"):
        check_call(params, (acc, torch.empty(2 * 3 * 50 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 3, 50, 64),
                            0.125))
    with pytest.raises(AssertionError, match="torch tensor"):
        check_call(params, (acc, None, 0.125))
    assert tma_ready(dq) is dq


# ---------------------------------------------------------------------------------------------- the launch
def _learnable_bias():
    bias = torch.randn(4, 129, requires_grad=True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -64, 64) + 64]
    return rel_bias


def _document_mask(S):
    doc = (torch.arange(S) * 3 // S).to(torch.int64)  # int64: the kernel reads it narrowed to int32

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    return document


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _problem(D, score_mod=None, mask_mod=None, B=2, Hq=4, Hkv=2, S=300, dlse=False):
    """CPU inputs as the autograd formula hands them to `flex_attention_bwd`."""
    import flexlab
    entry = _ops.mod_entry(_ops.register_mods(score_mod, mask_mod))
    mask_tensors, block_size = [], []
    if mask_mod is not None:
        bm = flexlab.create_block_mask(mask_mod, 1, 1, S, S, BLOCK_SIZE=128)
        mask_tensors = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                        bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices]
        block_size = [128, 128]
    q = torch.randn(B, Hq, S, D, dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, S, D, dtype=torch.bfloat16) for _ in range(2))
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(B, Hq, S)
    return SimpleNamespace(
        q=q, k=k, v=v, out=out, dout=dout, lse=lse, dlse=torch.randn(B, Hq, S) if dlse else None, entry=entry,
        aux=list(entry.aux_tensors), mask=mask_tensors, block_size=block_size, scale=D ** -0.5,
        scalars=list(entry.aux_scalars))


def _backward(p, deterministic):
    return bwd_launch.backward(p.dout, p.q, p.k, p.v, p.out, p.lse, p.dlse, p.entry, p.aux, p.mask, p.block_size,
                               p.scale, p.scalars, deterministic)


class _Recorder:
    """Stands in for a compiled kernel: keeps the arguments of every call."""

    def __init__(self, kind, compiled=None, params=None):
        self.kind, self.compiled, self.params, self.calls = kind, compiled, params, []

    def __call__(self, *args):
        self.calls.append(args)


def _recording_compiles(monkeypatch, build: bool, signatures=None):
    """Routes `backward`'s compile cache through recorders (compiling for real when `build`)."""
    recorders = {}

    kinds = {bwd_launch.BwdPreKey: "pre", bwd_launch.BwdKey: "main", bwd_launch.BwdPostKey: "post"}

    def compiled(key, make):
        kind = kinds[type(key)]
        if kind == "main" and key.config.split_tail:  # (the second kernel of a cut last wave)
            kind = "parts"
        if kind not in recorders:
            fn = make() if build else None
            recorders[kind] = _Recorder(kind, fn, signatures[-1] if build else None)
        return recorders[kind]

    monkeypatch.setattr(bwd_launch, "_compiled", compiled)
    monkeypatch.setattr(bwd_launch, "_KERNELS", {})
    monkeypatch.setattr(bwd_launch, "_PLANS", type(bwd_launch._PLANS)())  # no plan from an earlier test
    return recorders


def _spills(ptx: str) -> tuple[int, int]:
    from flexlab.runtime.ptxas import assemble
    info, _ = assemble(ptx)
    return info["spill_store_bytes"], info["spill_load_bytes"]


# (head dim, score_mod, mask_mod, deterministic, dlse): dense and block-sparse, with and without captured tensors and
# captured-tensor grads (fp32 atomics, and int64 fixed point when deterministic), deterministic on and off.
CASES = {
    "d64-dense": (64, None, None, False, False),
    "d128-dense-deterministic": (128, None, None, True, True),
    "d128-sparse-int64-capture-deterministic": (128, None, "document", True, False),
    "d64-sparse-learnable-bias": (64, "bias", "causal", False, True),
    "d64-dense-learnable-bias-deterministic": (64, "bias", None, True, False),
}


def _mods(score, mask, S):
    return ({"bias": _learnable_bias, None: lambda: None}[score](),
            {"causal": _causal, "document": _document_mask(S), None: None}[mask])


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit) on PATH")
@pytest.mark.parametrize("case", sorted(CASES))
def test_backward_passes_torch_tensors_in_the_compiled_layouts(case, signatures, monkeypatch, tmp_path):
    """Compiles the three kernels as `backward` does (sm_90a, TVM-FFI), runs its host path on CPU tensors, and checks
    every argument against the TVM-FFI signature it was compiled with; PTX assembled without spills."""
    from cutlass.cutlass_dsl.tvm_ffi_provider import TVMFFIJitCompiledFunctionBase
    D, score, mask, deterministic, dlse = CASES[case]
    score_mod, mask_mod = _mods(score, mask, 300)
    p = _problem(D, score_mod, mask_mod, dlse=dlse)
    options = bwd_launch._options
    monkeypatch.setattr(bwd_launch, "_options", lambda arch, extra: options(arch, extra + f" --keep-ptx "
                                                                                         f"--dump-dir {tmp_path}"))
    rec = _recording_compiles(monkeypatch, True, signatures)
    dq, dk, dv, grads = _backward(p, deterministic)

    for r in rec.values():
        assert isinstance(r.compiled, TVMFFIJitCompiledFunctionBase), f"{r.kind} was not compiled with TVM-FFI"
        assert _spills(r.compiled.__ptx__) == (0, 0), f"{r.kind} spills registers"
        assert len(r.calls) == 1
    pre = check_call(rec["pre"].params, rec["pre"].calls[0])
    main = check_call(rec["main"].params, rec["main"].calls[0])
    post = check_call(rec["post"].params, rec["post"].calls[0])

    # Order: the tensors one kernel writes are the ones the next reads, under the names they were compiled with.
    assert main["mQ"] is p.q and main["mK"] is p.k and main["mV"] is p.v and pre["mO"] is p.out
    assert pre["mdO"] is main["mdO"] and torch.equal(pre["mdO"], p.dout)
    assert pre["mLSE2"] is main["mLSE2"] and pre["mDpsum"] is main["mDpsum"]
    assert main["mdQaccum"] is post["mdQaccum"]
    assert post["mdQ"] is dq and main["mdK"] is dk and main["mdV"] is dv
    assert torch.equal(pre["mLSE"], p.lse) and (pre["mdLSE"] is None) == (p.dlse is None)
    assert main["softmax_scale"] == post["scale"] == p.scale and main["qhead_per_kvhead"] == 2
    assert (main["sparse"] is None) == (mask is None) and (main["mdQsem"] is None) != deterministic
    assert (main["mRank"] is not None) == (deterministic and mask is not None)
    g = p.entry.generated
    kernel_aux = g.kernel_aux_tensors() if g is not None else []
    assert len(main["aux_tensors"]) == len(kernel_aux)
    assert all(a is b for a, b in zip(main["aux_tensors"], kernel_aux))
    assert [t.dtype for t in main["aux_grads"]] == [torch.int64 if deterministic else torch.float32] * len(grads)
    assert [tuple(t.shape) for t in grads] == [tuple(p.aux[s].shape) for s in p.entry.grad_slots]


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit) on PATH")
def test_a_cut_last_wave_passes_both_kernels_their_compiled_layouts(signatures, monkeypatch):
    """A dense grid whose last wave is cut: the whole tiles' kernel gets the tile count it stops at, the parts'
    kernel the same tensors plus the cut's shape and workspace (zeroed counters, one fp32 dK and dV tile per part),
    each as TVM-FFI compiled it; told the GPU has 5 SMs, 2 x 2 x 3 KV tiles leave 2 to cut."""
    from flexlab.kernels import bwd_config
    p = _problem(64)
    monkeypatch.setattr(bwd_launch, "_cut_workers", lambda dev: 5)
    monkeypatch.setattr(bwd_config, "split_parts", lambda tiles, workers, steps: 3)
    monkeypatch.setattr(bwd_launch, "split_tail_buffers",  # (per-stream buffers need CUDA)
                        lambda dev, counters, floats: (torch.zeros(counters, dtype=torch.int32),
                                                       torch.empty(floats, dtype=torch.float32)))
    rec = _recording_compiles(monkeypatch, True, signatures)
    dq, dk, dv, _ = _backward(p, False)
    assert set(rec) == {"pre", "main", "parts", "post"}
    main = check_call(rec["main"].params, rec["main"].calls[0])
    parts = check_call(rec["parts"].params, rec["parts"].calls[0])
    assert main["split_tail"] == (10,)
    whole, n, arrivals, partials = parts["split_tail"]
    assert (whole, n) == (10, 3) and arrivals.dtype == torch.int32 and not arrivals.any()
    assert arrivals.numel() == 2 and partials.numel() == 2 * 3 * 2 * 128 * 64  # 2 tiles x 3 parts x (dK, dV)
    for name in ("mQ", "mK", "mV", "mdO", "mLSE2", "mDpsum", "mdQaccum", "mdK", "mdV"):
        assert parts[name] is main[name], name
    assert parts["sparse"] is None and parts["mdQsem"] is None


def test_a_warm_backward_reads_nothing_back_from_the_device(monkeypatch):
    """Everything a warm call needs is cached (captured tensors narrowed, block lists, rank tables); the second call
    must not turn a tensor into a Python value (on a GPU that is a device sync) and hands TVM-FFI torch tensors."""
    score_mod, mask_mod = _learnable_bias(), _document_mask(300)
    p = _problem(64, score_mod, mask_mod, dlse=True)
    assert any(t.dtype == torch.int64 for t in p.entry.generated.aux_tensors)  # the range check has data to read
    rec = _recording_compiles(monkeypatch, False)
    _backward(p, True)
    reads = []

    def forbidden(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)
        return mock.patch.object(torch.Tensor, name, read)

    names = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "cpu", "numpy")
    with mock.patch("torch.cuda.synchronize") as sync:
        with forbidden(names[0]), forbidden(names[1]), forbidden(names[2]), forbidden(names[3]), \
                forbidden(names[4]), forbidden(names[5]), forbidden(names[6]), forbidden(names[7]):
            _backward(p, True)
    assert reads == [] and not sync.called, reads

    def leaves(x):
        if isinstance(x, (tuple, list)):
            for y in x:
                yield from leaves(y)
        else:
            yield x

    for r in rec.values():
        assert len(r.calls) == 2
        for arg in leaves(r.calls[1]):
            assert arg is None or isinstance(arg, (torch.Tensor, int, float)), (r.kind, type(arg))
    # nothing cached went stale: the second call passed the same cached tensors as the first
    first, second = rec["main"].calls
    assert all(a is b for a, b in zip(first[11], second[11]))  # block lists
    assert first[16] is second[16]  # deterministic rank table
    assert all(a is b for a, b in zip(first[12], second[12]))  # captured tensors, narrowed once


def test_captured_tensor_edits_reach_the_kernel(monkeypatch):
    """The narrowed captured tensors are cached per version: an in-place edit is seen, a plain re-read is free."""
    doc = torch.zeros(300, dtype=torch.int64)

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    p = _problem(64, None, document)
    rec = _recording_compiles(monkeypatch, False)
    _backward(p, False)
    doc[150:] = 1
    _backward(p, False)
    first, second = (call[12][0] for call in rec["main"].calls)
    assert first.dtype == second.dtype == torch.int32
    assert int(first.sum()) == 0 and int(second.sum()) == 150


def test_missing_tvm_ffi_is_named(monkeypatch):
    from flexlab.errors import BackendUnavailableError
    monkeypatch.setattr("flexlab.runtime.compile.tvm_ffi_available", lambda: False)
    with pytest.raises(BackendUnavailableError, match="apache-tvm-ffi"):
        bwd_launch.compile_postprocess("bfloat16", 64)


def test_a_repeated_backward_is_planned_once_and_replanned_when_its_inputs_change(monkeypatch):
    """The second backward of one signature goes straight to allocation and launch; an in-place edit of a block-mask
    list, of a tensor the stored mask bits were built from, or a swapped configuration plans again. A learnable
    bias edited in place every step keeps its plan, and each launch gets its current values."""
    rec = _recording_compiles(monkeypatch, False)
    builds = []
    build = bwd_launch._build_plan
    monkeypatch.setattr(bwd_launch, "_build_plan", lambda *a: builds.append(a) or build(*a))

    score_mod, mask_mod = _mods("bias", "document", 300)
    p = _problem(64, score_mod, mask_mod)
    for _ in range(3):
        _backward(p, False)
    assert len(builds) == 1 and len(rec["main"].calls) == 3
    with torch.no_grad():
        p.aux[0].add_(1.0)  # the learnable bias: read in place, no new plan
    _backward(p, False)
    assert len(builds) == 1
    assert rec["main"].calls[-1][12][0].data_ptr() == p.aux[0].data_ptr()  # the kernel's captured tensors
    mask_mod.__closure__[0].cell_contents[:10] = 2  # the document ids the stored bits came from
    _backward(p, False)
    assert len(builds) == 2
    p.mask[5].add_(0)  # a Q-direction list edited in place
    _backward(p, False)
    assert len(builds) == 3
    _backward(p, True)  # another mode
    assert len(builds) == 4
    default = bwd_launch._config
    other = dataclasses.replace(default(64, False, True, 128), lpt_order=False)
    monkeypatch.setattr(bwd_launch, "_config", lambda *a, **k: other)
    _backward(p, False)
    assert len(builds) == 5 and rec["main"].calls[-1][17] is None  # (no CTA order without lpt_order)
