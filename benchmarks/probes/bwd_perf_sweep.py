"""H200 sweep of the backward's speed options: time every candidate configuration against today's default, and
check each one's gradients, in one command:

    python benchmarks/probes/bwd_perf_sweep.py OUT.json --budget 480

Rows (bf16, H=16, MHA): D=128 dense and causal at B4·S4k and B1·S16k, D=64 dense and causal at B1·S16k, sliding
window 1024 at B4·S4k (D=128) and B1·S16k (D=64), packed documents of 2000 tokens at B1·S16k (D=64 and 128; the
ids are a captured tensor, as in a user's mask), a tanh soft-cap score_mod at B2·S2k (D=128 and 64); plus
deterministic mode (its default, the other CTA order, LSE2/D from global memory, the other D=64 step, the dQ
partials added in turn from registers, the CTA order) on the D=128 and D=256 B4·S4k rows, sliding window,
documents and D=64 causal. Columns: the named configurations of
`bwd_config.candidate_bwd_configs(D, deterministic, mod_grads)` (`default` first). For each (row, configuration):

  * the backward exactly as the launcher runs it (`bwd_launch.backward`: preprocess, main kernel, postprocess), with
    the launcher's configuration swapped for the candidate. O and LSE come from a float64 forward, so no forward
    kernel is timed and a wrong gradient is the backward's own;
  * correctness: dQ, dK, dV of the first and last (batch, head) against float64 gradients of that head (rel-L2
    < 2e-2, no NaN/inf), and every head against the default's output (rel-L2 < 2e-2); deterministic rows also
    repeat the call and demand identical bits. A configuration that fails is reported `wrong` and never counted as
    a win;
  * wall time: median of `triton.testing.do_bench` (includes the launcher's host work); kernel time: the sum of the
    backward's kernels per call from torch.profiler (main kernel listed apart);
  * TFLOP/s = 2.5 x 4·B·H·Sq·Skv·D x mask density / time.

Cases run in a watched subprocess (the pattern of bwd_triage.py): a case that reports no progress for
`--case-timeout` seconds (compile included) is recorded as `timeout`, its subprocess is killed and a fresh one
continues with the next case (a CUDA error also ends the child: it poisons the context); a configuration that hung or
crashed is skipped on the later rows; past `--budget` seconds the remaining cases are recorded as `skipped`
(`--cases` re-runs a subset, `--list` names them). The JSON at
argv[1] is rewritten after every case (a list of records), and a table goes to stdout at the end. Not collected by
pytest (no test_ prefix).

Reading the table: per row, `kernel_ms` / `kern TF` are the numbers to compare (launch overhead excluded); `vs def`
is default kernel time / this kernel time (> 1 is faster); `err` is the worst gradient error. Only `ok` rows count.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
import traceback

import torch

GRAD_TOL = 2e-2
TAG = "SWEEP "
STARTUP_S = 120.0
WINDOW = 1024
SOFTCAP = 20.0

# (name, head dim, batch, sequence length, mask), most important first: a spent budget skips the tail
ROWS = [
    ("d128-dense-B4-S4k", 128, 4, 4096, "dense"),
    ("d128-causal-B4-S4k", 128, 4, 4096, "causal"),
    ("d128-dense-B1-S16k", 128, 1, 16384, "dense"),
    ("d128-causal-B1-S16k", 128, 1, 16384, "causal"),
    ("d64-dense-B1-S16k", 64, 1, 16384, "dense"),
    ("d64-causal-B1-S16k", 64, 1, 16384, "causal"),
    ("d128-sliding1024-B4-S4k", 128, 4, 4096, "sliding"),
    ("d64-sliding1024-B1-S16k", 64, 1, 16384, "sliding"),
    ("d64-document-B1-S16k", 64, 1, 16384, "document"),
    ("d128-document-B1-S16k", 128, 1, 16384, "document"),
    ("d128-document-B4-S4k", 128, 4, 4096, "document"),
    ("d256-dense-B4-S4k", 256, 4, 4096, "dense"),
    ("d256-causal-B4-S4k", 256, 4, 4096, "causal"),
]
# Run last: a score_mod (its generated derivative, and the lean register plan at D=128 and at D=64 with 128-row
# tiles), mostly for correctness; small, so quick.
SCORE_MOD_ROWS = [
    ("d128-softcap-B2-S2k", 128, 2, 2048, "softcap"),
    ("d64-softcap-B2-S2k", 64, 2, 2048, "softcap"),
]
HEADS = 16
DOCUMENT_LEN = 2000  # packed documents of 2000 tokens: boundaries inside tiles, so partial blocks on the diagonal
DETERMINISTIC_ROWS = ("d128-dense-B4-S4k", "d128-causal-B4-S4k", "d64-causal-B1-S16k", "d128-sliding1024-B4-S4k",
                      "d128-document-B1-S16k", "d256-dense-B4-S4k", "d256-causal-B4-S4k")
# of candidate_bwd_configs(D, True), where that head dim has them
DETERMINISTIC_VARIANTS = ("default", "kv_tiles_first", "stats_from_global", "tile_m64", "dq_cols", "dq_warp",
                          "dq_in_consumers", "dk_after_dq", "dk_before_dq", "dq_red", "dq_red_stages2",
                          "dq_red_stages3", "dq_slab", "natural_order")


def _candidates(D: int, deterministic: bool, kind: str):
    from flexlab.kernels.bwd_config import candidate_bwd_configs
    # masked rows run a BlockMask at torch's default 128: their default is not the dense rows' (80-row steps at D=128)
    q_block = None if kind in ("dense", "softcap") else 128
    return candidate_bwd_configs(D, deterministic, mod_grads=kind == "softcap", q_block=q_block)


def case_list() -> list[str]:
    cases = []
    for name, D, _, _, kind in ROWS:  # (the CTA order of a block mask's tiles means nothing without one)
        cases += [f"{name}/{v}" for v in _candidates(D, False, kind) if kind != "dense" or v != "lpt_order"]
    for name in DETERMINISTIC_ROWS:
        _, D, _, _, kind = next(r for r in ROWS if r[0] == name)
        cases += [f"{name}/{v}/det" for v in DETERMINISTIC_VARIANTS if v in _candidates(D, True, kind)]
    for name, D, _, _, kind in SCORE_MOD_ROWS:
        cases += [f"{name}/{v}" for v in _candidates(D, False, kind) if v != "lpt_order"]
    return cases


# ------------------------------------------------------------------------------------------------ child side
def _emit(kind: str, **fields):
    print(TAG + json.dumps({"kind": kind, **fields}), flush=True)


def document_ids(S: int, device):
    """Token i belongs to document i // DOCUMENT_LEN: a captured tensor, so mask_mod loads it like a user's mask."""
    import torch
    return (torch.arange(S, device=device) // DOCUMENT_LEN).to(torch.int32)


def _mask_fn(kind: str, S: int = 0, device="cuda"):
    if kind == "causal":
        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
        return causal
    if kind == "sliding":
        def sliding_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)
        return sliding_window
    if kind == "document":
        doc = document_ids(S, device)

        def same_document(b, h, q_idx, kv_idx):
            return doc[q_idx] == doc[kv_idx]
        return same_document
    return None


