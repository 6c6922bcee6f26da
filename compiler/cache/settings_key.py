"""The compile cache's view of a settings dataclass, derived from its fields.

Note [Settings in the cache key]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A setting that changes what is compiled must be part of the compile cache's key, or a
run with another value is served the compiles of the first. A list kept by hand forgets
the next new setting, so the key is every field of the settings dataclass except those
declared with :func:`not_compiled` (where the dataclass says why the field changes
nothing compiled: how long to wait, where to keep the cache, whether to check plans).
A new field is in the key unless its author says otherwise: at worst a needless miss,
never a stale compile. Nested settings dataclasses are read the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["not_compiled", "cache_settings"]

_NOT_COMPILED = "distcompile_not_compiled"


def not_compiled(default: Any = dataclasses.MISSING, *, why: str, **kw: Any) -> Any:
    """A dataclass field that changes nothing compiled, kept out of the cache key; ``why``
    is required so that the reason stays next to the field."""
    if not why:
        raise ValueError("not_compiled(why=...): say why the field changes nothing compiled")
    return dataclasses.field(default=default, metadata={_NOT_COMPILED: why}, **kw)


def cache_settings(config: Any) -> dict[str, Any]:
    """Every field of the settings dataclass ``config`` but those declared
    :func:`not_compiled`, as plain values (Note [Settings in the cache key])."""
    return {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config)
            if _NOT_COMPILED not in f.metadata}


def _plain(value: Any) -> Any:
    """A value the cache key can hash the same way in every run: callables by qualified name
    (not their address), nested settings dataclasses by their compiled fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__qualname__, **cache_settings(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if callable(value):
        return getattr(value, "__qualname__", type(value).__qualname__)
    return repr(value)
