"""Let small trace-time helper objects flow through runtime `if`/`for` regions.

The DSL carries a Python object across a runtime region only if it can list its IR values and rebuild itself from
new ones. `Carried` does that for the attributes named in `_FIELDS` (DSL scalars, tensors, tuples of them, None).
"""
from __future__ import annotations

import copy

import cutlass


class Carried:
    _FIELDS: tuple[str, ...] = ()

    def __extract_mlir_values__(self):
        values, self._counts = [], []
        for name in self._FIELDS:
            v = cutlass.extract_mlir_values(getattr(self, name))
            values += v
            self._counts.append(len(v))
        return values

    def __new_from_mlir_values__(self, values):
        new, pos = copy.copy(self), 0
        for name, count in zip(self._FIELDS, self._counts):
            setattr(new, name, cutlass.new_from_mlir_values(getattr(self, name), values[pos:pos + count]))
            pos += count
        return new
