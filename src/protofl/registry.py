"""One small registry type, used for data sets, backbones, methods, mechanisms and attacks."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


def nearest(name: str, choices: list[str]) -> str:
    """Return a ' (did you mean X?)' hint for a mistyped name, or an empty string."""
    match = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


class Registry(Generic[T]):
    """A name -> object mapping that refuses duplicates and explains unknown names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, *, force: bool = False) -> Callable[[T], T]:
        """Decorator that registers an object under ``name``."""

        def decorator(obj: T) -> T:
            self.add(name, obj, force=force)
            return obj

        return decorator

    def add(self, name: str, obj: T, *, force: bool = False) -> None:
        """Register ``obj`` under ``name``; raises on a duplicate unless ``force``."""
        if name in self._items and not force:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj

    def get(self, name: str) -> T:
        """Look ``name`` up, failing with the list of valid names."""
        try:
            return self._items[name]
        except KeyError:
            valid = sorted(self._items)
            raise ValueError(
                f"unknown {self.kind} {name!r}{nearest(name, valid)}; valid {self.kind}s: "
                + ", ".join(valid)
            ) from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