def softcap_score(score, b, h, q_idx, kv_idx):
    return SOFTCAP * torch.tanh(score / SOFTCAP)


def _score_mod_fn(kind: str):
    return softcap_score if kind == "softcap" else None


def _density(kind: str, S: int) -> float:
    if kind in ("dense", "softcap"):
        return 1.0
    if kind == "causal":
        return (S + 1) / (2 * S)
    if kind == "document":
        full, rest = divmod(S, DOCUMENT_LEN)
        return (full * DOCUMENT_LEN ** 2 + rest ** 2) / (S * S)
    kept = sum(min(q + 1, WINDOW) for q in range(S))
    return kept / (S * S)


def _keep(kind: str, S: int, device):
    """Boolean (S, S) mask of kept (q, kv) pairs, or None when dense."""
    import torch
    if kind in ("dense", "softcap"):
        return None
    q = torch.arange(S, device=device)[:, None]
    kv = torch.arange(S, device=device)[None, :]
    if kind == "document":
        return q // DOCUMENT_LEN == kv // DOCUMENT_LEN
    keep = q >= kv
    if kind == "sliding":
        keep &= (q - kv) < WINDOW
    return keep


def _grad_error(a, b) -> float:
    """Plain rel-L2. (bwd_triage floors the reference norm at an RMS of 1e-2 for rows whose exact gradient is zero;
    at S=16k with random inputs a whole gradient has an RMS near 1e-2, so that floor would hide real errors.)"""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def float64_head(q, k, v, dout, scale: float, keep, with_grads: bool, softcap: float | None = None):
    """O, LSE (natural log) and, if asked, (dq, dk, dv) of one (batch, head) in float64; `keep` (Sq, Skv) bool or
    None; `softcap`: scores become softcap * tanh(s / softcap). Every query row must keep at least one key."""
    import torch
    q, k, v, do = (t.double() for t in (q, k, v, dout))
    p = (q @ k.T).mul_(scale)  # the scores, turned into probabilities in place (S16k: 2 GB per matrix)
    dmod = None  # d(modded score) / d(raw score)
    if softcap is not None:
        t = torch.tanh(p / softcap)
        dmod = 1 - t * t
        p = t.mul_(softcap)
    if keep is not None:
        p.masked_fill_(~keep, -math.inf)
    lse = torch.logsumexp(p, dim=-1)
    p.sub_(lse[:, None]).exp_()
    o = p @ v
    grads = None
    if with_grads:
        dv = p.T @ do
        ds = (do @ v.T).sub_((do * o).sum(-1, keepdim=True)).mul_(p)
        if dmod is not None:
            ds.mul_(dmod)
        grads = (ds @ k * scale, ds.T @ q * scale, dv)
    return o, lse, grads


