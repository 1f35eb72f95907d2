"""The gallery of attention variants: metadata, parameters and the loader over ``gallery/*.py``.

Each variant lives in its own file (``gallery/<name>.py``) so that a reader can open one file and see the whole idea:
a ``generate_<name>(...)`` factory returning plain score_mod / mask_mod functions, and a ``VARIANT = Variant(...)``
that says what the idea is, where it comes from, which knobs it has (the playground's sliders) and which sequence
lengths make sense for it. The loader imports those files from the installed wheel (``flexlab/_gallery``) or, in a
development checkout, from the repository's ``gallery/`` folder.

Example::

    from flexlab.gallery import get_variant
    v = get_variant("sliding_window")
    mods = v.build(B=1, H=4, Q_LEN=256, KV_LEN=256, window=64)
    block_mask = flexlab.create_block_mask(mods.mask_mod, 1, 4, 256, 256)
"""
from __future__ import annotations

import html
import importlib.resources
import importlib.util
import inspect
import sys
import types
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from .errors import FlexlabTypeError, FlexlabValueError

__all__ = ["Param", "Mods", "Variant", "load_gallery", "get_variant", "gallery_dir", "KINDS"]

KINDS = ("mask", "score", "both")


@dataclass(frozen=True)
class Param:
    """One knob of a variant; also the spec of the playground slider that moves it.

    The type of ``default`` decides the slider: an ``int`` default gives an integer slider, a ``float`` a float one.
    """

    name: str
    default: int | float
    min: int | float
    max: int | float
    step: int | float = 1
    description: str = ""

    def __post_init__(self):
        if not self.name.isidentifier():
            raise FlexlabValueError(f"Param name {self.name!r} must be a Python identifier (it becomes a keyword)")
        if not (self.min <= self.default <= self.max):
            raise FlexlabValueError(
                f"Param {self.name!r}: default {self.default} lies outside [{self.min}, {self.max}]")
        if self.step <= 0:
            raise FlexlabValueError(f"Param {self.name!r}: step must be positive, got {self.step}")

    @property
    def is_int(self) -> bool:
        return isinstance(self.default, int) and not isinstance(self.default, bool)

    def check(self, value: Any, variant: str = "?") -> int | float:
        """Return ``value`` converted to this parameter's type, or raise naming the variant and the parameter."""
        if isinstance(value, torch.Tensor):
            value = value.item()
        if self.is_int:
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if not isinstance(value, int) or isinstance(value, bool):
                raise FlexlabTypeError(f"variant {variant!r}: parameter {self.name!r} expects an int, "
                                       f"got {type(value).__name__} {value!r}")
        else:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise FlexlabTypeError(f"variant {variant!r}: parameter {self.name!r} expects a number, "
                                       f"got {type(value).__name__} {value!r}")
            value = float(value)
        if not (self.min <= value <= self.max):
            raise FlexlabValueError(f"variant {variant!r}: parameter {self.name}={value} is outside its range "
                                    f"[{self.min}, {self.max}] ({self.description or 'no description'})")
        return value


@dataclass(frozen=True, eq=False)
class Mods:
    """What a variant hands to ``flex_attention``: the mods and the tensors they capture, by name.

    ``score_mod`` or ``mask_mod`` is ``None`` when the variant does not use it. ``tensors`` names every tensor the
    mods close over (doc ids, bias tables, learnable biases) so that tools can show them and tests can move them
    to a device or ask for their gradients.
    """

    score_mod: Callable | None = None
    mask_mod: Callable | None = None
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)


def _any_lengths(q_len: int, kv_len: int) -> bool:
    return q_len >= 1 and kv_len >= 1


