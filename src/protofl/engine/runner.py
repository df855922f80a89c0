"""Run an experiment end to end and write its run folder (config, metrics, summary, log)."""

from __future__ import annotations

import json
import logging
import platform
import re
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from protofl import __version__
from protofl.attacks.mia import diagnostics_for
from protofl.config import ExperimentConfig
from protofl.data.cache import protofl_home
from protofl.engine.checkpoint import load_latest_checkpoint, save_checkpoint
from protofl.engine.federated_data import FederatedData, build_federated_data, preflight
from protofl.engine.rundir import (
    FolderLock,
    check_resume,
    claim_dir,
    read_record,
    write_record,
)
from protofl.engine.simulation import RoundMetrics, Simulation, summarise

log = logging.getLogger("protofl")


@dataclass
class RunResult:
    """Where a run was written and what it measured."""

    run_dir: Path
    summary: dict[str, Any]
    history: list[RoundMetrics]


def make_run_dir(config: ExperimentConfig, out: str | Path | None) -> Path:
    """``<out>/<time>-<name>/`` (a unique folder, claimed atomically)."""
    root = Path(out) if out is not None else Path(config.run.out_dir)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", config.name).strip("-") or "run"
    return claim_dir(root, f"{stamp}-{safe}")


def start_run_dir(config: ExperimentConfig, run_dir: Path, *, engine: str = "sim") -> None:
    """Write what a new run is: config.yaml (to read) and the run record (to resume against)."""
    (run_dir / "config.yaml").write_text(config.to_yaml())
    write_record(run_dir, config, engine=engine)


