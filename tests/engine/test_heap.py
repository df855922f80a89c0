"""protofl.engine.heap: freed heap memory handed back by a process serving many clients."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from protofl.engine.heap import HeapTrim, resident_bytes

MB = 1 << 20


def test_a_heap_trim_trims_only_after_its_slack_of_growth_and_moves_its_base() -> None:
    rss = iter([100, 150, 400, 120, 300, 420, 500, 300, 450, 520, 80])
    trims: list[int] = []
    heap = HeapTrim(slack=200, rss=lambda: next(rss), trim=lambda: trims.append(1))
    # 100: the base; 150: within it; 400: trims, and 120 after it is the new base; 300: within
    # it; 420: trims, 500 after it (live memory grew); 300: the new, lower base; 450: within
    # it; 520: trims (80 after it)
    assert [heap() for _ in range(8)] == [False, False, True, False, True, False, False, True]
    assert heap.trims == 3 == len(trims)
    assert HeapTrim(rss=lambda: None, trim=lambda: None)() is False  # no /proc: nothing


FRAGMENTED = """
import json
from protofl.engine.heap import HeapTrim, resident_bytes
MB = 1 << 20
big = bytearray(16 * MB); del big  # a freed mapped block: blocks up to 16 MB come from the heap
heap = HeapTrim(slack=64 * MB)
heap()  # the base
rss0 = resident_bytes()
blocks, pins = [], []
for _ in range(300):  # a client's buffers, each followed by something small that stays
    b = bytearray(MB)
    b[::4096] = b"\\x01" * len(range(0, MB, 4096))
    blocks.append(b)
    pins.append(bytes(1000) + b"x")
del blocks
rss1 = resident_bytes()
trimmed = heap()
print(json.dumps({"rss0": rss0, "rss1": rss1, "rss2": resident_bytes(), "trimmed": trimmed}))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="malloc_trim is glibc's",
)
def test_freed_buffers_pinned_by_small_live_objects_stay_resident_until_the_heap_is_trimmed() -> (
    None
):
    """In a fresh process (the pattern changes malloc's thresholds): 300 freed 1 MB buffers,
    each followed on the heap by a small object still alive, stay resident; the trim hands
    them back."""
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENTED], check=True, capture_output=True, text=True
    )
    got = json.loads(out.stdout)
    assert got["rss1"] - got["rss0"] > 250 * MB  # freed, yet resident
    assert got["trimmed"]
    assert got["rss1"] - got["rss2"] > 250 * MB  # handed back
    assert resident_bytes() is not None
