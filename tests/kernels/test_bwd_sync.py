"""The backward kernel's synchronisation is sound by construction, checked on its PTX without a GPU.

A kernel with a pipeline or barrier bug compiles cleanly and then hangs on the device, so these tests read the PTX:
  * no warp-collective instruction (`elect.sync`, `shfl.sync`, `bar.sync`, `wgmma`, `stmatrix`, ...) sits under a
    branch whose predicate differs between the lanes of a warp (a one-lane `elect.sync` waits forever);
  * every mbarrier `expect_tx` byte count equals what the TMA loads of one stage deliver (full boxes, also at the
    sequence tails), and every mbarrier arrive count is the one producer thread or the consumer warps;
  * named barriers use the ids of `BwdBarrier`, never 0 after the role split, with thread counts the roles have.
The divergence check is a small data-flow pass over the PTX: registers derived from %tid/%laneid are lane-varying
unless they pass through `shfl.sync.idx` from a fixed lane (`make_warp_uniform`); `elect.sync` predicates are
varying. The forward kernel, which runs correctly on the H200, must pass the same checks.
"""
from __future__ import annotations

import re

import pytest
from ptx_dump import KEEP_PTX

cutlass = pytest.importorskip("cutlass")

COLLECTIVE = ("elect.sync", "shfl.sync", "vote.sync", "bar.sync", "barrier.sync", "bar.arrive", "barrier.arrive",
              "bar.warp.sync", "wgmma.", "stmatrix.sync", "ldmatrix.sync", "setmaxnreg", "redux.sync", "match.sync")
_REG = re.compile(r"%[A-Za-z_][\w.]*")
_LABEL = re.compile(r"^(\$?[\w$]+):")


def _statements(ptx: str) -> list[str]:
    """Kernel-body statements and labels, one per entry, inline-asm braces and comments dropped."""
    out = []
    for raw in ptx.splitlines():
        line = raw.split("//")[0].strip()
        if not line or line in ("{", "}") or line.startswith((".reg", ".pragma", ".loc", ".file")):
            continue
        m = _LABEL.match(line)
        if m and not line.startswith("@"):
            out.append(m.group(1) + ":")
            line = line[m.end():].strip()
            if not line:
                continue
        out.extend(s.strip() + ";" for s in line.split(";") if s.strip())
    return out


def _split(stmt: str):
    """(guard register or None, opcode, destination registers, source registers)."""
    guard = None
    m = re.match(r"@!?(\S+)\s+", stmt)
    if m:  # inline-asm predicates (P1, p) are local to one asm block and never lane-varying here
        guard, stmt = (m.group(1) if m.group(1).startswith("%") else None), stmt[m.end():]
    parts = stmt.rstrip(";").split(None, 1)
    op = parts[0]
    args = parts[1] if len(parts) > 1 else ""
    if op.startswith(("st.", "red.", "atom.", "mbarrier.", "cp.", "bar", "barrier", "wgmma", "stmatrix", "prefetch",
                      "fence", "bra", "ret", "exit", "setmaxnreg", "elect")) and not op.startswith("elect"):
        return guard, op, [], _REG.findall(args)
    first, _, rest = args.partition(",")
    return guard, op, _REG.findall(first), _REG.findall(rest)


def lane_varying(statements: list[str]) -> set[str]:
    """Registers whose value may differ between the lanes of one warp (fixed point over loops)."""
    varying = {"%tid.x", "%tid.y", "%tid.z", "%laneid"}
    # Copies of %tid.x: masking away its low 5 bits (and with a multiple of 32) or shifting them out leaves the
    # warp index, the same in every lane (blocks are whole warps along x).
    tid_copies = {"%tid.x"} | {d for st in statements if re.match(r"mov\.u32\s+%r\d+,\s*%tid\.x;", st)
                               for d in _split(st)[2]}

    def warp_uniform(op, stmt, src):
        if len(src) != 1 or src[0] not in tid_copies:
            return False
        imm = re.search(r",\s*(\d+);$", stmt)
        if imm is None:
            return False
        k = int(imm.group(1))
        return (op.startswith("and.b32") and k % 32 == 0) or (op.startswith("shr.u32") and k >= 5)

    changed = True
    while changed:
        changed = False
        for stmt in statements:
            if stmt.endswith(":"):
                continue
            _, op, dst, src = _split(stmt)
            if not dst or all(d in varying for d in dst):
                continue
            if op.startswith("elect.sync"):
                new = [d for d in dst if d.startswith("%p")]  # true in one lane only
            elif op.startswith("shfl.sync.idx") and re.search(r",\s*\d+\s*,\s*31\s*,\s*-1\s*;$", stmt):
                new = []  # broadcast from a fixed lane: the same value in every lane
            elif warp_uniform(op, stmt, src):
                new = []
            elif any(s in varying for s in src):
                new = dst
            else:
                new = []
            for d in new:
                if d not in varying:
                    varying.add(d)
                    changed = True
    return varying


