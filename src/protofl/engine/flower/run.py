"""``run_flower_simulation``: one protofl config through Flower's engine, and the CLI glue."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from protofl.config import ExperimentConfig
from protofl.engine.simulation import RoundMetrics

log = logging.getLogger("protofl")

BACKENDS = ("ray", "inline")


@dataclass
class FlowerRunResult:
    """Where the run was written (None: nowhere) and what it measured."""

    run_dir: Path | None
    summary: dict[str, Any]
    history: list[RoundMetrics]


def run_flower_simulation(
    config: ExperimentConfig,
    *,
    out: str | Path | None = None,
    home: Path | None = None,
    backend: str = "ray",
    num_cpus: float = 1.0,
    round_timeout: float = 600.0,
    silent_nodes: tuple[int, ...] = (),
    ray_address: str | None = None,
    progress: bool | None = False,
) -> FlowerRunResult:
    """Run ``config`` with Flower's ServerApp/ClientApp on ``backend``; returns the summary.

    ``ray``: Flower's Simulation Runtime (``flwr.simulation.run_simulation``, one virtual
    SuperNode per client, ``num_cpus`` per ClientApp).  ``inline``: the same apps on an
    :class:`~protofl.engine.flower.inline.InlineGrid` in this process (no Ray).  ``out``: a run
    folder is written there, as ``protofl run`` does: config.yaml, run-record.json, run.log,
    metrics.jsonl, summary.json, the server's checkpoint after every round and, under
    ``nodes/partition-<id>/``, each simulated node's own client state (what a SuperNode keeps
    in its ``state-dir``); :func:`resume_flower_simulation` continues it.
    ``silent_nodes`` (inline only): partitions whose node never answers (fault drills).
    ``ray_address``: join a running Ray cluster (``ray start --head`` / ``--address``; "auto"
    finds the local one) instead of starting a private single-machine Ray.  ``progress``: a
    line while the runtime starts and a rounds bar (stderr), as the in-process engine shows
    (None: ``run.progress``).
    """
    from protofl.engine.federated_data import preflight
    from protofl.engine.runner import make_run_dir, start_run_dir

    _check_backend(backend, silent_nodes)
    _check_cluster_state(config, ray_address)
    run_dir = None
    if out is not None:
        preflight(config)  # a bad name, option or data root fails before any folder exists
        run_dir = make_run_dir(config, out)
        start_run_dir(config, run_dir, engine="flower")
    return _simulate(
        config,
        run_dir=run_dir,
        resume=False,
        home=home,
        backend=backend,
        num_cpus=num_cpus,
        round_timeout=round_timeout,
        silent_nodes=silent_nodes,
        ray_address=ray_address,
        progress=progress,
    )


def resume_flower_simulation(
    run_dir: str | Path,
    *,
    extend: int = 0,
    home: Path | None = None,
    backend: str = "ray",
    num_cpus: float = 1.0,
    round_timeout: float = 600.0,
    silent_nodes: tuple[int, ...] = (),
    ray_address: str | None = None,
    progress: bool | None = False,
) -> FlowerRunResult:
    """Continue a Flower run folder from its server checkpoint, its clients from their
    node-local state (``extend`` > 0: a finished run, for that many more rounds at its
    calibrated noise, recorded as :func:`protofl.engine.runner.extend_experiment` does).
    The backend may differ from the first run's (both give the same numbers)."""
    from protofl.engine.extension import check_extend_rounds, plan_extension
    from protofl.engine.rundir import FolderLock, check_resume
    from protofl.engine.runner import read_run_config

    _check_backend(backend, silent_nodes)
    run_dir = Path(run_dir)
    config = read_run_config(run_dir)
    _check_cluster_state(config, ray_address)
    check_resume(run_dir, config, engine="flower")  # an edited config.yaml is refused
    if extend:
        check_extend_rounds(extend)
        with FolderLock(run_dir, "run"):
            entry = plan_extension(run_dir, config, extend)
        log.warning("extension of %s: %s", run_dir, entry["note"])
    return _simulate(
        config,
        run_dir=run_dir,
        resume=True,
        home=home,
        backend=backend,
        num_cpus=num_cpus,
        round_timeout=round_timeout,
        silent_nodes=silent_nodes,
        ray_address=ray_address,
        progress=progress,
    )


def _check_backend(backend: str, silent_nodes: tuple[int, ...]) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose one of {', '.join(BACKENDS)}")
    if silent_nodes and backend != "inline":
        raise ValueError("silent_nodes is only supported by the inline backend")