class Problem:
    """Inputs of one row: bf16 q, k, v, dO; O (bf16) and LSE (fp32) from a float64 forward; the BlockMask lists;
    float64 gradients of the first and last (batch, head)."""

    def __init__(self, name, D, B, S, kind):
        import torch

        import flexlab
        from flexlab import _ops
        self.name, self.D, self.B, self.S, self.kind = name, D, B, S, kind
        self.H = HEADS
        self.scale = D ** -0.5
        self.density = _density(kind, S)
        self.flops = 2.5 * 4 * B * HEADS * S * S * D * self.density
        g = torch.Generator(device="cuda").manual_seed(0)
        shape = (B, HEADS, S, D)
        self.q, self.k, self.v, self.dout = (torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
                                             for _ in range(4))
        keep = _keep(kind, S, "cuda")
        self.out = torch.empty_like(self.q)
        self.lse = torch.empty((B, HEADS, S), device="cuda", dtype=torch.float32)
        self.ref = {}
        checked = {(0, 0), (B - 1, HEADS - 1)}
        for b in range(B):
            for h in range(HEADS):
                o, lse, grads = float64_head(*(t[b, h] for t in (self.q, self.k, self.v, self.dout)), self.scale,
                                             keep, (b, h) in checked, SOFTCAP if kind == "softcap" else None)
                self.out[b, h] = o.to(torch.bfloat16)
                self.lse[b, h] = lse.float()
                if grads is not None:
                    self.ref[(b, h)] = grads
            _emit("progress", what=f"{name}: float64 forward, batch {b}")
        mask_mod = _mask_fn(kind, S)
        self.entry = _ops.mod_entry(_ops.register_mods(_score_mod_fn(kind), mask_mod))
        self.masks, self.sizes = [], []
        if mask_mod is not None:
            bm = flexlab.create_block_mask(mask_mod, 1, 1, S, S, device="cuda")
            self.masks = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                          bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices]
            self.sizes = [int(x) for x in bm.BLOCK_SIZE]
        torch.cuda.synchronize()

    def backward(self, deterministic: bool):
        from flexlab.kernels import bwd_launch
        return bwd_launch.backward(self.dout, self.q, self.k, self.v, self.out, self.lse, None, self.entry,
                                   self.entry.aux_tensors, self.masks, self.sizes, self.scale,
                                   self.entry.aux_scalars, deterministic)[:3]


def _kernel_times(fn, iters: int = 5) -> dict:
    """ms per call of the backward's kernels, from torch.profiler's device-side records."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    parts = {"main": 0.0, "pre": 0.0, "post": 0.0, "other": 0.0}
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", None)
        if us is None:
            us = getattr(ev, "self_cuda_time_total", 0.0)
        if not us:
            continue
        name = ev.key.lower()
        part = ("main" if "flexbwdsm90" in name else "pre" if "bwdpreprocess" in name
                else "post" if "bwdpostprocess" in name else "other")
        parts[part] += us / 1000.0 / iters
    parts["total"] = parts["main"] + parts["pre"] + parts["post"] + parts["other"]
    return parts


def swap_config(bwd_launch, cfg) -> None:
    """Make the launcher run `cfg` for every head dim. `_config` itself is replaced: it memoises per head dim, so
    patching what it calls would leave every later case of one child on the first case's configuration."""
    bwd_launch._config = lambda head_dim, deterministic, mod_grads, q_block, mask_ops=0: cfg.validate()


