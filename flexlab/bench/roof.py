"""The roof each row's TFLOP/s is compared against: the GPU's sustained dense bf16 matmul rate.

A rate per GPU model, not a datasheet peak: H100 and H200 SXM both list 989 TFLOP/s of dense bf16, which no kernel
sustains. The rates below are torch.matmul of 8192 x 8192 x 8192 bf16, the median of 9 rounds of 20 calls. A GPU
not listed gets the same measurement at the start of the run (`measure_matmul_tflops`), so "% of roof" never reads
one GPU's results against another's rate.
"""
from __future__ import annotations

import statistics

import torch

# (name fragment as torch reports the GPU, sustained bf16 TFLOP/s); the first fragment found in the name wins.
SUSTAINED_MATMUL_TFLOPS = (("H200", 790.0), ("H100", 720.0))
MATMUL_CEILING_TFLOPS = SUSTAINED_MATMUL_TFLOPS[0][1]  # the H200's: the GPU the issues' targets were measured on


def known_ceiling(gpu: str | None) -> float | None:
    """The listed sustained rate of GPU `gpu` (a name as torch reports it), or None."""
    for fragment, tflops in SUSTAINED_MATMUL_TFLOPS:
        if gpu and fragment in gpu:
            return tflops
    return None


def measure_matmul_tflops(device: torch.device, n: int = 8192, rounds: int = 9, calls: int = 20) -> float:
    """Median bf16 TFLOP/s of `calls` back-to-back n x n x n torch.matmul calls over `rounds` rounds (after a
    warm-up), timed with CUDA events."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(calls):
        a @ b
    rates = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            a @ b
        end.record()
        torch.cuda.synchronize(device)
        rates.append(2 * n ** 3 * calls / (start.elapsed_time(end) * 1e-3) / 1e12)
    return statistics.median(rates)


def matmul_ceiling(env: dict, device: torch.device) -> tuple[float, str]:
    """(roof TFLOP/s, where it comes from) for a run described by `env` (`report.environment`) on `device`."""
    gpu = env.get("gpu")
    listed = known_ceiling(gpu)
    if listed is not None:
        return listed, f"sustained bf16 matmul rate listed for {gpu}"
    if device.type == "cuda":
        return round(measure_matmul_tflops(device), 1), f"bf16 matmul measured on {gpu} at the start of the run"
    return MATMUL_CEILING_TFLOPS, "the H200's sustained bf16 matmul rate (no GPU in this run)"