def _blocks(stmts: list[str]):
    """Basic blocks (lists of statement indices) and their successors; -1 is the kernel exit."""
    label_at = {}
    for i, st in enumerate(stmts):
        if st.endswith(":"):
            label_at.setdefault(st[:-1], []).append(i)

    def target(i, name):  # inline-asm labels (LAB_WAIT, DONE) repeat: the nearest one is meant
        return min(label_at[name], key=lambda j: abs(j - i))

    starts = {0}
    for i, st in enumerate(stmts):
        if st.endswith(":"):
            starts.add(i)
        elif _split(st)[1].startswith(("bra", "ret", "exit")):
            starts.add(i + 1)
    starts = sorted(x for x in starts if x < len(stmts))
    block_of = {}
    blocks = []
    for k, b in enumerate(starts):
        e = starts[k + 1] if k + 1 < len(starts) else len(stmts)
        blocks.append(list(range(b, e)))
        for i in range(b, e):
            block_of[i] = k
    succ = []
    for k, idx in enumerate(blocks):
        last = stmts[idx[-1]]
        guard, op, _, _ = _split(last) if not last.endswith(":") else (None, "", [], [])
        nxt = k + 1 if k + 1 < len(blocks) else -1
        if op.startswith("bra"):
            t = block_of[target(idx[-1], last.rstrip(";").split()[-1])]
            is_cond = guard is not None or re.match(r"@!?\w+\s", last) is not None
            succ.append({t, nxt} if is_cond else {t})
        elif op.startswith(("ret", "exit")):
            succ.append({-1})
        else:
            succ.append({nxt})
    return blocks, succ


def _post_dominators(succ):
    n = len(succ)
    every = set(range(n)) | {-1}
    pdom = {k: set(every) for k in range(n)}
    pdom[-1] = {-1}
    changed = True
    while changed:
        changed = False
        for k in reversed(range(n)):
            new = {k} | set.intersection(*(pdom[s] for s in succ[k]))
            if new != pdom[k]:
                pdom[k], changed = new, True
    return pdom


def divergent_collectives(ptx: str) -> list[str]:
    """Warp-collective statements that only some lanes of a warp may reach.

    A branch on a lane-varying predicate splits the warp until its immediate post-dominator; every block reachable
    from the branch before that point runs with part of the warp only."""
    stmts = _statements(ptx)
    varying = lane_varying(stmts)
    blocks, succ = _blocks(stmts)
    pdom = _post_dominators(succ)
    bad = []
    for k, idx in enumerate(blocks):
        for i in idx:
            st = stmts[i]
            if st.endswith(":"):
                continue
            guard, op, _, _ = _split(st)
            if guard in varying and op.startswith(COLLECTIVE):
                bad.append(f"{st} (predicated on a lane-varying guard)")
        last = stmts[idx[-1]]
        guard, op, _, _ = _split(last) if not last.endswith(":") else (None, "", [], [])
        if not (op.startswith("bra") and guard in varying):
            continue
        strict = pdom[k] - {k}  # the nearest strict post-dominator is the one all others post-dominate
        join = next(p for p in strict if all(q in pdom[p] for q in strict))
        seen, todo = set(), [s for s in succ[k] if s != join]
        while todo:
            b = todo.pop()
            if b in seen or b == -1 or b == join:
                continue
            seen.add(b)
            for i in blocks[b]:
                if not stmts[i].endswith(":") and _split(stmts[i])[1].startswith(COLLECTIVE):
                    bad.append(f"{stmts[i]} (under the lane-divergent branch `{last}`)")
            todo.extend(succ[b])
    return bad


