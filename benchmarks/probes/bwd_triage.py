"""First run of the Hopper backward on a GPU: which piece works, which hangs, which is wrong. One command:

    python benchmarks/probes/bwd_triage.py --out bwd_triage.json

Every group of cases runs in its own subprocess, watched by this one: a case that prints nothing for
`--case-timeout` seconds (compile included) is reported as a hang and its subprocess is killed, instead of the whole
run going silent. Groups, in order:
  support   preprocess (D, LSE in base 2) and postprocess (dQ scaling) alone, against torch math;
  main-64   the main kernel at D=64: compile time on its own, the smallest case (B=1, H=1, S=128), then the awkward
            lengths of the GPU tests, GQA, and deterministic mode (bitwise repeat);
  main-128  the same at D=128;
  api       through flexlab's differentiable op (forward kernel included): a causal BlockMask and a score_mod.
The main kernel is fed O and LSE from a float64 forward, so a wrong gradient there is the backward's own. Gradients
are compared with float64 autograd (rel-L2, NaN check). Compile and run times are reported separately. The JSON
written to `--out` holds one record per case; a summary goes to stdout. Not collected by pytest (no test_ prefix).
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
from types import SimpleNamespace

GRAD_TOL = 2e-2
AWKWARD = [(1, 1), (127, 127), (129, 129), (200, 333), (333, 200), (1023, 1024)]
GROUPS = ("support", "main-64", "main-128", "api")
TAG = "TRIAGE "


# ------------------------------------------------------------------------------------------------ child side
def _emit(kind: str, **fields):
    print(TAG + json.dumps({"kind": kind, **fields}), flush=True)


def _sync():
    import torch
    torch.cuda.synchronize()


def _timed(fn):
    _sync()
    t = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _grad_error(a, b) -> float:
    """rel-L2 with the reference norm floored at an RMS of 1e-2 per element (as in test_bwd_gpu.grad_error): a
    query row that sees a single key has P = 1 and an exactly zero dS, where both sides are rounding noise."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / max(float(b.norm()), 1e-2 * b.numel() ** 0.5))


def _errors(names, ours, ref) -> tuple[dict, bool, bool]:
    errs, nan = {}, False
    for n, a, b in zip(names, ours, ref):
        nan |= bool(a.isnan().any() or a.isinf().any())
        errs[n] = _grad_error(a, b)
    ok = not nan and all(e < GRAD_TOL for e in errs.values())  # a NaN error compares False: not ok
    return errs, nan, ok


