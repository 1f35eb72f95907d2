"""H200 probe of one kernel option (a boolean `BwdConfig` field, or with --forward a `FwdConfig` field; not a test):
forward + backward per call with the field as the launcher sets it and flipped, in turns, on benchmark rows.

    python benchmarks/probes/option_probe.py OUT.json --field chained_launch [--forward [--forward-only]]
        [--rounds 11] [--rows 0,1,5]
    python benchmarks/probes/option_probe.py OUT.json --knob DYNAMIC_MAX_MEAN_KV_BLOCKS=1000 --forward --forward-only

(--knob: a policy knob of `kernels.config` / `kernels.bwd_config` set to a value instead of a field flipped.)

(--rounds 0 compiles and compares only: run one process per row that way first to compile in parallel.)

Each sample times 8 calls of the forward + backward with CUDA events, back to back as a training loop runs them
(every kernel and every gap between kernels counted), 8 calls of the backward alone and 8 of the forward alone. The
variants take turns in a rotated order and the median over rounds is reported with the speed-up of the launcher's
setting over the flipped one, both as a ratio of medians and as the median of each round's ratio ("paired", which
the clock's drift over a row does not move; with an interval for that median, `bench.report.median_interval`);
`--forward-only` times the forward alone. Before timing, both variants' dQ, dK and dV are compared on the same
inputs (rel-L2, NaN).
"""
from __future__ import annotations

import argparse
import ast
import json
import statistics
from dataclasses import replace

import torch

from flexlab.bench.report import median_interval

ROWS = [("sliding_window", 1, 16384, 128), ("document", 1, 16384, 128), ("sliding_window", 4, 4096, 128),
        ("document", 4, 4096, 128), ("causal", 4, 4096, 128), ("causal", 1, 16384, 128), ("dense", 4, 4096, 128),
        ("sliding_window", 1, 16384, 64), ("document", 1, 16384, 64), ("causal", 1, 16384, 64),
        ("dense", 1, 16384, 128), ("dense", 4, 4096, 64), ("dense", 4, 4096, 256), ("causal", 4, 4096, 256),
        ("alibi_causal", 4, 4096, 128), ("softcap_causal", 4, 4096, 128), ("sliding_window", 4, 4096, 256),
        ("causal", 1, 16384, 256), ("alibi_causal", 1, 16384, 128), ("softcap_causal", 1, 16384, 128),
        ("causal", 4, 4096, 64)]
CALLS = 8


