"""A fused sweep of 3 seeds x 2 mechanisms (IGPP, VPDR) against running its 6 runs one by one.

One invocation, one JSON line: the wall time of one run alone (a one-point sweep, for each
mechanism), of the 6-run sweep with ``fuse: false`` (every run its own worker process, ``jobs``
at a time, as ``protofl sweep --no-fuse``) and with fusion on (the default: IGPP's 3 runs are
one fused group, VPDR's 3 another, since VPDR trains with DCR and IGPP does not), the ratios,
and every run's final accuracy in both modes (they agree to float rounding).

The configuration is the default one (digits4 at 64 px, 4 clients, FedProto; its 1280 -> 512
projection trains) or, with ``--preset vpdr``, VPDR's protocol (``preset: vpdr``: 10% of each
digits4 domain, one client per domain, a frozen projection, an MLP head, 2 local epochs of
batches of 256), with ``federation.execution=batched`` and ``federation.rounds`` (``--rounds``,
default 5).  The
features of every seed are cached before anything is timed (each seed draws its own training
subsample, whose features are extracted once), so all three timings read the same cache.  All
timings are in this process's clock, after imports: process start-up is in the separate sweep
(its workers) but not in the one-run figure.

Every timing is repeated ``--repeat`` times (default 2), interleaved, and the least is reported
(with all of them): the machine may be shared.

The same comparison is also timed as a user meets it, whole commands in their own processes
(``cli_*``): ``protofl run`` of one point (IGPP and VPDR) against ``protofl sweep`` of the
6-point grid (fused, ``--jobs``), each from interpreter start to exit.

Usage: python benchmarks/bench_fused.py [--rounds 5] [--jobs N] [--repeat 2] [--preset vpdr]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from protofl.config import ExperimentConfig
from protofl.data.cache import protofl_home
from protofl.engine.federated_data import build_federated_data
from protofl.sweeps import plan_sweep, run_sweep

SEEDS = [0, 1, 2]
MECHANISMS = ["igpp", "vpdr"]


PRESET: str | None = None  # --preset


def base(rounds: int) -> dict[str, Any]:
    """The default config (or :data:`PRESET`'s), batched, ``rounds`` rounds, no progress
    bars."""
    start = ExperimentConfig.from_dict({"preset": PRESET}) if PRESET else ExperimentConfig()
    cfg = start.with_overrides(
        [
            "federation.execution=batched",
            f"federation.rounds={rounds}",
            "run.progress=false",
        ]
    )
    return cfg.to_dict()


def timed_sweep(
    name: str, grid: dict[str, list[Any]], rounds: int, out: Path, jobs: int, fuse: bool
) -> tuple[float, dict[str, float], list[float]]:
    """(wall seconds, final AVG per run folder, mean round wall_s per run) of one sweep."""
    plan = plan_sweep({"name": name, "base": base(rounds), "grid": grid})
    t0 = time.perf_counter()
    result = run_sweep(plan, sweep_dir=out / name, jobs=jobs, progress=False, fuse=fuse)
    wall = time.perf_counter() - t0
    failed = [r.dir for r in result.runs if r.status != "done"]
    if failed:
        raise SystemExit(f"{name}: runs failed: {failed}")
    acc = {r.dir: float(r.avg_acc or 0.0) for r in result.runs}
    rounds_s = []
    for r in result.runs:
        lines = (out / name / r.dir / "metrics.jsonl").read_text().splitlines()
        rounds_s.append(sum(json.loads(x)["wall_s"] for x in lines) / len(lines))
    return wall, acc, rounds_s


def protofl_command() -> list[str]:
    """The ``protofl`` command of this interpreter's environment."""
    exe = shutil.which("protofl", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "protofl.cli"]


def cli_wall(args: list[str]) -> float:
    """Seconds of one whole ``protofl`` command, from process start to exit."""
    t0 = time.perf_counter()
    subprocess.run([*protofl_command(), *args], check=True, capture_output=True, text=True)
    return time.perf_counter() - t0


def cli_walls(rounds: int, jobs: int, out: Path) -> dict[str, float]:
    """Whole-command wall seconds: ``protofl run`` of each mechanism and ``protofl sweep`` of
    the 6-point grid (fused), both from the same config (:func:`base`)."""
    config = out / "config.yaml"
    config.write_text(json.dumps(base(rounds)))  # JSON is YAML
    walls = {}
    for mech in MECHANISMS:
        walls[f"cli-one-{mech}"] = cli_wall(
            ["run", str(config), "--quiet", "--out", str(out / f"one-{mech}"),
             "--set", f"privacy.mechanism={mech}"]
        )  # fmt: skip
    sweep = out / "sweep.yaml"
    sweep.write_text(
        json.dumps(
            {
                "name": "fused-cli",
                "base": base(rounds),
                "grid": {"seed": SEEDS, "privacy.mechanism": MECHANISMS},
            }
        )
    )
    walls["cli-fused"] = cli_wall(
        ["sweep", str(sweep), "--jobs", str(jobs), "--out", str(out / "fused-cli"),
         "--quiet", "--no-table"]
    )  # fmt: skip
    return walls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeat", type=int, default=2, help="interleaved repetitions")
    parser.add_argument("--preset", choices=["vpdr"], help="a paper's protocol (default: none)")
    args = parser.parse_args()
    global PRESET
    PRESET = args.preset
    home = protofl_home()
    for seed in SEEDS:  # extract (or find) every seed's features before timing anything
        build_federated_data(ExperimentConfig.from_dict({**base(args.rounds), "seed": seed}), home)
    load_before = os.getloadavg()
    grid = {"seed": SEEDS, "privacy.mechanism": MECHANISMS}
    # the machine may be shared: every timing is repeated, interleaved, and the least is kept
    walls: dict[str, list[float]] = {}
    one_round: dict[str, float] = {}
    sep_acc: dict[str, float] = {}
    fused_acc: dict[str, float] = {}
    fused_rounds: list[float] = []
    for rep in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            for mech in MECHANISMS:
                wall, _, rs = timed_sweep(
                    f"one-{mech}", {"privacy.mechanism": [mech]}, args.rounds, out, 1, False
                )
                walls.setdefault(f"one-{mech}", []).append(wall)
                one_round[mech] = min(one_round.get(mech, rs[0]), rs[0])
            wall, sep_acc, _ = timed_sweep("separate", grid, args.rounds, out, args.jobs, False)
            walls.setdefault("separate", []).append(wall)
            wall, fused_acc, rs = timed_sweep("fused", grid, args.rounds, out, args.jobs, True)
            walls.setdefault("fused", []).append(wall)
            if rep == 0 or wall <= min(walls["fused"]):
                fused_rounds = rs
            for name, wall in cli_walls(args.rounds, args.jobs, out).items():
                walls.setdefault(name, []).append(wall)
    best = {k: min(v) for k, v in walls.items()}
    one = {mech: best[f"one-{mech}"] for mech in MECHANISMS}
    sep_wall, fused_wall = best["separate"], best["fused"]
    one_run = sum(one.values()) / len(one)
    cli_one = sum(best[f"cli-one-{mech}"] for mech in MECHANISMS) / len(MECHANISMS)
    diff = max(abs(sep_acc[k] - fused_acc[k]) for k in sep_acc)
    print(
        json.dumps(
            {
                "bench": "fused_sweep",
                "config": (
                    "preset vpdr (digits4 10%, 4 clients, frozen projection, fedproto)"
                    if PRESET
                    else "default (digits4 64px, 4 clients, fedproto)"
                )
                + f", batched, {args.rounds} rounds; grid seed={SEEDS} x "
                f"privacy.mechanism={MECHANISMS}",
                "preset": PRESET,
                "jobs": args.jobs,
                "cores": os.cpu_count(),
                "machine": platform.machine(),
                "load_avg_before": [round(x, 2) for x in load_before],
                "load_avg_after": [round(x, 2) for x in os.getloadavg()],
                "repeat": args.repeat,
                "all_walls_s": {k: [round(x, 2) for x in v] for k, v in walls.items()},
                "one_run_s": {k: round(v, 2) for k, v in one.items()},
                "one_run_round_s": {k: round(v, 3) for k, v in one_round.items()},
                "separate_s": round(sep_wall, 2),
                "fused_s": round(fused_wall, 2),
                "fused_round_s": round(sum(fused_rounds) / len(fused_rounds), 3),
                "fused_over_one_run": round(fused_wall / one_run, 2),
                "separate_over_one_run": round(sep_wall / one_run, 2),
                "separate_over_fused": round(sep_wall / fused_wall, 2),
                "cli_one_run_s": {m: round(best[f"cli-one-{m}"], 2) for m in MECHANISMS},
                "cli_fused_s": round(best["cli-fused"], 2),
                "cli_fused_over_one_run": round(best["cli-fused"] / cli_one, 2),
                "avg_acc_separate": {k: round(v, 6) for k, v in sep_acc.items()},
                "avg_acc_fused": {k: round(v, 6) for k, v in fused_acc.items()},
                "max_abs_acc_diff": diff,
            }
        )
    )


if __name__ == "__main__":
    main()
