"""The gallery loader and the metadata contract every variant file must honour."""
from __future__ import annotations

import inspect

import pytest
import torch

from flexlab.errors import FlexlabTypeError, FlexlabValueError
from flexlab.gallery import KINDS, Mods, Param, Variant, get_variant, load_gallery

VARIANTS = load_gallery()


def test_loader_is_sorted_and_deterministic():
    assert list(VARIANTS) == sorted(VARIANTS)
    assert list(load_gallery()) == list(VARIANTS)


def test_core_variants_present():
    for name in ["noop", "causal", "sliding_window", "prefix_lm", "document", "alibi", "softcap",
                 "t5_relative_bias", "padded_causal"]:
        assert name in VARIANTS


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_metadata(name):
    v = VARIANTS[name]
    assert v.name == name and v.kind in KINDS
    assert v.description and len(v.description.splitlines()) == 1
    assert v.paper.startswith("https://")
    assert v.lengths_rule
    assert v.file.endswith(f"{name}.py")
    assert "def generate_" in v.source
    for p in v.params:
        assert p.description, f"{name}.{p.name} needs a description for its slider"
    assert v.accepts_lengths(*v.example_lengths)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_build_matches_kind_and_names(name):
    v = VARIANTS[name]
    mods = v.build(B=2, H=3)
    assert isinstance(mods, Mods)
    if v.kind in ("mask", "both"):
        assert callable(mods.mask_mod) and mods.mask_mod.__name__ != "<lambda>"
    if v.kind in ("score", "both"):
        assert callable(mods.score_mod) and mods.score_mod.__name__ != "<lambda>"
    if v.kind == "mask":
        assert mods.score_mod is None
    if v.kind == "score":
        assert mods.mask_mod is None
    for key, tensor in mods.tensors.items():
        assert isinstance(tensor, torch.Tensor), key
    for key in v.trainable:
        assert mods.tensors[key].is_floating_point()
    # make() takes exactly the declared parameters as keywords
    signature = inspect.signature(v.make)
    declared = {p.name for p in v.params}
    assert declared <= set(signature.parameters)


def test_parameter_checks_name_the_variant_and_parameter():
    v = get_variant("sliding_window")
    with pytest.raises(FlexlabValueError, match="sliding_window.*window"):
        v.build(window=0)
    with pytest.raises(FlexlabTypeError, match="window"):
        v.build(window="wide")
    with pytest.raises(FlexlabValueError, match="no parameter"):
        v.build(widow=3)
    assert v.resolve_params(window=7.0)["window"] == 7


def test_length_rule_is_enforced():
    v = get_variant("document")
    assert not v.accepts_lengths(128, 256)
    with pytest.raises(FlexlabValueError, match="Q_LEN == KV_LEN"):
        v.build(Q_LEN=128, KV_LEN=256)


def test_unknown_variant_lists_the_known_ones():
    with pytest.raises(FlexlabValueError, match="causal"):
        get_variant("casual")


def test_param_and_variant_validation():
    with pytest.raises(FlexlabValueError):
        Param("w", 10, 0, 5)
    with pytest.raises(FlexlabValueError):
        Variant(name="x", description="d", paper="https://x", kind="weird", make=lambda *a, **k: Mods())
    assert Param("w", 3, 0, 5).is_int and not Param("c", 3.0, 0.0, 5.0).is_int


def test_notebook_card_shows_the_essentials():
    v = get_variant("sliding_window")
    card = v._repr_html_()
    for text in ("sliding_window", v.paper, "window", "4096", "def generate_sliding_window", "flash_attn_func"):
        assert text in card
    assert "q_idx - kv_idx &lt; window" in card and "q_idx - kv_idx < window" not in card  # code is escaped


@pytest.mark.parametrize("body,message", [
    ("raise RuntimeError('boom')\n", "broken.py failed to import: RuntimeError: boom"),
    ("x = 1\n", "broken.py must define VARIANT"),
    ("from flexlab.gallery import Mods, Variant\nVARIANT = Variant(name='other', description='d', "
     "paper='https://x', kind='mask', make=lambda *a, **k: Mods())\n", "must be named after its variant"),
])
def test_a_bad_variant_file_is_named_in_the_error(tmp_path, body, message):
    from flexlab.gallery import _load

    (tmp_path / "broken.py").write_text(body)
    (tmp_path / "_shared.py").write_text("raise RuntimeError('files starting with _ are not variants')\n")
    with pytest.raises(FlexlabValueError, match=message):
        _load(str(tmp_path))