def attach_log(run_dir: Path) -> logging.Handler:
    handler = logging.FileHandler(run_dir / "run.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("protofl")
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    return handler


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded with every run."""
    return {
        "protofl": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
    }


def run_experiment(
    config: ExperimentConfig,
    *,
    out: str | Path | None = None,
    home: Path | None = None,
    progress: bool | None = None,
    data: FederatedData | None = None,
) -> RunResult:
    """Build the federation, run every round, and write the run folder."""
    preflight(config)  # a bad name, option or data root fails before any folder exists
    run_dir = make_run_dir(config, out)
    start_run_dir(config, run_dir)
    return _execute(config, run_dir, home=home, progress=progress, data=data, resume=False)


def run_in_dir(
    config: ExperimentConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    home: Path | None = None,
    progress: bool | None = None,
) -> RunResult:
    """Run (or, with ``resume``, continue) an experiment in a given folder (used by sweeps)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume:
        check_resume(run_dir, config)
    if not (run_dir / "config.yaml").exists():
        (run_dir / "config.yaml").write_text(config.to_yaml())
    if read_record(run_dir) is None:
        write_record(run_dir, config)
    return _execute(config, run_dir, home=home, progress=progress, data=None, resume=resume)


def resume_experiment(
    run_dir: str | Path, *, home: Path | None = None, progress: bool | None = None
) -> RunResult:
    """Continue a stopped or killed run from its last complete round."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").exists():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no config.yaml)")
    config = ExperimentConfig.from_yaml(run_dir / "config.yaml")
    check_resume(run_dir, config)  # an edited config.yaml is refused, naming the keys
    return _execute(config, run_dir, home=home, progress=progress, data=None, resume=True)


def _execute(
    config: ExperimentConfig,
    run_dir: Path,
    *,
    home: Path | None,
    progress: bool | None,
    data: FederatedData | None,
    resume: bool,
) -> RunResult:
    lock = FolderLock(run_dir, "run")
    lock.acquire()  # one process at a time in a run folder; released in the finally below
    threads_before = torch.get_num_threads()
    if config.run.threads is not None:
        torch.set_num_threads(config.run.threads)
    handler = attach_log(run_dir)
    show = config.run.progress if progress is None else progress
    tensorboard: Any = None
    try:
        t0 = time.perf_counter()
        home = home or protofl_home()
        if data is None:
            from protofl.report.progress import progress_notes

            with progress_notes(show):  # feature extraction on a fresh cache takes minutes
                data = build_federated_data(config, home)
        setup_s = time.perf_counter() - t0
        log.info("data ready in %.1fs: %d clients", setup_s, len(data.clients))
        if config.run.threads is None:
            # the trainable part is tiny: one intra-op thread avoids oversubscription (measured
            # 10x faster per step on a loaded 2-core machine); extraction above used them all
            torch.set_num_threads(1)
        sim = Simulation(config, data, upload_hooks=diagnostics_for(config))
        metrics_path = run_dir / "metrics.jsonl"
        if resume:
            state = load_latest_checkpoint(run_dir)
            if state is not None:
                sim.load_state_dict(state)
            log.info("resuming %s after round %d", run_dir, sim.round)
            # metrics.jsonl may hold a round written after the last checkpoint: rewrite it
            metrics_path.write_text("".join(json.dumps(m.to_json()) + "\n" for m in sim.history))
        else:
            metrics_path.write_text("")

        if config.run.tensorboard:
            from protofl.report.tensorboard import TensorBoardLogger

            tensorboard = TensorBoardLogger(run_dir)

        def on_round(m: RoundMetrics) -> None:
            if tensorboard is not None:
                tensorboard.log_round(m)
            with open(metrics_path, "a") as fh:
                fh.write(json.dumps(m.to_json()) + "\n")
            fed = config.federation
            if fed.checkpoint and (m.round % fed.checkpoint_every == 0 or m.round == fed.rounds):
                save_checkpoint(run_dir, m.round, sim.state_dict())
            log.info(
                "round %d: avg %.4f std %.4f loss %.4f", m.round, m.avg_acc, m.std_acc, m.train_loss
            )

        history = _run_with_progress(sim, on_round, show)
        if not history:
            raise ValueError(f"{run_dir}: no round has run (federation.rounds reached?)")
        summary = summarise(history)
        headline = "avg_acc_last5" if config.run.headline == "last5" else "avg_acc"
        summary.update(
            {
                "name": config.name,
                "preset": config.preset,
                "headline": {"metric": config.run.headline, "avg_acc": summary[headline]},
                "method": config.method.name,
                "dataset": data.dataset,
                "domains": list(data.domains),
                "real_domains": data.real_domains,
                "clients": [c.data.name for c in sim.clients],
                "num_train": {c.data.name: c.data.num_train for c in sim.clients},
                "setup_s": setup_s,
                "privacy": {
                    **sim.mechanism.describe(),
                    **sim.privacy_status(),
                    "dcr": config.privacy.use_dcr,
                    "guarantee": sim.guarantee(),
                },
                "units": "accuracies are fractions in [0, 1]; tables show percentages",
                "environment": environment(),
            }
        )
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if config.run.save_releases:
            save_artifacts(sim, run_dir)
        return RunResult(run_dir=run_dir, summary=summary, history=history)
    finally:
        if tensorboard is not None:
            tensorboard.close()
        torch.set_num_threads(threads_before)
        logging.getLogger("protofl").removeHandler(handler)
        handler.close()
        lock.release()


def _run_with_progress(sim: Simulation, on_round: Any, show: bool) -> list[RoundMetrics]:
    if not show:
        return sim.run(on_round=on_round)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (
        TextColumn("[bold]rounds"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("avg {task.fields[avg]}"),
        TimeElapsedColumn(),
    )
    with Progress(*cols, transient=False) as bar:
        task = bar.add_task(
            "rounds", total=sim.config.federation.rounds, completed=sim.round, avg="-"
        )

        def both(m: RoundMetrics) -> None:
            on_round(m)
            bar.update(task, advance=1, avg=f"{100 * m.avg_acc:.1f}%")

        return sim.run(on_round=both)


def save_artifacts(sim: Simulation, run_dir: Path) -> None:
    """Save what later attacks need: every round's releases and the final client models."""
    releases = [
        [
            None
            if r is None
            else {
                "prototypes": r.prototypes,
                "classes": r.classes,
                "counts": r.counts,
                "sensitivity": r.sensitivity,
                "noise_std_mean": r.noise_std.mean(dim=1),
                "noise_std": r.noise_std,
                "info": r.info,
            }
            for r in round_releases
        ]
        for round_releases in sim.releases
    ]
    torch.save(
        {
            "releases": releases,
            "clients": [c.data.name for c in sim.clients],
            "domains": [c.data.domain_name for c in sim.clients],
            "train_indices": [torch.from_numpy(c.data.train_indices) for c in sim.clients],
            "models": [c.model.state_dict() for c in sim.clients],
            "global_state": sim.global_state,
        },
        run_dir / "artifacts.pt",
    )
