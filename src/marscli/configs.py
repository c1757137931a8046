"""Configurations are dataclasses, built by field name.

One config is derived from another where they share names (`GenerationOptions` →
`SamplingParams`, `PlanConfig` → `memory.Options`), so nothing is copied field by field. (A
command builds its configs from their options: options.py.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def from_names(cls: type[T], source: Mapping[str, Any] | Any, **overrides: Any) -> T:
    """A `cls` (a dataclass) from the values of `source` (a mapping, or an object's attributes)
    whose names are fields of `cls`; the other fields keep their defaults; `overrides` win."""
    values = source if isinstance(source, Mapping) else vars(source)
    names = {f.name for f in fields(cls) if f.init}  # type: ignore[arg-type]
    return cls(**{**{k: v for k, v in values.items() if k in names}, **overrides})