def _check_cluster_state(config: ExperimentConfig, ray_address: str | None) -> None:
    """``run.client_state=disk`` keeps each simulated node's state in a file on this machine
    only (no copy in Flower's Context): the workers of a Ray cluster may not see it."""
    if ray_address and config.run.client_state == "disk":
        raise ValueError(
            "run.client_state=disk keeps each simulated node's client state in files on this "
            "machine, which the workers of a Ray cluster (ray_address) may not share; use "
            "run.client_state=memory there"
        )


def _simulate(
    config: ExperimentConfig,
    *,
    run_dir: Path | None,
    resume: bool,
    home: Path | None,
    backend: str,
    num_cpus: float,
    round_timeout: float,
    silent_nodes: tuple[int, ...],
    ray_address: str | None,
    progress: bool | None = False,
) -> FlowerRunResult:
    from protofl.data.cache import protofl_home
    from protofl.engine.federated_data import build_federated_data
    from protofl.engine.flower.client_app import make_client_app
    from protofl.engine.flower.plan import plan_from_data
    from protofl.engine.flower.server_app import ServerOutcome, make_server_app
    from protofl.engine.rundir import target_rounds

    home = Path(home) if home is not None else protofl_home()
    threads = torch.get_num_threads()
    # the simulated nodes' client state: under the run folder; with run.client_state=disk and
    # no run folder, in a temporary folder removed with the run (the nodes' only copy of it)
    scratch = None
    state_root = None if run_dir is None else run_dir / "nodes"
    if state_root is None and config.run.client_state == "disk":
        scratch = tempfile.TemporaryDirectory(prefix="protofl-flower-nodes-")
        state_root = Path(scratch.name)
    progress = config.run.progress if progress is None else progress
    bar = _RoundsBar(progress)
    try:
        # build (and disk-cache) the data once here: it tells how many SuperNodes to start,
        # and the server (the operator, who built every partition) what each must register
        from protofl.progress import progress_notes

        with progress_notes(progress):  # feature extraction on a fresh home takes minutes
            data = build_federated_data(config, home)
        num_clients = len(data.clients)
        plan = plan_from_data(config, data)
        del data
        target = target_rounds(run_dir, config) if run_dir is not None else config.federation.rounds
        bar.say(
            f"starting Flower ({'in-process grid' if backend == 'inline' else 'Ray simulation'}"
            f", {num_clients} SuperNodes) ..."
        )
        bar.start(target)
        outcome = ServerOutcome()
        client_app = make_client_app(
            config,
            home,
            deployment=False,
            state_root=state_root,
            release_limit=None if run_dir is None else target_rounds(run_dir, config),
            # a Ray cluster's workers may each write the node files on their own machine
            release_files=ray_address is None,
        )
        if backend == "inline":
            from protofl.engine.flower.inline import InlineGrid
            from protofl.engine.flower.server_app import run_flower_server

            grid = InlineGrid(
                client_app,
                num_clients,
                silent=[1000 + p for p in silent_nodes],
            )
            run_flower_server(
                grid,
                config,
                out=None,
                run_dir=run_dir,
                resume=resume,
                min_nodes=num_clients,
                round_timeout=round_timeout,
                wait_timeout=60.0,
                outcome=outcome,
                on_round=bar.on_round,
                diagnostics=config.run.diagnostics,
                plan=plan,
            )
        else:
            from flwr.simulation import run_simulation

            server_app = make_server_app(
                config,
                out=None,
                run_dir=run_dir,
                resume=resume,
                min_nodes=num_clients,
                round_timeout=round_timeout,
                outcome=outcome,
                on_round=bar.on_round,
                diagnostics=config.run.diagnostics,
                plan=plan,
            )
            with quiet_flower():
                run_simulation(
                    server_app=server_app,
                    client_app=client_app,
                    num_supernodes=num_clients,
                    backend_config={
                        "client_resources": {"num_cpus": num_cpus, "num_gpus": 0.0},
                        "init_args": (
                            {"address": ray_address}
                            if ray_address
                            else {"num_cpus": max(os.cpu_count() or 1, 1)}
                        ),
                    },
                )
        if not outcome.summary:
            raise RuntimeError("the Flower ServerApp did not complete (see the log above)")
        return FlowerRunResult(outcome.run_dir, outcome.summary, outcome.history)
    except KeyboardInterrupt as exc:
        from protofl.engine.runner import RunInterrupted

        if run_dir is None or isinstance(exc, RunInterrupted):
            raise
        # Ctrl-C: the folder is this run's, so the message names the command continuing it
        raise RunInterrupted(str(exc) or "interrupted", run_dir) from None
    finally:
        bar.stop()
        torch.set_num_threads(threads)
        if scratch is not None:
            scratch.cleanup()


