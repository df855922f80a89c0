"""Freed heap memory handed back to the operating system by a process that serves many clients
one message at a time (a Flower process simulating thousands of nodes).

glibc's ``malloc`` raises its mmap threshold to the size of the largest block freed so far (up
to 32 MiB). From then on, blocks of a few MB (``torch.save`` buffers, a client's unpacked
tensors) come from the heap, and ``free`` gives back only the top of the heap. Small objects
that outlive a message (each served client's ledger, generator state, counters) sit between
those blocks, so the freed memory stays resident, and it grows with the number of clients the
process has served, not with what is live. Measured on the 10,000-client Flower benchmark
(``benchmarks/bench_flower.py --scale m10000``): 6.9-8.4 GB peak resident against 1.4 GB live.

:class:`HeapTrim` calls ``malloc_trim(0)``, which returns every whole free page of the heap,
only when the resident set has grown by ``slack`` bytes since the last trim. One trim costs
about a millisecond, so trimming after every message would cost more than it saves. Off glibc
it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
import threading
from collections.abc import Callable

DEFAULT_SLACK = 256 << 20
"""Growth of the resident set (bytes) since the last trim that triggers the next one."""


def resident_bytes() -> int | None:
    """This process's resident set size (``/proc/self/statm``); None where there is none."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``; None elsewhere."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # pragma: no cover - glibc always has it
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return lambda: fn(0)


class HeapTrim:
    """Call after each message: trims the heap (``malloc_trim(0)``) when the resident set
    grew by more than ``slack`` bytes over its base: the lowest resident set seen since the
    last trim (or the first call), or the one right after that trim. Live memory that grows
    costs one trim per ``slack`` of growth."""

    def __init__(
        self,
        slack: int = DEFAULT_SLACK,
        rss: Callable[[], int | None] = resident_bytes,
        trim: Callable[[], object] | None = None,
    ) -> None:
        self.slack = slack
        self._rss = rss
        self._trim = trim if trim is not None else _malloc_trim()
        self._base: int | None = None
        self._lock = threading.Lock()
        self.trims = 0

    def __call__(self) -> bool:
        """Trim if due; whether it did."""
        if self._trim is None:
            return False
        with self._lock:
            now = self._rss()
            if now is None:
                return False
            if self._base is None or now < self._base:  # growth counts from the lowest point
                self._base = now
                return False
            if now <= self._base + self.slack:
                return False
            self._trim()
            self.trims += 1
            self._base = self._rss() or now
            return True