def config_applied(bwd_launch, cfg, deterministic: bool) -> bool:
    """Whether the launcher compiled (or reused) kernels for exactly `cfg`: its warm-kernel dict is keyed by
    (mods hash, dtype, config, sparse, has_dlse, deterministic, arch). Guards the sweep against measuring the
    default kernel under another configuration's name. (What the launcher decides per call, persistent CTAs and a
    cut last wave, is left out of the comparison where the candidate lets it decide.)"""
    from dataclasses import replace

    def matches(ran):
        if ran == cfg:
            return True
        if cfg.split_last_wave and ran in (replace(cfg, whole_tiles_only=True), replace(cfg, split_tail=True)):
            return True
        return (cfg.persistent_short_tiles and not cfg.persistent and ran.persistent
                and replace(ran, persistent_ctas=0) == cfg)
    return any(matches(key[2]) and key[5] == deterministic for key in bwd_launch._KERNELS)


def run_case(case: str, problems: dict, outputs: dict) -> dict:
    if case.startswith("selftest/"):  # the watchdog's own test, no GPU: one configuration hangs
        if case.startswith("selftest/hang"):
            time.sleep(3600)
        return {"case": case, "row": "selftest", "variant": case.split("/")[1], "deterministic": False,
                "status": "ok", "wall_ms": 1.0, "wall_tflops": 1.0, "first_call_s": 0.0}
    import torch
    from triton.testing import do_bench

    from flexlab.kernels import bwd_launch
    row, variant, *flags = case.split("/")
    det = "det" in flags
    spec = next(r for r in ROWS + SCORE_MOD_ROWS if r[0] == row)
    name, D, B, S, kind = spec
    cfg = _candidates(D, det, kind)[variant]
    rec = {"case": case, "row": row, "variant": variant, "deterministic": det, "config": repr(cfg),
           "shape": {"B": B, "H": HEADS, "S": S, "D": D}, "mask": kind}
    if row not in problems:
        problems.clear()  # one row's tensors at a time (the S16k float64 forward is large)
        outputs.clear()
        torch.cuda.empty_cache()
        t = time.perf_counter()
        problems[row] = Problem(*spec)
        rec["prepare_s"] = time.perf_counter() - t
    p = problems[row]
    rec["density"] = p.density
    swap_config(bwd_launch, cfg)
    t = time.perf_counter()
    grads = p.backward(det)  # compiles on first use
    torch.cuda.synchronize()
    rec["first_call_s"] = time.perf_counter() - t
    if not config_applied(bwd_launch, cfg, det):
        raise RuntimeError(f"{case}: the launcher did not run the candidate configuration {cfg!r}")
    _emit("progress", what=f"{case}: compiled and ran once")

    errs, nan = {}, False
    for (b, h), ref in p.ref.items():
        for n, ours, want in zip(("dq", "dk", "dv"), grads, ref):
            x = ours[b, h]
            nan |= bool(torch.isnan(x).any() or torch.isinf(x).any())
            errs[f"{n}[{b},{h}]"] = _grad_error(x, want)
    base = outputs.get((row, det))
    if variant == "default":
        outputs[(row, det)] = [x.clone() for x in grads]
    elif base is not None:
        for n, ours, ref in zip(("dq", "dk", "dv"), grads, base):
            nan |= bool(torch.isnan(ours).any())
            errs[f"{n}_vs_default"] = _grad_error(ours, ref)
    rec["errors"], rec["nan"] = errs, nan
    ok = not nan and all(e < GRAD_TOL for e in errs.values())
    if det:
        again = p.backward(det)
        rec["bitwise_repeat"] = all(torch.equal(a, b) for a, b in zip(grads, again))
        ok = ok and rec["bitwise_repeat"]
    del grads
    rec["status"] = "ok" if ok else "wrong"
    _emit("progress", what=f"{case}: checked")

    fn = lambda: p.backward(det)  # noqa: E731
    rec["wall_ms"] = do_bench(fn, warmup=25, rep=100, return_mode="median")
    rec["wall_tflops"] = p.flops / (rec["wall_ms"] * 1e-3) / 1e12
    try:
        parts = _kernel_times(fn)
        rec["kernel_ms"], rec["main_ms"] = parts["total"], parts["main"]
        rec["kernel_parts_ms"] = parts
        if parts["total"] > 0:
            rec["kernel_tflops"] = p.flops / (parts["total"] * 1e-3) / 1e12
    except Exception as e:  # noqa: BLE001 - wall time still counts
        rec["profiler_error"] = f"{type(e).__name__}: {e}"
    return rec