def ms_per_call(fn, calls: int = CALLS) -> float:
    """Milliseconds per call of `fn` over `calls` calls back to back (CUDA events), after one untimed call. The
    probes of this directory time their samples with it."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


class Switch:
    """The two variants of a probe and how to switch the launcher between them: `use("launcher")` runs what the
    launcher picks, `use("flipped")` the same with `fields` negated (`forward`: `FwdConfig` fields, through
    `runtime.launch.scheduled`; else `BwdConfig` fields, through `bwd_launch._config`). `asked[0]` counts the
    flipped configurations handed out: 0 after a call means nothing was flipped."""

    def __init__(self, fields: list[str], forward: bool):
        from flexlab.kernels import bwd_launch
        from flexlab.runtime import launch as fwd_launch
        self.module, self.hook = (fwd_launch, "scheduled") if forward else (bwd_launch, "_config")
        self.launcher = getattr(self.module, self.hook)
        self.fields = fields
        self.asked = [0]
        # one flipped object per configuration: the launchers key their plans by the object's identity, so a new one
        # per call would rebuild the plan on every call and charge the flipped variant host time
        self.made = {}
        self.variants = {"launcher": self.launcher, "flipped": self.flipped}

    def flipped(self, *a, **k):
        self.asked[0] += 1
        cfg = self.launcher(*a, **k)
        if cfg not in self.made:  # NAME flips a boolean field, NAME=VALUE sets one (a Python literal)
            changes = {}
            for f in self.fields:
                name, eq, value = f.partition("=")
                changes[name] = ast.literal_eval(value) if eq else not getattr(cfg, name)
            self.made[cfg] = replace(cfg, **changes)
        return self.made[cfg]

    def use(self, variant: str) -> None:
        setattr(self.module, self.hook, self.variants[variant])
        _forget_decisions()

    def restore(self) -> None:
        setattr(self.module, self.hook, self.launcher)


def _forget_decisions() -> None:
    """After a switch: drop the launchers' memoised configurations and plans and the warm paths (which hold plans),
    so the next call plans with the variant now in place (compiled kernels stay cached)."""
    import flexlab.api as api
    from flexlab.kernels import bwd_launch
    from flexlab.runtime import launch as fwd_launch
    fwd_launch.forget_plans()
    bwd_launch.forget_plans()
    api.forget_warm_calls()


class KnobSwitch:
    """The same two variants for a policy knob: `use("flipped")` sets `name` to `value` in `kernels.config` (forward)
    or `kernels.bwd_config`, `use("launcher")` puts its own value back; each clears the memoised configurations and
    plans. `configs()` lists the kernel configurations the launchers have planned since the last `use`, which tells
    whether the knob changed what ran; a backward plan counts with its CTA order (a launcher knob such as
    `LPT_GROUP_L2_BYTES` changes only that)."""

    def __init__(self, name: str, value, forward: bool):
        from flexlab.kernels import bwd_config
        from flexlab.kernels import config as fwd_config
        self.module = fwd_config if forward else bwd_config
        if not hasattr(self.module, name):
            raise SystemExit(f"{self.module.__name__} has no knob {name}")
        self.name, self.own, self.value = name, getattr(self.module, name), value
        self.variants = {"launcher": self.own, "flipped": value}

    def use(self, variant: str) -> None:
        setattr(self.module, self.name, self.variants[variant])
        _forget_decisions()

    @staticmethod
    def configs() -> list:
        from flexlab.kernels import bwd_launch
        from flexlab.runtime import launch as fwd_launch
        fwd = [hit[1].config for plans in fwd_launch._PLANS.values() for hit in plans[1].values()]
        return fwd + [(plan.cfg, None if plan.tile_order is None else plan.tile_order.cpu().numpy().tobytes())
                      for plan in bwd_launch._PLANS.values()]

    def restore(self) -> None:
        setattr(self.module, self.name, self.own)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--field", help="a boolean BwdConfig field (FwdConfig with --forward), or NAME=VALUE to set "
                    "any field; several, comma-separated, change together")
    ap.add_argument("--knob", help="NAME=VALUE: a policy knob of kernels.bwd_config (kernels.config with --forward) "
                    "set to VALUE (a Python literal) instead of a field flipped")
    ap.add_argument("--forward", action="store_true", help="flip the field in the forward kernel's configuration")
    ap.add_argument("--forward-only", action="store_true", help="time the forward alone (a forward option)")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--rows", default=None, help="comma-separated indices into ROWS (default: all)")
    args = ap.parse_args()
    import flexlab
    from flexlab.bench.cases import build_case
    from flexlab.testing import rel_l2

    if (args.field is None) == (args.knob is None):
        raise SystemExit("give one of --field and --knob")
    if args.knob:
        name, _, value = args.knob.partition("=")
        switch = KnobSwitch(name, ast.literal_eval(value), args.forward)
    else:
        switch = Switch(args.field.split(","), args.forward)
    names, use = list(switch.variants), switch.use

    results = {}
    try:
        rows = ROWS if args.rows is None else [ROWS[int(i)] for i in args.rows.split(",")]
        for variant, B, S, D in rows:
            row = f"{variant} B{B} S{S // 1024}k D{D}"
            case = build_case(variant, B, 16, S, "cuda")
            bm = flexlab.create_block_mask(case.mask_mod, None, None, S, S, device="cuda") if case.mask_mod else None
            q, k, v = (torch.randn(B, 16, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            dout = torch.randn_like(q)

            def forward():
                return flexlab.flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, backend="cute")

            grads, planned = {}, {}
            for name in names:
                use(name)
                grads[name] = torch.autograd.grad(forward(), (q, k, v), dout)
                planned[name] = switch.configs() if args.knob else None
            if args.knob and planned["launcher"] == planned["flipped"]:
                raise SystemExit(f"{row}: {args.knob} left the kernels' configurations as they were; nothing to "
                                 "compare")
            if not args.knob and not switch.asked[0]:
                raise SystemExit(f"{row}: the launcher never took the flipped configuration; nothing to compare")
            if args.knob:
                setting = switch.own
            else:
                setting = None if args.forward else getattr(
                    switch.launcher(D, False, False, None if bm is None else bm.BLOCK_SIZE[0]),
                    switch.fields[0].partition("=")[0])
            errors = {n: rel_l2(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads["launcher"], grads["flipped"])}
            nan = any(torch.isnan(t).any().item() for g in grads.values() for t in g)
            del grads
            if args.rounds == 0:  # (compile and compare only: warms the kernel cache for a timed run)
                results[row] = {"launcher_setting": setting, "rel_l2_launcher_vs_flipped": errors, "nan": nan}
                print(row, f"{args.field or switch.name}={setting}", " ".join(f"{n} {e:.1e}" for n, e in errors.items()),
                      "NaN" if nan else "", flush=True)
                continue
            parts = ("fwd",) if args.forward_only else ("fwd+bwd", "bwd", "fwd")
            times = {f"{n} {part}": [] for n in names for part in parts}
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    use(name)
                    if not args.forward_only:
                        # (autograd.grad: no .grad accumulation kernels between the calls)
                        times[f"{name} fwd+bwd"].append(
                            ms_per_call(lambda: torch.autograd.grad(forward(), (q, k, v), dout)))
                        out = forward()
                        times[f"{name} bwd"].append(
                            ms_per_call(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)))
                    with torch.no_grad():
                        times[f"{name} fwd"].append(ms_per_call(forward))
            median = {n: statistics.median(t) for n, t in times.items()}
            speedup = {part: median[f"flipped {part}"] / median[f"launcher {part}"] for part in parts}
            # the same ratio taken within each round, then the median over rounds: both variants of a round ran
            # within a second, so the clock's drift over the row (up to 10% on the H200) cancels
            ratios = {part: [f / b for f, b in zip(times[f"flipped {part}"], times[f"launcher {part}"])]
                      for part in parts}
            paired = {part: statistics.median(r) for part, r in ratios.items()}
            # (low, high, coverage) for each paired ratio's median (`bench.report.median_interval`)
            interval = {part: median_interval(r) for part, r in ratios.items()} if args.rounds > 1 else {}
            results[row] = {"launcher_setting": setting, "median_ms": median, "speedup_of_launcher": speedup,
                            "paired_speedup_of_launcher": paired, "paired_interval_of_launcher": interval,
                            "rel_l2_launcher_vs_flipped": errors, "nan": nan, "rounds_ms": times}
            print(row, f"{args.field or switch.name}={setting}", " ".join(f"{n}={m:.4f}" for n, m in median.items()),
                  " ".join(f"speedup {p} {x:.3f}" for p, x in speedup.items()),
                  " ".join(f"paired {p} {x:.3f}" + (f" ({interval[p][0]:.3f}-{interval[p][1]:.3f})"
                                                    if p in interval else "") for p, x in paired.items()),
                  " ".join(f"{n} {e:.1e}" for n, e in errors.items()), "NaN" if nan else "", flush=True)
            torch.cuda.empty_cache()
    finally:
        switch.restore()
        with open(args.out, "w") as f:
            json.dump({"field": args.field, "knob": args.knob, "forward": args.forward, "calls_per_sample": CALLS, "rounds": args.rounds,
                       "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
