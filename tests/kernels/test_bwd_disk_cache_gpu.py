"""Backward kernels loaded from the disk cache compute what freshly compiled ones do (GPU only).

Two fresh interpreters share one empty FLEXLAB_CACHE_DIR. The first compiles the three backward kernels (and the
forward) and stores them; the second must load every one of them from disk, compile nothing, and give bitwise the
same gradients in deterministic mode, within tolerance of float64 autograd. The second process holds several loaded
modules at once (forward, preprocess, main, postprocess), each launched on torch's current stream through TVM-FFI.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
GRAD_TOL = 2e-2  # as test_bwd_gpu: rel-L2 vs float64, bf16 inputs

_SCRIPT = r'''
import json, sys, torch, flexlab
from flexlab.autograd import differentiable_attention
from flexlab.kernels import bwd_launch
from flexlab.runtime.compile import kernel_cache
from flexlab.testing import random_qkv, reference, rel_l2

torch.manual_seed(0)
S, D = 1000, int(sys.argv[2])
bias = 0.1 * torch.randn(4, 65, device="cuda")  # captured, no grad (deterministic mode accepts it)

def rel_bias(score, b, h, q_idx, kv_idx):
    return score + bias[h, torch.clamp(kv_idx - q_idx, -32, 32) + 32]

bm = flexlab.create_block_mask(lambda b, h, qi, kv: qi >= kv, 1, 1, S, S, device="cuda")
q, k, v = random_qkv(2, 4, S, S, D, torch.bfloat16, "cuda", Hkv=2, requires_grad=True)
dout = torch.randn(2, 4, S, D, device="cuda", dtype=torch.bfloat16)
differentiable_attention(q, k, v, rel_bias, bm, enable_gqa=True, deterministic=True).backward(dout)
grads = [t.grad.clone() for t in (q, k, v)]
torch.save([g.cpu() for g in grads], sys.argv[1])
q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
reference(q64, k64, v64, rel_bias, bm, None, True)[0].backward(dout.double())
b, f = bwd_launch.bwd_kernel_cache().stats, kernel_cache().stats
print(json.dumps(dict(bwd=[b.compiles, b.disk_hits, b.rebuilt_corrupt], fwd=[f.compiles, f.disk_hits],
                      err=[rel_l2(a, r) for a, r in zip(grads, (q64.grad, k64.grad, v64.grad))])))
'''


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _hopper(), reason="needs an sm90 GPU (H100/H200)")
@pytest.mark.parametrize("D", [64, 128])
def test_backward_loaded_from_disk_matches_the_compiled_one(D, tmp_path):
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)  # keep any site dirs
    env = dict(os.environ, FLEXLAB_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=path)

    def run(name):
        res = subprocess.run([sys.executable, "-W", "ignore", "-c", _SCRIPT, str(tmp_path / name), str(D)], env=env,
                             cwd=REPO, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stderr[-4000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    cold = run("cold.pt")
    warm = run("warm.pt")
    assert cold["bwd"][:2] == [3, 0], cold  # preprocess, main, postprocess compiled and stored
    assert warm["bwd"] == [0, 3, 0] and warm["fwd"][0] == 0, warm  # all loaded, nothing compiled or rebuilt
    for a, b in zip(torch.load(tmp_path / "cold.pt"), torch.load(tmp_path / "warm.pt")):
        assert torch.equal(a, b), "loaded kernels must compute bitwise what the compiled ones did (deterministic)"
    assert max(cold["err"] + warm["err"]) < GRAD_TOL, (cold["err"], warm["err"])