def _float64_problem(B, Hq, Hkv, Sq, Skv, D, seed=0):
    """bf16 inputs on the GPU, and O, LSE and the gradients of a float64 forward of the same inputs."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(B, Hkv, Skv, D, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(B, Hkv, Skv, D, device="cuda", generator=g).to(torch.bfloat16)
    dout = torch.randn(B, Hq, Sq, D, device="cuda", generator=g).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(D)
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    rep = Hq // Hkv
    s = q64 @ k64.repeat_interleave(rep, 1).transpose(-1, -2) * scale
    lse = torch.logsumexp(s, dim=-1)
    out = torch.softmax(s, dim=-1) @ v64.repeat_interleave(rep, 1)
    out.backward(dout.double())
    return SimpleNamespace(q=q, k=k, v=v, dout=dout, out=out.detach().to(torch.bfloat16), lse=lse.detach().float(),
                           scale=scale, ref=(q64.grad, k64.grad, v64.grad))


def _case(name, fn):
    _emit("start", name=name)
    try:
        rec = fn()
    except Exception as e:  # noqa: BLE001 - the triage reports every failure and moves on
        rec = {"status": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    _emit("done", name=name, **rec)


def _support():
    import torch
    from flexlab.kernels import bwd_launch

    _emit("info", torch=torch.__version__, device=torch.cuda.get_device_name(),
          capability=list(torch.cuda.get_device_capability()))
    for D in (64, 128):
        def pre(D=D):
            fn, compile_s = _timed(lambda: bwd_launch.compile_preprocess("bfloat16", D, True))
            B, H, Sq, pad = 2, 3, 200, 256
            out = torch.randn(B, H, Sq, D, device="cuda").to(torch.bfloat16)
            dout = torch.randn(B, H, Sq, D, device="cuda").to(torch.bfloat16)
            lse = torch.randn(B, H, Sq, device="cuda")
            lse[0, 0, 5] = -math.inf  # a fully masked row
            dlse = torch.randn(B, H, Sq, device="cuda")
            dpsum = torch.full((B, H, pad), float("nan"), device="cuda")
            lse2 = torch.full((B, H, pad), float("nan"), device="cuda")
            args = (out, dout, lse, dlse, dpsum, lse2)  # torch tensors through TVM-FFI, torch's current stream
            fn(*args)
            _, run_s = _timed(lambda: fn(*args))
            want_d = torch.zeros(B, H, pad, device="cuda")
            want_d[:, :, :Sq] = (out.float() * dout.float()).sum(-1) - dlse
            want_d[0, 0, 5] = 0.0
            want_l = torch.full((B, H, pad), math.inf, device="cuda")
            want_l[:, :, :Sq] = lse * math.log2(math.e)
            want_l[0, 0, 5] = math.inf
            errs = {"dpsum": _rel(dpsum, want_d), "lse2_finite": _rel(lse2[want_l.isfinite()],
                                                                      want_l[want_l.isfinite()]),
                    "lse2_inf_where_expected": float((lse2[~want_l.isfinite()] == math.inf).all())}
            ok = errs["dpsum"] < 1e-4 and errs["lse2_finite"] < 1e-6 and errs["lse2_inf_where_expected"] == 1.0
            return {"status": "ok" if ok else "wrong", "compile_s": compile_s, "run_s": run_s, "errors": errs}

        def post(D=D):
            fn, compile_s = _timed(lambda: bwd_launch.compile_postprocess("bfloat16", D))
            B, H, Sq, pad = 2, 3, 200, 256
            acc = torch.randn(B, H, pad, D, device="cuda")
            dq = torch.empty(B, H, Sq, D, device="cuda", dtype=torch.bfloat16)
            args = (acc, dq, 0.125)
            fn(*args)
            _, run_s = _timed(lambda: fn(*args))
            err = _rel(dq, acc[:, :, :Sq] * 0.125)
            return {"status": "ok" if err < 1e-2 else "wrong", "compile_s": compile_s, "run_s": run_s,
                    "errors": {"dq": err}}

        _case(f"preprocess-d{D}", pre)
        _case(f"postprocess-d{D}", post)


def _main(D: int):
    import torch
    from flexlab.kernels import bwd_launch
    from flexlab.kernels.bwd_config import default_bwd_config
    from flexlab.kernels.bwd_launch import BwdKey

    entry = SimpleNamespace(generated=None, grad_slots=())

    def compile_all(deterministic=False):
        """Compile (or fetch) the three kernels exactly as `backward` keys them; returns seconds spent."""
        cfg = default_bwd_config(D)
        key = BwdKey("", False, False, False, (), (), (), "bfloat16", cfg, False, bool(deterministic), "sm_90a",
                     False)
        t = time.perf_counter()
        bwd_launch.preprocess_kernel("bfloat16", D, False)
        bwd_launch.main_kernel(key)
        bwd_launch.postprocess_kernel("bfloat16", D)
        return time.perf_counter() - t

    def run(B, Hq, Hkv, Sq, Skv, deterministic=False, repeats=1):
        p = _float64_problem(B, Hq, Hkv, Sq, Skv, D)
        compile_s = compile_all(deterministic)

        def call():
            return bwd_launch.backward(p.dout, p.q, p.k, p.v, p.out, p.lse, None, entry, [], None, None, p.scale, (),
                                       deterministic)[:3]
        first, first_s = _timed(call)  # module load and first launch
        runs = [first]
        run_s = first_s
        for _ in range(repeats - 1):
            r, run_s = _timed(call)
            runs.append(r)
        errs, nan, ok = _errors(("dq", "dk", "dv"), first, p.ref)
        rec = {"status": "ok" if ok else "wrong", "compile_s": compile_s, "first_run_s": first_s, "run_s": run_s,
               "errors": errs, "nan": nan, "shape": [B, Hq, Hkv, Sq, Skv, D]}
        if repeats > 1:
            same = all(torch.equal(a, b) for other in runs[1:] for a, b in zip(runs[0], other))
            rec["bitwise_repeat"] = same
            if not same:
                rec["status"] = "wrong"
        return rec

    _case(f"main-d{D}-compile", lambda: {"status": "ok", "compile_s": compile_all()})
    _case(f"main-d{D}-B1H1S128", lambda: run(1, 1, 1, 128, 128))
    for Sq, Skv in AWKWARD:
        _case(f"main-d{D}-Sq{Sq}-Skv{Skv}", lambda Sq=Sq, Skv=Skv: run(1, 2, 2, Sq, Skv))
    _case(f"main-d{D}-gqa-B2H4Hkv2S700", lambda: run(2, 4, 2, 700, 700))
    _case(f"main-d{D}-deterministic-S1000", lambda: run(1, 2, 1, 1000, 1000, deterministic=True, repeats=3))


def _api():
    import torch
    import flexlab
    from flexlab.autograd import differentiable_attention
    from flexlab.testing import random_qkv, reference

    def run(score_mod, mask_mod, S, D):
        bm = flexlab.create_block_mask(mask_mod, 1, 2, S, S, device="cuda") if mask_mod else None
        q, k, v = random_qkv(1, 2, S, S, D, torch.bfloat16, "cuda", requires_grad=True)
        dout = torch.randn(1, 2, S, D, device="cuda", dtype=torch.bfloat16)
        t = time.perf_counter()
        out = differentiable_attention(q, k, v, score_mod, bm)
        out.backward(dout)
        _sync()
        first_s = time.perf_counter() - t  # forward + backward, compiles included
        q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
        ref_out, _ = reference(q64, k64, v64, score_mod, bm, None, False)
        ref_out.backward(dout.double())
        errs, nan, ok = _errors(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), (q64.grad, k64.grad, v64.grad))
        return {"status": "ok" if ok else "wrong", "first_call_s": first_s, "errors": errs, "nan": nan}

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def distance_bias(score, b, h, q_idx, kv_idx):
        return score - 0.01 * (q_idx - kv_idx).abs()

    _case("api-causal-blockmask-d64-S700", lambda: run(None, causal, 700, 64))
    _case("api-score-mod-d64-S700", lambda: run(distance_bias, None, 700, 64))
    _case("api-score-mod-causal-d128-S700", lambda: run(distance_bias, causal, 700, 128))


def child(group: str):
    if group == "support":
        _support()
    elif group.startswith("main-"):
        _main(int(group.split("-")[1]))
    elif group == "api":
        _api()
    elif group == "selftest-hang":  # exercises the watchdog without a GPU
        _case("finishes", lambda: {"status": "ok"})
        _case("never finishes", lambda: time.sleep(3600))
    else:
        raise SystemExit(f"unknown group {group!r}")


# ------------------------------------------------------------------------------------------------ parent side
def _reader(stream, q):
    for line in iter(stream.readline, ""):
        q.put(line)
    q.put(None)


def run_group(group: str, case_timeout: float, deadline: float) -> list[dict]:
    """Run one group in a subprocess; a silent case past `case_timeout` (or the overall deadline) is a hang."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", group], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    records, current, tail = [], None, []
    started = time.perf_counter()
    while True:
        limit = min(case_timeout, deadline - time.perf_counter())
        try:
            line = lines.get(timeout=max(limit, 0.1))
        except queue.Empty:
            os.killpg(proc.pid, 9)
            proc.wait()
            name = current or f"{group} (before its first case)"
            why = "case timeout" if limit == case_timeout else "overall deadline"
            records.append({"group": group, "name": name, "status": "timeout",
                            "message": f"no progress for {limit:.0f} s ({why}): hung or still compiling",
                            "output_tail": "".join(tail[-40:])})
            print(f"  {name}: TIMEOUT after {limit:.0f} s", flush=True)
            break
        if line is None:
            proc.wait()
            if current is not None:
                records.append({"group": group, "name": current, "status": "crashed",
                                "message": f"subprocess exited with {proc.returncode} during the case",
                                "output_tail": "".join(tail[-40:])})
                print(f"  {current}: CRASHED (exit {proc.returncode})", flush=True)
            elif proc.returncode:
                records.append({"group": group, "name": group, "status": "crashed",
                                "message": f"subprocess exited with {proc.returncode}",
                                "output_tail": "".join(tail[-40:])})
            break
        if not line.startswith(TAG):
            tail.append(line)
            continue
        msg = json.loads(line[len(TAG):])
        kind = msg.pop("kind")
        if kind == "start":
            current, tail = msg["name"], []
        elif kind == "done":
            rec = {"group": group, **msg}
            records.append(rec)
            current = None
            times = " ".join(f"{k}={rec[k]:.2f}s" for k in ("compile_s", "first_run_s", "run_s", "first_call_s")
                             if k in rec)
            errs = " ".join(f"{k}={v:.1e}" for k, v in rec.get("errors", {}).items())
            print(f"  {rec['name']}: {rec['status'].upper()} {times} {errs} {rec.get('message', '')[:300]}",
                  flush=True)
        else:
            records.append({"group": group, "name": kind, "status": "info", **msg})
            print(f"  {kind}: {msg}", flush=True)
    records.append({"group": group, "name": f"{group} wall", "status": "info",
                    "wall_s": time.perf_counter() - started})
    return records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=False, default="bwd_triage.json", help="where to write the JSON records")
    ap.add_argument("--case-timeout", type=float, default=90.0,
                    help="seconds a case may run silently, compile included (default 90)")
    ap.add_argument("--budget", type=float, default=540.0, help="overall seconds for all groups (default 540)")
    ap.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated subset of {GROUPS}")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    deadline = time.perf_counter() + args.budget
    records = []
    for group in args.groups.split(","):
        if time.perf_counter() >= deadline:
            records.append({"group": group, "name": group, "status": "skipped", "message": "overall budget spent"})
            continue
        print(f"[{group}]", flush=True)
        records.extend(run_group(group, args.case_timeout, deadline))
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)
    counts = {}
    for r in records:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"wrote {len(records)} records to {args.out}: {counts}", flush=True)
    return 0 if not any(r["status"] in ("wrong", "error", "timeout", "crashed") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
