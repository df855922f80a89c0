"""One round of a paper's protocol (``preset: vpdr`` by default): the round, upload and
training times of three rounds after a warm-up round (batched executor unless ``--execution
sequential``, one thread) and a torch profiler table of a fourth.

Usage: python benchmarks/profile_preset.py [--preset vpdr] [--mechanism vpdr]
       [--execution batched|sequential] [--rows 18]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_hooks import HookedSimulation

from protofl.config import ExperimentConfig
from protofl.data.cache import protofl_home
from protofl.engine.federated_data import build_federated_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="vpdr")
    parser.add_argument("--mechanism", default="vpdr")
    parser.add_argument("--execution", choices=["batched", "sequential"], default="batched")
    parser.add_argument("--rows", type=int, default=18, help="rows of the profiler table")
    args = parser.parse_args()
    cfg = ExperimentConfig.from_dict(
        {
            "preset": args.preset,
            "privacy": {"mechanism": args.mechanism},
            "federation": {"execution": args.execution, "checkpoint": False},
            "run": {"progress": False},
        }
    )
    torch.set_num_threads(1)
    sim = HookedSimulation(cfg, build_federated_data(cfg, protofl_home()))
    print("clients' training samples", [c.data.num_train for c in sim.clients])
    sim.run_round()  # warm-up
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        sim.run_round()
        times.append(time.perf_counter() - t0)
    fmt = ", ".join
    print(
        f"round s {fmt(f'{t:.2f}' for t in times)}; upload s "
        f"{fmt(f'{t:.2f}' for t in sim.upload_s[-3:])}; training s "
        f"{fmt(f'{t:.2f}' for t in sim.train_s[-3:])}"
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sim.run_round()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