@dataclass(frozen=True, eq=False)
class Variant:
    """One attention variant of the gallery.

    ``make(B, H, Q_LEN, KV_LEN, device="cpu", **params) -> Mods`` builds the mods and any captured tensors for the
    given shape; call it through :meth:`build`, which fills defaults and checks parameters and lengths first.
    ``accepts`` encodes ``lengths_rule`` (the same rule, once in words for people and once as a predicate).
    ``trainable`` names the captured tensors that are learnable parameters (they get gradients in training).
    ``source`` is the readable Python of the mods that the playground editor starts from; the loader fills it
    from the ``generate_*`` factory when a file leaves it empty.
    """

    name: str
    description: str
    paper: str
    kind: str
    make: Callable[..., Mods]
    params: tuple[Param, ...] = ()
    lengths_rule: str = "any Q_LEN and KV_LEN"
    accepts: Callable[[int, int], bool] = _any_lengths
    builtin_equivalent: str | None = None
    source: str = ""
    trainable: tuple[str, ...] = ()
    example_lengths: tuple[int, int] = (256, 256)
    file: str = ""

    def __post_init__(self):
        if not self.name.isidentifier():
            raise FlexlabValueError(f"Variant name {self.name!r} must be a Python identifier")
        if self.kind not in KINDS:
            raise FlexlabValueError(f"Variant {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if not callable(self.make):
            raise FlexlabTypeError(f"Variant {self.name!r}: make must be callable")
        params = tuple(self.params)
        object.__setattr__(self, "params", params)
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            raise FlexlabValueError(f"Variant {self.name!r}: duplicate parameter names {names}")
        if not self.accepts(*self.example_lengths):
            raise FlexlabValueError(f"Variant {self.name!r}: example_lengths {self.example_lengths} break its "
                                    f"own rule ({self.lengths_rule})")

    def _repr_html_(self) -> str:
        """A card for notebooks: what the variant is, its knobs, its length rule and its code."""
        esc = html.escape
        rows = "".join(f"<tr><td><code>{esc(p.name)}</code></td><td>{p.default}</td><td>{p.min} .. {p.max}</td>"
                       f"<td>{esc(p.description)}</td></tr>" for p in self.params)
        params = (f"<table><tr><th>parameter</th><th>default</th><th>range</th><th></th></tr>{rows}</table>"
                  if rows else "<p>No parameters.</p>")
        builtin = f"<code>{esc(self.builtin_equivalent)}</code>" if self.builtin_equivalent else "none"
        return (f"<div class='flexlab-variant'><h4>{esc(self.name)} <small>({esc(self.kind)})</small></h4>"
                f"<p>{esc(self.description)} <a href='{esc(self.paper)}' target='_blank'>paper</a></p>"
                f"<p>Lengths: {esc(self.lengths_rule)}. Nearest built-in: {builtin}.</p>{params}"
                f"<pre>{esc(self.source)}</pre></div>")

    def accepts_lengths(self, q_len: int, kv_len: int) -> bool:
        """Whether this variant makes sense for ``Q_LEN=q_len, KV_LEN=kv_len`` (see ``lengths_rule``)."""
        return bool(self.accepts(int(q_len), int(kv_len)))

    def defaults(self) -> dict[str, int | float]:
        return {p.name: p.default for p in self.params}

    def resolve_params(self, **params) -> dict[str, int | float]:
        """Defaults overlaid with ``params``, each checked against its range; unknown names are an error."""
        known = {p.name: p for p in self.params}
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise FlexlabValueError(f"variant {self.name!r} has no parameter(s) {unknown}; "
                                    f"its parameters are {sorted(known) or 'none'}")
        out = self.defaults()
        for key, value in params.items():
            out[key] = known[key].check(value, self.name)
        return out

    def build(self, B: int = 1, H: int = 1, Q_LEN: int | None = None, KV_LEN: int | None = None,
              device: str | torch.device = "cpu", **params) -> Mods:
        """Check lengths and parameters, then call ``make``. Lengths default to ``example_lengths``."""
        q_len = self.example_lengths[0] if Q_LEN is None else int(Q_LEN)
        kv_len = self.example_lengths[1] if KV_LEN is None else int(KV_LEN)
        if not self.accepts_lengths(q_len, kv_len):
            raise FlexlabValueError(f"variant {self.name!r} does not accept Q_LEN={q_len}, KV_LEN={kv_len}: "
                                    f"its rule is '{self.lengths_rule}'")
        resolved = self.resolve_params(**params)
        mods = self.make(int(B), int(H), q_len, kv_len, device=device, **resolved)
        if not isinstance(mods, Mods):
            raise FlexlabTypeError(f"variant {self.name!r}: make() returned {type(mods).__name__}, expected Mods")
        return mods


def gallery_dir() -> Path:
    """Folder holding the variant files: the wheel's ``flexlab/_gallery`` if installed that way, else the repo's."""
    try:
        shipped = importlib.resources.files("flexlab") / "_gallery"
        if shipped.is_dir():
            return Path(str(shipped))
    except (ModuleNotFoundError, TypeError, FileNotFoundError):
        pass
    repo = Path(__file__).resolve().parent.parent / "gallery"
    if repo.is_dir():
        return repo
    raise FileNotFoundError("flexlab's gallery folder is missing: expected flexlab/_gallery in an installed wheel "
                            "or gallery/ next to the flexlab package in a checkout")


def _variant_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))


_PACKAGE = "flexlab._gallery_variants"


def _import_file(path: Path):
    """Import one variant file as ``flexlab._gallery_variants.<stem>``, registered so that tools which look a
    function up by its ``__module__`` (inspect, torch.compile, pickle) find it."""
    if _PACKAGE not in sys.modules:
        package = types.ModuleType(_PACKAGE, "Variant files of flexlab's gallery, imported by flexlab.gallery.")
        package.__path__ = []
        sys.modules[_PACKAGE] = package
    module_name = f"{_PACKAGE}.{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # inspect.getsource needs the module registered
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(module_name, None)
        raise FlexlabValueError(f"gallery file {path.name} failed to import: {type(err).__name__}: {err}") from err
    return module


def _factory_source(module) -> str:
    """The ``generate_*`` factories of a variant file, in file order: what the playground editor shows."""
    pieces = []
    for name, obj in vars(module).items():
        if name.startswith("generate_") and inspect.isfunction(obj) and obj.__module__ == module.__name__:
            pieces.append((obj.__code__.co_firstlineno, inspect.getsource(obj)))
    return "\n\n".join(src for _, src in sorted(pieces))


@lru_cache(maxsize=None)
def _load(folder: str) -> dict[str, Variant]:
    variants: dict[str, Variant] = {}
    for path in _variant_files(Path(folder)):
        module = _import_file(path)
        variant = getattr(module, "VARIANT", None)
        if not isinstance(variant, Variant):
            raise FlexlabValueError(f"gallery file {path.name} must define VARIANT = Variant(...)")
        if variant.name != path.stem:
            raise FlexlabValueError(f"gallery file {path.name} defines variant {variant.name!r}; "
                                    f"the file must be named after its variant ({variant.name}.py)")
        variant = replace(variant, source=variant.source or _factory_source(module), file=str(path))
        variants[variant.name] = variant
    return dict(sorted(variants.items()))


def load_gallery() -> dict[str, Variant]:
    """All variants, keyed and sorted by name. Files are imported once per process."""
    return dict(_load(str(gallery_dir())))


def get_variant(name: str) -> Variant:
    variants = load_gallery()
    if name not in variants:
        raise FlexlabValueError(f"no gallery variant named {name!r}; available: {', '.join(variants)}")
    return variants[name]
