"""Closures are part of a mod: find what a function captures and swap captured Python numbers for proxies.

A mod such as `lambda b, h, q, kv: q - kv <= window` must not bake `window` into generated code, or every new
window size would regenerate and recompile the kernel. Before tracing we rebuild the function (and the helper
functions it reaches: closure cells, default arguments, referenced module globals, `functools.partial`) with each
captured int/float/bool replaced by a scalar proxy, which the tracer turns into a runtime kernel argument. A scalar
whose value steers Python control flow (`if causal:`) is "baked": the next trace sees the plain number again.
Captured tensors are left in place; the tracer meets them when they are indexed and records their names here.

Every captured slot also gets a reader (a function returning what the slot holds now), so `GeneratedMods.refresh`
can pick up new scalar values without tracing again, and can tell when something structural changed instead.
"""
from __future__ import annotations

import functools
import types
from typing import Callable

_SCALAR_TYPES = (bool, int, float)
_LIBRARY_PREFIXES = ("torch", "flexlab.codegen", "cutlass", "numpy", "builtins", "math", "functools")
_MAX_DEPTH = 6


def _is_user_function(fn) -> bool:
    module = getattr(fn, "__module__", None) or ""
    return isinstance(fn, types.FunctionType) and not module.startswith(_LIBRARY_PREFIXES)


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names


class CaptureRewriter:
    """Rebuilds user functions with captured scalars replaced by `make_scalar(slot, name, value)` results.

    `slot` identifies where the number lives (function object, "cell"/"global"/"default", variable name); slots in
    `baked` keep their plain value. `tensor_names` maps id(tensor) -> the variable name it was captured under.
    """

    def __init__(self, make_scalar: Callable, baked: set):
        self.make_scalar = make_scalar
        self.baked = baked
        self.tensor_names: dict[int, str] = {}
        self.baked_values: dict[str, object] = {}
        self.readers: dict[tuple, Callable] = {}  # scalar slot -> reads its current value
        self.watch: list[tuple[Callable, object]] = []  # (reader, value at trace time) of every other capture
        self._memo: dict[int, object] = {}

    def rewrite(self, fn, depth: int = 0):
        if depth > _MAX_DEPTH:
            return fn
        if id(fn) in self._memo:
            return self._memo[id(fn)]
        if isinstance(fn, functools.partial):
            new = functools.partial(self.rewrite(fn.func, depth + 1),
                                    *[self._value(a, (id(fn), "partial", str(i)), f"arg{i}", depth,
                                                  lambda p=fn, i=i: p.args[i])
                                      for i, a in enumerate(fn.args)],
                                    **{k: self._value(v, (id(fn), "partial", k), k, depth,
                                                      lambda p=fn, k=k: p.keywords[k])
                                       for k, v in fn.keywords.items()})
            self._memo[id(fn)] = new
            return new
        if isinstance(fn, types.MethodType):
            new = types.MethodType(self.rewrite(fn.__func__, depth + 1), fn.__self__)
            self._memo[id(fn)] = new
            return new
        if not isinstance(fn, types.FunctionType):
            return fn
        self._memo[id(fn)] = fn  # recursion guard for self-referencing helpers
        code = fn.__code__
        closure = None
        if fn.__closure__:
            cells = []
            for name, cell in zip(code.co_freevars, fn.__closure__):
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell (variable assigned later); leave it alone
                    cells.append(cell)
                    continue
                cells.append(types.CellType(self._value(value, (id(cell), "cell", name), name, depth,
                                                        lambda c=cell: c.cell_contents)))
            closure = tuple(cells)
        fn_globals = fn.__globals__
        replaced = {}
        if _is_user_function(fn):
            for name in sorted(_global_names(code)):
                if name in fn_globals:
                    value = fn_globals[name]
                    new_value = self._value(value, (id(fn_globals), "global", name), name, depth,
                                            lambda d=fn_globals, n=name: d[n])
                    if new_value is not value:
                        replaced[name] = new_value
        if replaced:
            fn_globals = {**fn_globals, **replaced}
        defaults = fn.__defaults__
        if defaults:
            names = code.co_varnames[code.co_argcount - len(defaults):code.co_argcount]
            defaults = tuple(self._value(v, (id(fn), "default", n), n, depth, lambda f=fn, i=i: f.__defaults__[i])
                             for i, (n, v) in enumerate(zip(names, defaults)))
        kwdefaults = fn.__kwdefaults__
        if kwdefaults:
            kwdefaults = {k: self._value(v, (id(fn), "default", k), k, depth, lambda f=fn, k=k: f.__kwdefaults__[k])
                          for k, v in kwdefaults.items()}
        if closure is fn.__closure__ and not replaced and defaults is fn.__defaults__ \
                and kwdefaults is fn.__kwdefaults__:
            return fn
        new = types.FunctionType(code, fn_globals, fn.__name__, defaults, closure)
        new.__kwdefaults__ = kwdefaults
        new.__qualname__ = fn.__qualname__
        new.__module__ = fn.__module__
        new.__dict__.update(fn.__dict__)
        self._memo[id(fn)] = new
        return new

    def _value(self, value, slot, name: str, depth: int, read: Callable):
        if type(value) in _SCALAR_TYPES:
            if slot in self.baked:
                self.baked_values[name] = value
                self.watch.append((read, value))
                return value
            self.readers[slot] = read
            return self.make_scalar(slot, name, value)
        self.watch.append((read, value))
        if _is_tensor(value):
            self.tensor_names.setdefault(id(value), name)
            return value
        if isinstance(value, (types.FunctionType, functools.partial, types.MethodType)):
            if isinstance(value, types.FunctionType) and not _is_user_function(value) \
                    and not value.__closure__:
                return value
            return self.rewrite(value, depth + 1)
        if type(value) in (tuple, list):
            # Only the functions inside (and_masks keeps its mods in a tuple); numbers in containers stay constants,
            # because code that inspects containers (isinstance, len, unpacking) must see plain Python values.
            items = [self.rewrite(v, depth + 1) if callable(v) else v for v in value]
            if all(a is b for a, b in zip(items, value)):
                return value
            return type(value)(items)
        return value


def captured_tensors(*fns) -> list:
    """The tensors the functions capture, wherever the tracer would find them (closure cells, defaults, referenced
    module globals, `functools.partial` arguments, helper functions), without tracing them."""
    finder = CaptureRewriter(lambda slot, name, value: value, baked=set())
    for fn in fns:
        if fn is not None:
            finder.rewrite(fn)
    return [value for _, value in finder.watch if _is_tensor(value)]


def _is_tensor(value) -> bool:
    import torch
    return isinstance(value, torch.Tensor)


def same_capture(current, expected) -> bool:
    """Whether a slot still holds what was traced: numbers by type and value, containers item by item, the rest
    (tensors, functions, objects) by identity."""
    if type(expected) in _SCALAR_TYPES:
        return type(current) is type(expected) and current == expected
    if type(expected) in (tuple, list):
        return type(current) is type(expected) and len(current) == len(expected) and \
            all(same_capture(a, b) for a, b in zip(current, expected))
    return current is expected