class _RoundsBar:
    """The rounds bar of ``protofl run --engine flower`` (rich, stderr), like the in-process
    engine's; ``on_round`` is the ServerApp's per-round callback.  Off: does nothing."""

    def __init__(self, show: bool) -> None:
        self.show = show
        self._bar: Any = None
        self._task: Any = None

    def say(self, line: str) -> None:
        if self.show:
            print(line, file=sys.stderr, flush=True)

    def start(self, total: int) -> None:
        if not self.show:
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("[bold]rounds"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("avg {task.fields[avg]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self._task = self._bar.add_task("rounds", total=total, completed=0, avg="-")
        self._bar.start()

    def on_round(self, m: RoundMetrics) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=m.round, avg=f"{100 * m.avg_acc:.1f}%")

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class _DropDeprecation(logging.Filter):
    """Drops Flower's notice that ``run_simulation`` is deprecated: protofl calls it on
    purpose (the pinned 1.42 still has it; docs/distributed.md "Pinned version range")."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg) + " ".join(str(a) for a in (record.args or ()))  # type: ignore[union-attr]
        return not ("DEPRECATED FEATURE" in text and "run_simulation" in text)


@contextmanager
def quiet_flower() -> Iterator[None]:
    """While protofl launches Flower's simulation runtime: no deprecation notice for
    ``run_simulation`` (Flower's logger) and no Ray FutureWarning about accelerator env vars
    (protofl's ClientApps ask for no GPU); both are about APIs protofl chose, not the run."""
    flwr_log = logging.getLogger("flwr")
    drop = _DropDeprecation()
    flwr_log.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"ray(\.|$)")
            warnings.filterwarnings(
                "ignore", message=".*RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", category=FutureWarning
            )
            yield
    finally:
        flwr_log.removeFilter(drop)


# ----- CLI glue (the lead wires these into protofl.cli) ---------------------------------------
def add_flower_arguments(parser: argparse.ArgumentParser) -> None:
    """The Flower engines' options, for ``protofl run`` (``--engine`` itself is the CLI's)."""
    group = parser.add_argument_group("Flower engines (need `pip install protofl[flower]`)")
    group.add_argument(
        "--flower-backend",
        choices=BACKENDS,
        default="ray",
        help="ray: Flower's Simulation Runtime; inline: the same apps in-process, no Ray",
    )
    group.add_argument(
        "--flower-num-cpus", type=float, default=1.0, help="CPUs per ClientApp (Ray backend)"
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="join a running Ray cluster (e.g. auto, or HEAD:6379) instead of a private one",
    )
    group.add_argument(
        "--round-timeout",
        type=float,
        default=600.0,
        help="seconds each phase of a round waits for replies before it goes on without them",
    )


def add_flower_app_parser(sub: Any) -> argparse.ArgumentParser:
    """``protofl flower-app OUT_DIR [CONFIG] [--set K=V]``: write a Flower App for ``flwr run``."""
    p = sub.add_parser(
        "flower-app", help="write a Flower App (pyproject.toml + apps) for `flwr run`"
    )
    p.add_argument("out_dir", help="folder to create (must not exist or be empty)")
    p.add_argument("config", nargs="?", help="experiment YAML (default: the embedded default)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--runs", help="where the ServerApp writes its run folder (default: none)")
    p.add_argument("--round-timeout", type=float, default=600.0)
    p.add_argument(
        "--num-supernodes",
        type=int,
        default=None,
        help="simulated SuperNodes for `flwr run . local` (default: the config's client count)",
    )
    p.set_defaults(func=run_flower_app_command)
    return p


def run_flower_app_command(args: argparse.Namespace) -> int:
    """Handler of ``protofl flower-app``."""
    from protofl.engine.flower.app import config_num_clients, flwr_run_command, write_flower_app

    config = ExperimentConfig.from_yaml(args.config) if args.config else ExperimentConfig()
    config = config.with_overrides(args.set or [])
    num = args.num_supernodes
    if num is None:
        from protofl.progress import progress_notes

        print(f"building the data set {config.data.name!r} to count its clients ...", flush=True)
        with progress_notes(True):
            num = config_num_clients(config)
    path = write_flower_app(
        args.out_dir,
        config,
        out_dir=args.runs,
        round_timeout=args.round_timeout,
        num_supernodes=num,
    )
    print(f"wrote the Flower App to {path} ({num} clients); run it with:")
    print(f"  {flwr_run_command(path, num)}")
    return 0