def _expect_tx_bytes(ptx: str) -> set[int]:
    """Byte counts handed to mbarrier.arrive.expect_tx (immediates, or registers set by mov from an immediate)."""
    consts = dict(re.findall(r"mov\.b32\s+(%r\d+),\s*(\d+);", ptx))
    out = set()
    for arg in re.findall(r"mbarrier\.arrive\.expect_tx\.shared\.b64\s+[^,]+,\s*\[[^\]]+\],\s*([^;]+);", ptx):
        arg = arg.strip()
        out.add(int(consts[arg]) if arg in consts else int(arg))
    return out


def _mbarrier_init_counts(ptx: str) -> set[int]:
    consts = dict(re.findall(r"mov\.b32\s+(%r\d+),\s*(\d+);", ptx))
    return {int(consts.get(a.strip(), a.strip())) for a in re.findall(r"mbarrier\.init\.shared\.b64\s+\[[^\]]+\],\s*([^;]+);", ptx)}


def _named_barriers(ptx: str) -> set[tuple[str, int]]:
    return {(i, int(n)) for i, n in re.findall(r"\bbar\.sync\s+(%?\w+),\s*(\d+);", ptx)}


def test_divergence_check_flags_a_one_lane_elect():
    """The check itself: a copy of a real pattern with the guard taken from the thread index must be flagged."""
    ptx = """
    mov.u32 %r1, %tid.x;
    and.b32 %r2, %r1, 127;
    setp.ne.b32 %p1, %r2, 0;
    @%p1 bra $L__BB0_9;
    elect.sync %r3|%p2, -1;
    $L__BB0_9:
    mov.u32 %r5, %tid.x;
    shr.u32 %r6, %r5, 5;
    shfl.sync.idx.b32 %r7, %r6, 0, 31, -1;
    setp.ne.b32 %p3, %r7, 4;
    @%p3 bra $L__BB0_10;
    elect.sync %r8|%p4, -1;
    @!%p4 bra $L__BB0_10;
    cp.async.bulk.commit_group;
    $L__BB0_10:
    ret;
    """
    bad = divergent_collectives(ptx)
    assert len(bad) == 1 and "%r3|%p2" in bad[0], bad
    warp_test = """
    mov.u32 %r1, %tid.x;
    and.b32 %r2, %r1, 96;
    setp.ne.b32 %p1, %r2, 0;
    @%p1 bra $L__BB0_9;
    elect.sync %r3|%p2, -1;
    $L__BB0_9:
    ret;
    """
    assert divergent_collectives(warp_test) == []  # bits 5-6 of tid.x: the warp's position in its warpgroup
    assert len(divergent_collectives(warp_test.replace("96", "112"))) == 1  # bit 4 differs inside a warp


@pytest.mark.parametrize("D", [64, 128])
def test_forward_kernel_passes_the_same_checks(D):
    """The forward runs correctly on the H200; if the checks flagged it they would be wrong, not the kernel."""
    from flexlab.kernels.config import default_config
    from flexlab.runtime.compile import CompileKey, KernelMods, _build
    key = CompileKey("", False, False, (), (), "bfloat16", default_config(D), "sm_90a", False, False, tvm_ffi=False)
    assert divergent_collectives(_build(key, KernelMods(), KEEP_PTX).__ptx__) == []


def _compile_main(D, block_sparse=False, deterministic=False, g=None):
    from flexlab.kernels.bwd_config import default_bwd_config
    from flexlab.kernels.bwd_launch import BwdKey, compile_main
    key = BwdKey("", False, False, False, (), (), (), "bfloat16", default_bwd_config(D), block_sparse, deterministic)
    return compile_main(key, options=KEEP_PTX).__ptx__, default_bwd_config(D)


@pytest.mark.parametrize("D,block_sparse,deterministic", [(64, False, False), (128, False, False),
                                                          (128, True, False), (64, True, True),
                                                          (128, False, True)])
