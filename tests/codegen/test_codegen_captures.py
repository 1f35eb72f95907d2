"""Closures: captured numbers are runtime arguments (one hash for all values), captured tensors kernel inputs."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import torch
from codegen_cases import cases, causal, grid, make_document, make_sliding_window, make_softcap
from torch.nn.attention.flex_attention import and_masks

from flexlab.codegen import generate

WINDOW = 32  # a module-level number read by a mod is captured like a closure cell


def test_scalar_values_never_change_source_or_hash():
    a = generate(make_softcap(20.0), make_sliding_window(16))
    b = generate(make_softcap(50.0), make_sliding_window(300))
    assert a.hash == b.hash and a.source == b.source
    assert a.aux_scalars == [20.0, 16] and b.aux_scalars == [50.0, 300]
    assert a.aux_scalar_kinds == ["float", "int"] and a.aux_scalar_names == ["cap", "window"]
    assert "20.0" not in a.source and "16" not in a.source.split('"""', 2)[2]


def test_evaluator_uses_the_scalar_values_given():
    g = generate(mask_mod=make_sliding_window(4))
    b, h, q, kv = grid()
    assert torch.equal(g.evaluate_mask_mod(b, h, q, kv).expand(2, 3, 70, 90),
                       ((q - kv).abs() <= 4).expand(2, 3, 70, 90))
    wide = g.evaluate_mask_mod(b, h, q, kv, scalars=[40])
    assert torch.equal(wide.expand(2, 3, 70, 90), ((q - kv).abs() <= 40).expand(2, 3, 70, 90))


def test_globals_defaults_partials_and_nested_combinators_become_scalars():
    def global_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < WINDOW

    def default_window(b, h, q_idx, kv_idx, window=8):
        return kv_idx - q_idx < window

    def banded(b, h, q_idx, kv_idx, lo, hi):
        return (q_idx - kv_idx >= lo) & (q_idx - kv_idx <= hi)

    g = generate(mask_mod=and_masks(global_window, default_window, functools.partial(banded, lo=-3, hi=5)))
    assert g.aux_scalar_names == ["WINDOW", "window", "lo", "hi"] and g.aux_scalars == [32, 8, -3, 5]
    b, h, q, kv = grid()
    expected = (q - kv < 32) & (kv - q < 8) & (q - kv >= -3) & (q - kv <= 5)
    assert torch.equal(g.evaluate_mask_mod(b, h, q, kv).expand(2, 3, 70, 90), expected.expand(2, 3, 70, 90))


def test_scalar_steering_python_control_flow_is_compiled_in():
    def make(causal_flag: bool, window: int):
        def mask(b, h, q_idx, kv_idx):
            keep = (q_idx - kv_idx).abs() <= window
            if causal_flag:
                keep = keep & (q_idx >= kv_idx)
            return keep
        return mask

    on, off, on_wide = generate(mask_mod=make(True, 8)), generate(mask_mod=make(False, 8)), \
        generate(mask_mod=make(True, 64))
    assert on.hash != off.hash and on.hash == on_wide.hash
    assert on.baked_scalars == {"causal_flag": True} and on.aux_scalar_names == ["window"]
    assert "compiled-in constant causal_flag = True" in on.source
    b, h, q, kv = grid()
    assert torch.equal(on.evaluate_mask_mod(b, h, q, kv), ((q - kv).abs() <= 8) & (q >= kv))
    assert torch.equal(off.evaluate_mask_mod(b, h, q, kv), (q - kv).abs() <= 8)


def test_bool_scalar_used_arithmetically_stays_runtime():
    def make(flag):
        def mod(score, b, h, q_idx, kv_idx):
            return torch.where(flag & (q_idx < kv_idx), score * 0.5, score)
        return mod

    a, b_ = generate(make(True)), generate(make(False))
    assert a.hash == b_.hash and a.aux_scalar_kinds == ["bool"]
    assert "aux_scalars[0]) != Int32(0)" in a.source


def test_captured_tensors_dtype_and_rank_enter_the_hash_but_data_does_not():
    ids = torch.arange(90) // 30
    g1 = generate(mask_mod=make_document(ids))
    g2 = generate(mask_mod=make_document(torch.randint(0, 9, (90,))))
    g3 = generate(mask_mod=make_document(ids.to(torch.int32)))
    g4 = generate(mask_mod=make_document(ids.view(1, 90)[0:1].reshape(90, 1)[:, 0].clone()))
    assert g1.hash == g2.hash == g4.hash and g1.hash != g3.hash
    assert g1.aux_tensor_names == ["doc_ids"] and g1.aux_tensors[0] is ids
    k = g1.kernel_aux_tensors()[0]
    assert k.dtype == torch.int32 and k.is_contiguous() and torch.equal(k.long(), ids)


def test_requires_grad_is_reported_and_changes_the_hash():
    table = torch.randn(3, 33)
    from codegen_cases import make_relative_bias
    plain = generate(make_relative_bias(table, 16))
    learnable = generate(make_relative_bias(table.clone().requires_grad_(), 16))
    assert plain.aux_requires_grad == [False] and learnable.aux_requires_grad == [True]
    assert plain.hash != learnable.hash
    assert "add_aux_grad" in learnable.source and "add_aux_grad" not in plain.source