def interleaved_times(row: str, passed: list[str], problems: dict, rounds: int) -> dict:
    """Each passing configuration of one row timed again, all of them in turns (`bench.timing.measure_interleaved`:
    `rounds` rounds in a rotated order, median of the rounds): the GPU's clock drifts by a few percent over a row
    (the same kernel measured 8.88 and 9.16 ms minutes apart), so configurations timed one after another differ by
    that much with no change at all. Returns {case: {wall_ms, kernel_ms, main_ms, kernel_rounds}}."""
    import torch

    from flexlab.bench.timing import measure_interleaved
    from flexlab.kernels import bwd_launch
    p = problems[row]
    fns = {}
    for case in passed:
        _, variant, *flags = case.split("/")
        det = "det" in flags
        cfg = _candidates(p.D, det, p.kind)[variant]

        def fn(cfg=cfg, det=det):
            swap_config(bwd_launch, cfg)
            return p.backward(det)
        fns[case] = fn
    timings = measure_interleaved(fns, torch.device("cuda"), warmup_ms=25, rep_ms=60 * rounds, rounds=rounds,
                                  profile_calls=3 * rounds, top=8)
    out = {}
    for case, t in timings.items():
        main = sum(ms for name, ms in t.kernels if "flexbwdsm90" in name.lower())
        out[case] = {"wall_ms": t.wall_ms, "kernel_ms": t.kernel_ms, "main_ms": main,
                     "kernel_rounds": t.kernel_rounds, "wall_rounds": t.wall_rounds}
    return out


def child(cases: list[str], rounds: int = 5):
    import torch
    if torch.cuda.is_available():
        _emit("info", torch=torch.__version__, device=torch.cuda.get_device_name())
    problems, outputs = {}, {}
    passed: list[str] = []  # this row's cases that passed, timed again in turns before the next row's

    def flush_row():
        row = passed[0].split("/")[0] if passed else None
        if row is not None and len(passed) > 1 and row in problems and rounds > 1:
            _emit("start", name=f"{row}/interleaved")
            try:
                _emit("interleaved", row=row, times=interleaved_times(row, passed, problems, rounds))
            except Exception as e:  # noqa: BLE001 - the one-by-one times stand
                _emit("interleaved", row=row, error=f"{type(e).__name__}: {e}")
        passed.clear()

    for case in cases:
        if passed and case.split("/")[0] != passed[0].split("/")[0]:
            flush_row()
        _emit("start", name=case)
        t0 = time.perf_counter()
        try:
            rec = run_case(case, problems, outputs)
            rec["case_s"] = round(time.perf_counter() - t0, 2)
        except Exception as e:  # noqa: BLE001 - every failure is a record, the sweep goes on
            rec = {"case": case, "status": "error", "message": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()[-3000:]}
            if "cuda" in str(e).lower() or "CUDA" in rec["traceback"]:
                _emit("done", **rec)
                sys.stdout.flush()
                os._exit(3)  # a CUDA error poisons this process's context: the parent starts a fresh child
        _emit("done", **rec)
        if rec.get("status") == "ok" and not case.startswith("selftest/"):
            passed.append(case)
    flush_row()


# ------------------------------------------------------------------------------------------------ parent side
def _reader(stream, q):
    for line in iter(stream.readline, ""):
        q.put(line)
    q.put(None)


def _spawn(cases: list[str], rounds: int = 5):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", ",".join(cases), "--rounds",
                             str(rounds)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    return proc, lines


def _drop_variant(case: str, todo: list[str], records: list[dict]) -> list[str]:
    """A configuration that hung or crashed once would do it again on every row (each costs a case timeout and a
    fresh child): its remaining cases are recorded as skipped. The default is always kept."""
    parts = case.split("/")
    if len(parts) < 2 or parts[1] == "default":
        return todo
    keep = []
    for c in todo:
        if c.split("/")[1:2] == parts[1:2]:
            records.append({"case": c, "status": "skipped", "message": f"{parts[1]} hung or crashed in {case}"})
        else:
            keep.append(c)
    return keep


