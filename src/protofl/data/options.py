"""Validation of data-set options (``data.options``): each check names the data set, the option
and what it allows, in one line."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def check_options(dataset: str, options: Mapping[str, Any], allowed: Mapping[str, str]) -> None:
    """Reject options the loader does not know, listing the allowed ones."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        listing = "\n".join(f"  {k}: {v}" for k, v in sorted(allowed.items()))
        raise ValueError(
            f"data set {dataset!r} got unknown option(s) {', '.join(map(repr, unknown))}; "
            f"allowed options:\n{listing}"
        )


def option_image_size(dataset: str, value: Any, default: int | None) -> int | None:
    """Validate ``image_size`` (a positive int or None -> ``default``)."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or int(value) < 1:
        raise ValueError(f"data set {dataset!r}: image_size must be a positive int, got {value!r}")
    return int(value)


def option_bool(dataset: str, name: str, value: Any) -> bool:
    """Validate a boolean option."""
    if not isinstance(value, bool | np.bool_):
        raise ValueError(
            f"data set {dataset!r}: option {name} must be true or false, got {value!r}"
        )
    return bool(value)


def option_protocol(dataset: str, value: Any, available: Sequence[str]) -> str | None:
    """Validate ``protocol`` against the ones this data set supports (None = its default)."""
    if value is None:
        return None
    if value not in available:
        raise ValueError(
            f"data set {dataset!r}: unknown protocol {value!r}; valid protocols: "
            + ", ".join(available)
        )
    return str(value)


def option_domains(dataset: str, value: Any, valid: Sequence[str]) -> tuple[str, ...]:
    """Validate the ``domains`` option (None = all, in the benchmark's order)."""
    if value is None:
        return tuple(valid)
    names = [value] if isinstance(value, str) else list(value)
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise ValueError(
            f"data set {dataset!r}: unknown domain(s) {bad or names!r}; domains: "
            + ", ".join(valid)
        )
    return tuple(n for n in valid if n in names)


def option_holdout(dataset: str, value: Any, valid: Sequence[str]) -> str | None:
    """Validate ``holdout_domain``."""
    if value is None:
        return None
    if value not in valid:
        raise ValueError(
            f"data set {dataset!r}: holdout_domain {value!r} is not a loaded domain; domains: "
            + ", ".join(valid)
        )
    return str(value)


def option_int(dataset: str, name: str, value: Any, default: int) -> int:
    """Validate an int option."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"data set {dataset!r}: option {name} must be an int, got {value!r}")
    return int(value)
