"""Load and faults on a loopback Flower deployment (docs/distributed.md, "Load and faults").

    python experiments/flower_load_faults.py [--nodes 20] [--rounds 4] [--workdir DIR]

Starts a SuperLink and one SuperNode per client (each with a node-local state folder), runs the
experiment through ``flwr run``, and meanwhile: after round 1 starts a hostile SuperNode that
claims partition 0 (held by a live honest node; in the default authenticated deployment its key
is registered but bound to no partition); during round 2 kills SuperNode 5 (SIGTERM to its
process group) and starts it again with the same partition, key and state folder.  Then checks
that the run completed, that every rejection is in the record, that the hostile node never took
part, and that no honest client's ledger was reset (each node-local state file holds one ledger
entry per release the client made).  Prints a JSON summary (the figures in docs/distributed.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from protofl.config import ExperimentConfig
from protofl.engine.flower.app import write_flower_app
from protofl.engine.flower.client_app import load_node_state
from protofl.engine.flower.deploy import LoopbackDeployment, group_alive


def experiment(nodes: int, rounds: int) -> ExperimentConfig:
    """``nodes`` clients of the generated toy set (4 domains), FedProto with IGPP."""
    if nodes % 4:
        raise SystemExit("--nodes must be a multiple of 4 (the toy set has 4 domains)")
    return ExperimentConfig.from_dict(
        {
            "name": "load-faults",
            "data": {"name": "toy", "clients_per_domain": nodes // 4, "train_fraction": 1.0},
            "backbone": {
                "name": "pixels",
                "image_size": 16,
                "proto_dim": 32,
                "adapter_hidden": 8,
                "feature_cache": False,
            },
            "federation": {"rounds": rounds, "local_epochs": 1, "batch_size": 32},
            "method": {"name": "fedproto"},
            "privacy": {"mechanism": "igpp", "epsilon": 4.0, "clip": 1.0},
            "run": {"progress": False, "save_releases": False},
        }
    )


def rounds_done(runs: Path) -> int:
    files = list(runs.glob("*/metrics.jsonl"))
    return len(files[0].read_text().splitlines()) if files else 0


def wait_for(cond: object, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.5)
    raise TimeoutError(what)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nodes", type=int, default=20)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--round-timeout", type=float, default=90.0)
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="protofl-load-")).absolute()
    config = experiment(args.nodes, args.rounds)
    runs, state = work / "runs", work / "state"
    app = write_flower_app(
        work / "app",
        config,
        out_dir=runs,
        round_timeout=args.round_timeout,
        wait_timeout=600.0,
        num_supernodes=args.nodes,
    )
    dep = LoopbackDeployment(work / "deploy", args.nodes, node_config={"state-dir": str(state)})
    t0 = time.perf_counter()
    kills = 0
    with dep:
        proc = dep.start_run(app)
        alive = lambda: proc.poll() is None  # noqa: E731
        wait_for(lambda: rounds_done(runs) >= 1 or not alive(), 1800, "round 1")
        dep.start_node("hostile", 0)  # claims a partition a live honest node holds
        time.sleep(5)  # round 2 is under way
        victim = min(5, args.nodes - 1)
        dep.stop_node(victim)
        kills += 1
        time.sleep(2)
        dep.start_node(f"supernode-{victim}", victim)  # the same silo is back, same state
        code = proc.wait(timeout=3600)
        wall = time.perf_counter() - t0
        if code != 0:
            print(dep.logs(), file=sys.stderr)
            return 1
    left = [pid for pr in dep.procs for pid in group_alive(pr.pid)]
    summaries = list(runs.glob("*/summary.json"))
    if len(summaries) != 1:
        # ``flwr run`` exits 0 even when the ServerApp failed: say so, with its last lines
        log = work / "deploy" / "flwr-run.log"
        tail = log.read_text().splitlines()[-12:] if log.is_file() else []
        print(f"the run did not finish (no summary.json under {runs}):", file=sys.stderr)
        print("\n".join(tail), file=sys.stderr)
        return 1
    (summary_file,) = summaries
    summary = json.loads(summary_file.read_text())
    history = [json.loads(s) for s in next(runs.glob("*/metrics.jsonl")).read_text().splitlines()]
    ledgers = {}
    for f in sorted(state.glob("protofl-client-*.pt")):
        entries = load_node_state(f)["ledger"]["entries"]  # type: ignore[index]
        ledgers[f.name.split("-")[2]] = [e["round"] for e in entries]
    rejected = [r for h in history for r in h["rejected"]]
    out = {
        "nodes": args.nodes,
        "rounds": summary["rounds"],
        "kills": kills,
        "restarts": kills,
        "hostile_nodes": 1,
        "wall_s": round(wall, 1),
        "participants_per_round": [len(h["participants"]) for h in history],
        "rejected": rejected,
        "rebinds": summary.get("rebinds", []),
        "hostile_refused": any(
            r["phase"] == "hello" and "claims partition 0" in r["reason"] for r in rejected
        ),
        "ledger_rounds_per_client": ledgers,
        "epsilon_spent_max": max(v for v in summary["privacy"]["epsilon_spent"].values() if v),
        "avg_acc": summary["avg_acc"],
        "processes_left": left,
    }
    print(json.dumps(out, indent=1))
    ok = (
        summary["rounds"] == args.rounds
        and out["hostile_refused"]
        and not left
        and all(r == sorted(set(r)) for r in ledgers.values())
    )
    return 0 if ok else 1


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
