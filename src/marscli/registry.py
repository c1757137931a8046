"""A named registry for the things users swap: tools, engines, estimators, losses, backends,
judges. One signature per registry; lookup errors list the valid names."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

from marscli.errors import unknown_name

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, lazy: dict[str, str] | None = None) -> None:
        """`lazy` maps names to the module that registers them, imported on first lookup, so
        that heavy backends (torch, vLLM) load only when chosen."""
        self.kind = kind
        self._items: dict[str, T] = {}
        self._lazy = dict(lazy or {})

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        if name not in self._items and name in self._lazy:
            importlib.import_module(self._lazy[name])
        try:
            return self._items[name]
        except KeyError:
            raise unknown_name(self.kind, name, self.names()) from None

    def names(self) -> list[str]:
        return sorted(set(self._items) | set(self._lazy))

    def __contains__(self, name: str) -> bool:
        return name in self._items or name in self._lazy
