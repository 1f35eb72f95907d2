r"""One training step of flexlab and of FA4 on the same inputs, for Nsight Compute (not a test; GPU machine only):

    ncu --clock-control none -k regex:'FlexFwdSm90|FlexBwdSm90|ForwardSm90|BackwardSm90' --section SpeedOfLight \
        --section WarpStateStats ... python benchmarks/probes/ncu_step.py causal 4 4096 128

Stall reasons per issued instruction (what splits a gap in cycles per instruction), both kernels in one run:

    ncu --clock-control none -k regex:'FlexBwdSm90|BackwardSm90' \
        --metrics regex:'smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        python benchmarks/probes/ncu_step.py causal 1 16384 128 fa4

Each backend runs the step twice (the first compiles); profile the second with `--launch-skip`/`--launch-count` or
keep both. `--forward` (anywhere in the arguments) runs the forward alone, without autograd. The peer (fifth
argument) is `fa4` (flash_attn.cute called directly; runs only when it imports and spells the variant) or
`flex-flash` (torch's flex_attention with BACKEND=FLASH, FA4's kernels with its block-sparse tiles).
`--field NAME[=VALUE],...` runs flexlab's backward (with `--forward`, forward) with those configuration fields
flipped or set, as `option_probe.py --field` does, so a profile can show where an option moves the stalls:

    ncu ... python benchmarks/probes/ncu_step.py causal 1 16384 128 fa4 --field stats_before_dp
"""
from __future__ import annotations

import sys

import torch


def main(variant: str = "dense", B: int = 4, S: int = 4096, D: int = 128, peer: str = "fa4", H: int = 16,
         forward_only: bool = False, fields: list[str] | None = None) -> None:
    import flexlab
    if fields:
        from option_probe import Switch  # (this directory is on the path when the script runs)
        switch = Switch(fields, forward_only)
        switch.use("flipped")
    from flexlab.bench.cases import build_case
    from flexlab.bench.peers import Unavailable, prepare_fa4, prepare_flex_flash

    case = build_case(variant, B, H, S, "cuda")
    bm = flexlab.create_block_mask(case.mask_mod, None, None, S, S, device="cuda") if case.mask_mod else None
    grad = not forward_only
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
    dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        out = flexlab.flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, backend="cute")
        if grad:
            out.backward(dout)
    torch.cuda.synchronize()
    if fields and not switch.asked[0]:
        raise SystemExit(f"--field {','.join(fields)}: the launcher planned no configuration to change")
    try:
        prep = (prepare_flex_flash if peer == "flex-flash" else prepare_fa4)(case, q, k, v, bm, grad)
    except Unavailable as e:
        print(f"{peer}:", e)
        return
    for _ in range(2):
        out = prep.call()
        if grad:
            out.backward(prep.from_bhsd(dout))
    torch.cuda.synchronize()


if __name__ == "__main__":
    argv, fields = sys.argv[1:], None
    if "--field" in argv:
        i = argv.index("--field")
        fields = argv[i + 1].split(",")
        del argv[i:i + 2]
    a = [x for x in argv if x != "--forward"]
    main(a[0] if a else "dense", *(int(x) for x in a[1:4]), *a[4:5], forward_only="--forward" in argv, fields=fields)