def test_mask_aux_tensors_are_the_ones_the_mask_reads():
    bias = torch.randn(64)
    doc = torch.zeros(64, dtype=torch.int64)
    shared = torch.zeros(64, dtype=torch.int64)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx] + shared[q_idx]

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (shared[kv_idx] >= 0)

    g = generate(score_mod, mask_mod)
    assert {id(t) for t in g.mask_aux_tensors} == {id(doc), id(shared)}
    assert generate(score_mod, None).mask_aux_tensors == []


def test_same_tensor_captured_twice_is_one_aux_tensor():
    doc = torch.randint(0, 3, (90,))
    g = generate(mask_mod=and_masks(make_document(doc), make_document(doc)))
    assert len(g.aux_tensors) == 1


def test_refresh_picks_up_changed_module_level_values_without_tracing():
    global WINDOW

    def mod(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < WINDOW

    g = generate(mask_mod=mod)
    assert g.refresh() is g  # nothing changed
    WINDOW = 5
    try:
        fresh = g.refresh()
    finally:
        WINDOW = 32
    assert fresh.aux_scalars == [5] and fresh.hash == g.hash
    assert fresh.source is g.source and fresh._traced is g._traced  # same trace: new values only
    assert g.aux_scalars == [32]


def test_refresh_follows_closure_cells_and_retraces_on_structural_change():
    table = torch.randn(3, 40)
    state = {"cap": 10.0, "causal": True, "table": table}

    def make():
        cap, causal, tab = state["cap"], state["causal"], state["table"]

        def mod(score, b, h, q_idx, kv_idx):
            out = cap * torch.tanh(score / cap) + tab[h, kv_idx % 40]
            if causal:
                out = torch.where(q_idx >= kv_idx, out, float("-inf"))
            return out

        def set_(name, value):
            nonlocal cap, causal, tab
            if name == "cap":
                cap = value
            elif name == "causal":
                causal = value
            else:
                tab = value
        return mod, set_

    mod, set_ = make()
    g = generate(mod)
    assert g.aux_scalar_names == ["cap"] and g.baked_scalars == {"causal": True}
    set_("cap", 25.0)
    r = g.refresh()
    assert r.aux_scalars == [25.0] and r._traced is g._traced
    set_("cap", 25)  # int now: a different kernel argument type, so trace again
    r = g.refresh()
    assert r._traced is not g._traced and r.aux_scalar_kinds == ["int"] and r.hash != g.hash
    set_("cap", 25.0)
    set_("causal", False)  # a baked number changed: new structure
    r = g.refresh()
    assert r.baked_scalars == {"causal": False} and r.hash != g.hash
    set_("causal", True)
    new_table = torch.randn(3, 40)
    set_("table", new_table)  # rebound tensor: same structure, new aux tensor
    r = g.refresh()
    assert r.aux_tensors[0] is new_table and r.hash == g.hash


def test_module_is_executed_once_per_hash_and_defines_the_contract():
    g = generate(make_softcap(10.0), causal)
    mod = g.module()
    assert generate(make_softcap(99.0), causal).module() is mod
    for name in ("score_mod", "mask_mod", "score_mod_bwd", "score_mod_aux_grad"):
        assert callable(getattr(mod, name))


def test_repr_html_highlights_source():
    html = generate(make_softcap(10.0))._repr_html_()
    assert "score_mod" in html and "<span" in html and "tanh_softcap" in html


_HASH_SCRIPT = """
import json, sys
sys.path.insert(0, {here!r})
from codegen_cases import cases
from flexlab.codegen import generate
out = {{name: [g.hash, g.source] for name, g in
        ((name, generate(*mods)) for name, mods in sorted(cases(seed=1).items()))}}
print(json.dumps(out))
"""


def test_hash_and_source_are_identical_across_processes():
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONHASHSEED="123")
    repo = os.path.dirname(os.path.dirname(here))
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _HASH_SCRIPT.format(here=here)], capture_output=True, text=True,
                          env=env, timeout=300, check=True)
    other = json.loads(proc.stdout.strip().splitlines()[-1])
    mine = {name: [g.hash, g.source] for name, g in
            ((name, generate(*mods)) for name, mods in sorted(cases(seed=2).items()))}
    assert other == mine  # different captured data (seeds), same structure: same hash and bytes
    assert len({h for h, _ in mine.values()}) == len(mine)


def test_gathers_at_kernel_indices_skip_the_negative_index_wrap():
    """q_idx, kv_idx, b and h are never negative in a kernel, so a gather at one of them is only clamped; an index
    computed from them (which can be negative, as in torch) keeps the wrap."""
    doc = torch.zeros(64, dtype=torch.int32)
    bias = torch.zeros(127)

    def same_document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    def relative(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx - q_idx]

    masked = generate(None, same_document).source
    assert "< Int32(0)" not in masked and masked.count("cutlass.min(") == 2
    shifted = generate(relative, None).source
    assert "< Int32(0)" in shifted  # torch's wrap of a negative offset