def _attach_interleaved(records: list[dict], msg: dict) -> None:
    """Store a row's in-turns times on its records (`il_*` fields), or the reason there are none."""
    if "error" in msg:
        print(f"  {msg['row']}: interleaved timing failed: {msg['error']}", flush=True)
        for r in records:
            if r.get("row") == msg["row"]:
                r["interleaved_error"] = msg["error"]
        return
    for r in records:
        t = msg["times"].get(r.get("case"))
        if t is not None:
            r.update({f"il_{k}": v for k, v in t.items()})
    print(f"  {msg['row']}: timed in turns: " + ", ".join(f"{c.split('/', 1)[1]} {t['main_ms']:.3f}"
                                                            for c, t in msg["times"].items()) + " ms (main)",
          flush=True)


def sweep(cases: list[str], case_timeout: float, deadline: float, save, rounds: int = 5) -> list[dict]:
    """Run the cases in order in watched subprocesses. A silent case is killed and recorded as a timeout; a child
    that dies (or leaves after a CUDA error, which poisons its context) is replaced by a fresh one for the rest."""
    records, todo = [], list(cases)
    while todo and time.perf_counter() < deadline:
        proc, lines = _spawn(todo, rounds)
        current, tail, progressed = None, [], False
        while True:
            # A fresh child first imports torch and flexlab: it gets STARTUP_S before its first word.
            limit = min(case_timeout if progressed else max(case_timeout, STARTUP_S), deadline - time.perf_counter())
            try:
                line = lines.get(timeout=max(limit, 0.1))
            except queue.Empty:
                os.killpg(proc.pid, 9)
                proc.wait()
                why = "overall budget" if time.perf_counter() >= deadline - 0.5 else "case timeout"
                name = current or todo[0]
                records.append({"case": name, "status": "timeout", "message": f"no progress for {limit:.0f} s "
                                f"({why}): hung or still compiling", "output_tail": "".join(tail[-40:])})
                print(f"  {name}: TIMEOUT after {limit:.0f} s", flush=True)
                if name in todo:  # (not a row's interleaved timing)
                    todo.remove(name)
                todo = _drop_variant(name, todo, records)
                save(records)
                break
            if line is None:  # the child exited
                proc.wait()
                if current is not None:
                    records.append({"case": current, "status": "crashed", "message": f"subprocess exited with "
                                    f"{proc.returncode} during the case", "output_tail": "".join(tail[-40:])})
                    print(f"  {current}: CRASHED (exit {proc.returncode})", flush=True)
                    if current in todo:
                        todo.remove(current)
                    todo = _drop_variant(current, todo, records)
                    save(records)
                elif todo and not progressed:  # it cannot even start: do not respawn forever
                    for c in todo:
                        records.append({"case": c, "status": "crashed", "message": f"child exited with "
                                        f"{proc.returncode} before any case", "output_tail": "".join(tail[-40:])})
                    todo = []
                break
            if not line.startswith(TAG):
                tail.append(line)
                continue
            msg = json.loads(line[len(TAG):])
            kind = msg.pop("kind")
            progressed = True
            if kind == "start":
                current, tail = msg["name"], []
            elif kind == "interleaved":
                current = None
                _attach_interleaved(records, msg)
                save(records)
            elif kind == "done":
                records.append(msg)
                if msg["case"] in todo:
                    todo.remove(msg["case"])
                current = None
                save(records)
                print(f"  {_line(msg)}", flush=True)
            elif kind == "info":
                print(f"  {msg}", flush=True)
    for c in todo:
        records.append({"case": c, "status": "skipped", "message": "overall budget spent"})
    return records


def _line(r: dict) -> str:
    if r.get("status") not in ("ok", "wrong"):
        return f"{r['case']}: {r['status'].upper()} {r.get('message', '')[:300]}"
    worst = max(r.get("errors", {}).values(), default=float("nan"))
    kern = r.get("kernel_ms", float("nan"))
    return (f"{r['case']}: {r['status'].upper()} wall {r['wall_ms']:.3f} ms ({r['wall_tflops']:.0f} TF/s) "
            f"kernels {kern:.3f} ms ({r.get('kernel_tflops', float('nan')):.0f} TF/s, main "
            f"{r.get('main_ms', float('nan')):.3f}) err {worst:.1e} first call {r['first_call_s']:.1f} s, "
            f"case {r.get('case_s', 0):.1f} s")


