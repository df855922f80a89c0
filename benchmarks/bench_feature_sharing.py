"""Two processes (as two sweep workers) build the same digits4 federation and read all its cached
features; each one's resident and proportional memory shows whether they hold one copy.

Usage: python benchmarks/bench_feature_sharing.py [--set KEY=VALUE ...]  (one JSON line per
feature dtype: the features' size, and per process Rss, Pss, Shared_Clean and Private_Dirty
from /proc/<pid>/smaps_rollup, in MB).  Linux only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

WORKER = """
import sys, time
from protofl.config import ExperimentConfig
from protofl.data.cache import protofl_home
from protofl.engine.federated_data import build_federated_data
data = build_federated_data(ExperimentConfig().with_overrides(sys.argv[1:]), protofl_home())
tests = {id(c.test_z): c.test_z for c in data.clients}
size = sum(c.train_z.numel() * c.train_z.element_size() for c in data.clients)
size += sum(t.numel() * t.element_size() for t in tests.values())
touched = sum(float(c.train_z.sum()) for c in data.clients)  # every page read
touched += sum(float(t.sum()) for t in tests.values())
print(size, flush=True)
time.sleep(600)
"""


def smaps(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss", "Shared_Clean", "Private_Dirty"):
            out[key] = int(rest.split()[0]) / 1024
    return out


def measure(overrides: list[str]) -> dict[str, object]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, *overrides], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        sizes = [int(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
        time.sleep(0.5)
        return {
            "overrides": overrides,
            "feature_mb": sizes[0] / 2**20,
            "processes": [smaps(p.pid) for p in procs],
        }
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    for dtype in ("float32", "float16"):
        print(json.dumps(measure([*args.set, f"backbone.feature_dtype={dtype}"])), flush=True)


if __name__ == "__main__":
    main()