def test_backward_synchronisation_matches_the_config(D, block_sparse, deterministic):
    ptx, cfg = _compile_main(D, block_sparse, deterministic)
    assert divergent_collectives(ptx) == []
    # TMA delivers whole boxes even past the sequence ends: K+V once, Q+dO per stage.
    kv_bytes = 2 * cfg.tile_n * cfg.head_dim * cfg.dtype_bytes
    stats_bytes = 2 * cfg.tile_m * 4 if cfg.stats_in_smem else 0  # LSE2 and D rows land with Q and dO
    qdo_bytes = 2 * cfg.tile_m * cfg.head_dim * cfg.dtype_bytes + stats_bytes
    assert _expect_tx_bytes(ptx) == {kv_bytes, qdo_bytes}
    # full barriers: the one producer thread; empty barriers: one arrive per consumer warp.
    assert _mbarrier_init_counts(ptx) == {1, cfg.num_consumer_wgs * 4}
    check_barrier_plan(ptx, cfg)


def check_barrier_plan(ptx: str, cfg) -> None:
    """Every named barrier is one of the plan's, with the thread count the plan gives it, and the CTA-wide barrier 0
    is used once (before the role split)."""
    from flexlab.kernels.named_barrier import BwdBarrier
    ids = {int(i) for i, _ in _named_barriers(ptx) if not i.startswith("%")}
    assert ids <= {0} | {int(b) for b in BwdBarrier}
    allowed = {(str(int(BwdBarrier.DS_READY)), 128 * cfg.num_consumer_wgs),
               (str(int(BwdBarrier.EPILOGUE)), 128 * cfg.num_consumer_wgs)}
    per_wg = 128  # a barrier whose id is computed from the warpgroup: its four warps (the dQ slab is ready)
    if cfg.dq_warp:  # a warpgroup's hand-offs with the dQ warp: 128 + 32 threads
        per_wg = 160
        allowed |= {(str(int(b)), 160) for b in (BwdBarrier.DQ_FULL_WG1, BwdBarrier.DQ_FULL_WG2,
                                                  BwdBarrier.DQ_EMPTY_WG1, BwdBarrier.DQ_EMPTY_WG2)}
    for i, n in _named_barriers(ptx):
        if i.startswith("%"):
            assert n == per_wg, (i, n)
        elif i != "0":
            assert (i, n) in allowed, (i, n)
    assert len(re.findall(r"\bbar\.sync\s+0;", ptx)) == 1


def test_triage_script_reports_a_hang_instead_of_going_silent(tmp_path):
    """The GPU triage script's watchdog: a case that never finishes becomes a `timeout` record, the rest is kept."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "probes" / "bwd_triage.py"
    out = tmp_path / "triage.json"
    res = subprocess.run([sys.executable, str(script), "--out", str(out), "--groups", "selftest-hang",
                          "--case-timeout", "3"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    records = {r["name"]: r["status"] for r in json.loads(out.read_text())}
    assert records["finishes"] == "ok" and records["never finishes"] == "timeout", records


@pytest.mark.parametrize("D", [64, 128])
def test_backward_with_mods_keeps_its_synchronisation(D):
    """score_mod + derivative + captured-tensor atomics + mask_mod inlined (the lean register plan at D=128): the
    generated code must not move a collective under a divergent branch or change the barrier plan."""
    import torch
    from flexlab.codegen import generate
    from flexlab.kernels.bwd_config import default_bwd_config
    from flexlab.kernels.bwd_launch import BwdKey, compile_main
    bias = torch.randn(4, 129, requires_grad=True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, torch.clamp(kv_idx - q_idx, -64, 64) + 64]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    g = generate(rel_bias, causal, fastmath=True)
    aux = g.kernel_aux_tensors()
    cfg = default_bwd_config(D)
    key = BwdKey(g.hash, True, True, True, tuple((str(t.dtype).removeprefix("torch."), t.dim()) for t in aux),
                 tuple("float" if k == "float" else "int" for k in g.aux_scalar_kinds),
                 tuple(t.dim() for t, rg in zip(aux, g.aux_requires_grad) if rg), "bfloat16", cfg, True)
    ptx = compile_main(key, g.module(), options=KEEP_PTX).__ptx__
    assert divergent_collectives(ptx) == []
    stats_bytes = 2 * cfg.tile_m * 4 if cfg.stats_in_smem else 0
    assert _expect_tx_bytes(ptx) == {2 * cfg.tile_n * cfg.head_dim * 2, 2 * cfg.tile_m * cfg.head_dim * 2 + stats_bytes}
    assert _mbarrier_init_counts(ptx) == {1, 4 * cfg.num_consumer_wgs}
