"""One-line progress notes for long steps (feature extraction, report figures, the audit).

Notes go to stderr, so ``--json`` output on stdout stays clean; they are on while a command
shows progress (``with progress_notes(True):``) and silent otherwise (tests, sweep workers).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

_enabled = False


@contextlib.contextmanager
def progress_notes(enabled: bool) -> Iterator[None]:
    """Turn the notes on (or off) for the duration of a block."""
    global _enabled
    before, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = before


def note(message: str) -> None:
    """Print ``message`` to stderr when notes are on."""
    if _enabled:
        print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def step(what: str, items: int | None = None, unit: str = "items") -> Iterator[None]:
    """``what ...`` before a long step, ``what: done in T s (R unit/s)`` after it."""
    note(f"{what} ...")
    t0 = time.perf_counter()
    yield
    wall = time.perf_counter() - t0
    rate = f", {items / wall:.0f} {unit}/s" if items and wall > 0 else ""
    note(f"{what}: done in {wall:.1f} s{rate}")