def table(records: list[dict]) -> str:
    """One line per case. `vs def` compares kernel times with the row's default: the in-turns times (`il_*`, the
    `il main` column) where the row has them, else the one-by-one times."""
    out = [f"{'row':<26} {'variant':<20} {'status':<7} {'wall ms':>8} {'wall TF':>7} {'kern ms':>8} "
           f"{'kern TF':>7} {'main ms':>8} {'il main':>8} {'vs def':>6} {'err':>7}"]

    def kernel_ms(r):
        return r.get("il_kernel_ms") or r.get("kernel_ms")
    base = {}
    for r in records:
        if r.get("variant") == "default" and r.get("status") == "ok":
            base[(r["row"], r["deterministic"])] = r
    best = {}
    for r in records:
        if "row" not in r:
            out.append(f"{r['case']:<47} {r['status']:<7} {r.get('message', '')[:80]}")
            continue
        label = r["variant"] + (" +det" if r.get("deterministic") else "")
        if r["status"] not in ("ok", "wrong"):
            out.append(f"{r['row']:<26} {label:<20} {r['status']:<7} {r.get('message', '')[:80]}")
            continue
        ref = base.get((r["row"], r["deterministic"]))
        same_clock = ref is not None and ("il_kernel_ms" in ref) == ("il_kernel_ms" in r)
        speed = kernel_ms(ref) / kernel_ms(r) if same_clock and kernel_ms(ref) and kernel_ms(r) else float("nan")
        worst = max(r.get("errors", {}).values(), default=float("nan"))
        out.append(f"{r['row']:<26} {label:<20} {r['status']:<7} {r['wall_ms']:>8.3f} {r['wall_tflops']:>7.0f} "
                   f"{r.get('kernel_ms', float('nan')):>8.3f} {r.get('kernel_tflops', float('nan')):>7.0f} "
                   f"{r.get('main_ms', float('nan')):>8.3f} {r.get('il_main_ms', float('nan')):>8.3f} "
                   f"{speed:>6.3f} {worst:>7.1e}")
        if r["status"] == "ok" and kernel_ms(r) and not r["deterministic"]:
            if r["row"] not in best or kernel_ms(r) < best[r["row"]][1]:
                best[r["row"]] = (r["variant"], kernel_ms(r), speed)
    out.append("")
    out.append("fastest correct configuration per row (kernel time, in turns where timed so; speed-up over default):")
    for row, (variant, ms, speed) in best.items():
        out.append(f"  {row:<26} {variant:<20} {ms:.3f} ms  x{speed:.3f}")
    return "\n".join(out)


def main(argv=None):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if root not in sys.path:
        sys.path.insert(0, root)  # the case list comes from this checkout's flexlab, like the children's kernels
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", default="bwd_perf_sweep.json", help="JSON records (rewritten after each case)")
    ap.add_argument("--budget", type=float, default=480.0, help="overall seconds (default 480)")
    ap.add_argument("--case-timeout", type=float, default=60.0,
                    help="seconds a case may go without progress, compile included (default 60)")
    ap.add_argument("--cases", default="", help="comma-separated subset of case names (row/variant[/det])")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    ap.add_argument("--rounds", type=int, default=5,
                    help="after a row's cases, time its passing configurations again in this many rotated rounds "
                         "(1: no second timing); the table compares those (default 5)")
    ap.add_argument("--selftest", action="store_true", help=argparse.SUPPRESS)  # watchdog test, no GPU
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        child([c for c in args.child.split(",") if c], args.rounds)
        return 0
    cases = (["selftest/ok", "selftest/hang", "selftest/after", "selftest/hang/det"] if args.selftest
             else case_list())
    if args.list:
        print("\n".join(cases))
        return 0
    if args.cases:
        wanted = args.cases.split(",")
        unknown = [c for c in wanted if c not in cases]
        if unknown:
            raise SystemExit(f"unknown cases {unknown}; see --list")
        cases = wanted
    deadline = time.perf_counter() + args.budget

    def save(records):
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)

    print(f"{len(cases)} cases, budget {args.budget:.0f} s", flush=True)
    records = sweep(cases, args.case_timeout, deadline, save, args.rounds)
    save(records)
    print(table(records), flush=True)
    bad = [r for r in records if r.get("status") not in ("ok",)]
    print(f"wrote {len(records)} records to {args.out}; {len(bad)} not ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
