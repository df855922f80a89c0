"""Where one round of batched training goes: the M = 100 set-up of ``bench_suite.py``'s
``train`` section (digits4 at 32 px, Dirichlet split, FedProto with global prototypes, one
thread), its round time (median of 5) beside the two floors of ``roofline``, and a torch
profiler table of one round (self CPU time per operator).

Usage: python benchmarks/profile_train.py [--clients 100] [--frozen] [--rows 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_suite import FROZEN, config, data_for, roofline, train_overrides
from engine_hooks import HookedSimulation

from protofl.engine.batched import BatchedTrainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--rows", type=int, default=20, help="rows of the profiler table")
    parser.add_argument(
        "--frozen", action="store_true", help="a frozen shared projection (the M = 1000 row)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = FROZEN if args.frozen else []
    extra = train_overrides(args.clients, model)
    sim = HookedSimulation(config(*extra, "federation.execution=batched"), data_for(config(*extra)))
    sim.global_state = sim.method.aggregate(sim.collect_uploads(), 0)
    trainer = BatchedTrainer(sim)
    trainer.train(sim.clients)  # warm-up: adopts the clients into the stacked storage
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        trainer.train(sim.clients)
        times.append(time.perf_counter() - t0)
    roof = roofline(args.clients, model)
    print(
        f"batched round {statistics.median(times):.3f} s (min {min(times):.3f}); floor "
        f"{roof['floor_s_1thread']:.3f} s (projection rate {roof['bmm_gflops_1thread']:.0f} "
        f"GFLOP/s), {roof['floor_shapes_s_1thread']:.3f} s (each product at its shape's rate)"
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.train(sim.clients)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
