"""Per-round training time vs the checkpoint step at M clients (docs/performance.md,
"Checkpoints at 1000 clients"): ``run_experiment`` with
benchmarks/bench_m1000.py's set-up, checkpoints every round; times Simulation.run_round and
RunSession.on_round (the checkpoint step) separately; prints one JSON line.

    python benchmarks/bench_checkpoint.py [CLIENTS_PER_DOMAIN=250] [ROUNDS=5] [OUT=tmp folder]
"""

import json
import sys
import tempfile
import time

sys.path.insert(0, "benchmarks")
from bench_m1000 import M1000_OVERRIDES

from protofl.config import ExperimentConfig
from protofl.engine import runner, simulation

args = sys.argv[1:]
per_domain = int(args[0]) if args else 250
rounds = int(args[1]) if len(args) > 1 else 5
out = args[2] if len(args) > 2 else tempfile.mkdtemp()
cfg = ExperimentConfig().with_overrides(
    [
        o
        for o in M1000_OVERRIDES
        if not o.startswith(
            ("data.clients_per_domain", "federation.checkpoint", "federation.rounds")
        )
    ]
    + [
        f"data.clients_per_domain={per_domain}",
        f"federation.rounds={rounds}",
        "federation.checkpoint=true",
        "run.save_releases=false",
    ]
)
times = {"round_s": [], "on_round_s": []}
orig_round, orig_on = simulation.Simulation.run_round, runner.RunSession.on_round


def run_round(self):
    t = time.perf_counter()
    r = orig_round(self)
    times["round_s"].append(time.perf_counter() - t)
    return r


def on_round(self, m):
    t = time.perf_counter()
    orig_on(self, m)
    times["on_round_s"].append(time.perf_counter() - t)


simulation.Simulation.run_round, runner.RunSession.on_round = run_round, on_round
orig_finish = runner.RunSession.finish


def finish(self, h):
    t = time.perf_counter()
    r = orig_finish(self, h)
    times["finish_s"] = time.perf_counter() - t
    return r


runner.RunSession.finish = finish
t = time.perf_counter()
res = runner.run_experiment(cfg, out=out, progress=False)
times["run_s"] = time.perf_counter() - t
times["setup_s"] = res.summary["setup_s"]
times["checkpoint_files"] = sorted(p.name for p in res.run_dir.glob("checkpoint-*.pt"))
times["checkpoint_bytes"] = sum(p.stat().st_size for p in res.run_dir.glob("checkpoint-*.pt"))
times["avg_acc"] = res.summary["avg_acc"]
print(json.dumps(times))
