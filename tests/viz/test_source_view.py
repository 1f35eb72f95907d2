"""The source viewer links generated comments to the user's lines and shows unsupported ops in place."""
from __future__ import annotations

import re

from flexlab.jupyter.experiment import load_mods
from flexlab.viz.source_view import UserSource, source_view, user_source_of

CODE = """\
window = 64

def mask_mod(b, h, q_idx, kv_idx):
    causal = q_idx >= kv_idx
    near = q_idx - kv_idx < window
    return causal & near

def score_mod(score, b, h, q_idx, kv_idx):
    return score * 0.5 + torch.tanh(score)
"""


def test_generated_comments_link_to_the_quoted_user_line():
    mods = load_mods(CODE)
    view = source_view(mods.score_mod, mods.mask_mod, user=UserSource(CODE, mods.filename))
    assert view.error is None and "@cute.jit" in view.source
    links = view.links()
    user_lines = CODE.splitlines()
    generated = view.source.split("\n")
    assert {4, 5, 6, 9} <= set(links.values())
    for gen_idx, user_line in links.items():
        quoted = generated[gen_idx].split(": ", 1)[1].strip()
        assert quoted == user_lines[user_line - 1].strip()
    html = view._repr_html_()
    assert len(re.findall(r"flexlab-src-link", html)) == len(links)
    prefix = f"flexlab-user-{view.uid}"
    for n in set(links.values()):
        assert f"id='{prefix}-L{n}'" in html and f"href='#{prefix}-L{n}'" in html


def test_unsupported_op_is_shown_with_its_line():
    code = "def score_mod(score, b, h, q_idx, kv_idx):\n    if score.item() > 0:\n        return score\n    return -score\n"
    mods = load_mods(code)
    view = source_view(mods.score_mod, None, user=UserSource(code, mods.filename))
    assert view.source is None and view.error_line == 2 and "item" in view.error
    html = view._repr_html_()
    assert "cannot generate code (line 2)" in html and "rgba(220,50,47" in html


def test_user_source_from_inspect_for_file_defined_mods():
    def rel(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx)

    user = user_source_of(rel)
    assert user.text.lstrip().startswith("def rel") and user.filename.endswith("test_source_view.py")
    view = source_view(rel)
    assert view.error is None and view.links()
