"""One rule for the small per-call caches keyed by user objects (mods, call signatures): keep the newest entries.

Mods defined afresh inside a model's forward, or a new signature per call, would otherwise add an entry (and keep
what it references alive) on every call.
"""
from __future__ import annotations


def put_bounded(cache: dict, key, value, limit: int) -> None:
    """`cache[key] = value`, dropping the oldest insertions so that at most `limit` entries remain."""
    cache.pop(key, None)
    while len(cache) >= limit:
        del cache[next(iter(cache))]
    cache[key] = value
