"""The Flower engine against the in-process simulator on the same configuration.

``bench_m1000.py``'s configuration (digits4 at 64 px, Dirichlet split, FedProto + VPDR, a frozen
projection) at M clients (default 100), run twice, each in its own process (its own peak RSS):
with Flower's ServerApp and ClientApps over the in-process grid (``InlineGrid``: every message
through Flower's wire serialisation, every client's state packed into its ``Context`` after
each message, as on a SuperNode), and with the in-process engine, sequentially (the same
per-client code).  Both runs train and evaluate the same clients the same way, so their
per-round accuracies agree; the ratio of their mean round times is the Flower engine's
overhead.  Prints one JSON line.

``--run-folder``: the Flower run writes a run folder (in a temporary folder, removed after),
as ``protofl run --engine flower --out`` does: the server's checkpoints and each node's state
file beside its Context.

Usage: python benchmarks/bench_flower.py [--clients 100] [--rounds 5] [--set KEY=VALUE ...]
                                         [--run-folder]
       python benchmarks/bench_flower.py --scale m10000 --rounds 5   # 10,000 clients
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def config(clients: int, rounds: int, extra: list[str], scale: str | None = None) -> Any:
    """``bench_m1000.py``'s configuration at ``clients`` clients, sequential; with ``scale``
    (``m10000``) that benchmark's own configuration (batched, state on disk) instead."""
    from bench_m1000 import M1000_OVERRIDES, SCALES

    from protofl.config import ExperimentConfig

    if scale is not None:
        overrides = [o for o in SCALES[scale] if not o.startswith("federation.rounds")]
        overrides += [f"federation.rounds={rounds}", *extra]
    else:
        dropped = ("data.clients_per_domain", "federation.rounds", "federation.execution")
        overrides = [o for o in M1000_OVERRIDES if not o.startswith(dropped)]
        overrides += [
            f"data.clients_per_domain={clients // 4}",
            f"federation.rounds={rounds}",
            "federation.execution=sequential",
            *extra,
        ]
    return ExperimentConfig.from_dict({"name": "bench-flower"}).with_overrides(overrides)


def one(
    engine: str,
    clients: int,
    rounds: int,
    extra: list[str],
    scale: str | None = None,
    run_folder: bool = False,
) -> dict[str, Any]:
    """One run of ``engine`` (``flower`` or ``sim``) in this process (``run_folder``: the
    Flower run writes one, in a temporary folder)."""
    import tempfile

    import torch
    from bench_m1000 import peak_rss_gb

    from protofl.data.cache import protofl_home
    from protofl.engine.federated_data import build_federated_data
    from protofl.engine.simulation import Simulation

    torch.set_num_threads(1)
    cfg = config(clients, rounds, extra, scale)
    # features cached before the clock starts
    clients = len(build_federated_data(cfg, protofl_home()).clients)
    t0 = time.perf_counter()
    if engine == "flower":
        from protofl.engine.flower.run import run_flower_simulation

        with tempfile.TemporaryDirectory(prefix="bench-flower-") as out:
            history = run_flower_simulation(
                cfg, home=protofl_home(), backend="inline", out=Path(out) if run_folder else None
            ).history
    else:
        history = Simulation(cfg, build_federated_data(cfg, protofl_home())).run()
    return {
        "engine": engine,
        "clients": clients,
        "wall_s": time.perf_counter() - t0,
        "rounds_s": [m.wall_s for m in history],
        "avg_acc": [m.avg_acc for m in history],
        "peak_rss_gb": peak_rss_gb(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--scale",
        choices=("m10000",),
        help="bench_m1000.py --scale's configuration instead (10,000 clients, 10%% "
        "participation, evaluation every 5th round on a subsample, run.client_state=disk; "
        "--clients is ignored)",
    )
    parser.add_argument(
        "--run-folder",
        action="store_true",
        help="the Flower run writes a run folder (checkpoints, node files), as protofl run does",
    )
    parser.add_argument("--engine", choices=("flower", "sim"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:  # a child: one run
        result = one(args.engine, args.clients, args.rounds, args.set, args.scale, args.run_folder)
        print(json.dumps(result))
        return
    runs: dict[str, dict[str, Any]] = {}
    for engine in ("flower", "sim"):
        cmd = [sys.executable, __file__, "--engine", engine, "--clients", str(args.clients)]
        cmd += ["--rounds", str(args.rounds), *(a for s in args.set for a in ("--set", s))]
        cmd += ["--scale", args.scale] if args.scale else []
        cmd += ["--run-folder"] if args.run_folder else []
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        runs[engine] = json.loads(out.stdout.strip().splitlines()[-1])
    flower, sim = runs["flower"], runs["sim"]
    if flower["avg_acc"] != sim["avg_acc"]:
        raise SystemExit(f"the engines disagree: {flower['avg_acc']} != {sim['avg_acc']}")
    round_f, round_s = statistics.mean(flower["rounds_s"]), statistics.mean(sim["rounds_s"])
    result = {
        "clients": sim["clients"],
        "scale": args.scale,
        "run_folder": args.run_folder,
        "rounds": args.rounds,
        "flower": flower,
        "sim": sim,
        "flower_round_s": round_f,
        "sim_round_s": round_s,
        "flower_over_sim_round": round_f / round_s,
        "flower_over_sim_peak_rss": flower["peak_rss_gb"] / sim["peak_rss_gb"],
        "final_acc": sim["avg_acc"][-1],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
