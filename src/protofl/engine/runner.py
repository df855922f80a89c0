"""Run an experiment end to end and write its run folder (config, metrics, summary, log)."""

from __future__ import annotations

import logging
import platform
import re
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from protofl._version import __version__
from protofl.config import ExperimentConfig
from protofl.data.cache import protofl_home
from protofl.engine.checkpoint import (
    checkpoint_bytes,
    load_latest_checkpoint,
    save_checkpoint,
    wait_for_deletions,
)
from protofl.engine.extension import (
    check_extend_rounds,
    extended_privacy,
    plan_extension,
    raise_release_limit,
)
from protofl.engine.federated_data import FederatedData, build_federated_data, preflight
from protofl.engine.hooks import check_diagnostics, upload_hooks_for
from protofl.engine.rundir import (
    CLIENT_ARTIFACTS,
    SUMMARY_LOCAL_FIELDS,
    FolderLock,
    append_round,
    check_resume,
    claim_dir,
    open_client_local,
    read_extensions,
    read_record,
    resume_command,
    rewrite_rounds,
    split_round,
    target_rounds,
    write_private,
    write_record,
    write_summary,
)
from protofl.engine.simulation import RoundMetrics, Simulation, summarise

log = logging.getLogger("protofl")

STATE_DIR = "client-state"
"""A run folder's memory-mapped client store (``run.client_state=disk``)."""


class RunInterrupted(KeyboardInterrupt):
    """A Ctrl-C (or SIGTERM/SIGHUP) that stopped the run in ``run_dir``: its finished rounds
    and checkpoints are kept, and ``command`` continues it."""

    def __init__(self, why: str, run_dir: Path) -> None:
        super().__init__(why)
        self.run_dir = run_dir
        self.command = resume_command(run_dir)


@dataclass
class RunResult:
    """Where a run was written and what it measured."""

    run_dir: Path
    summary: dict[str, Any]
    history: list[RoundMetrics]


def make_run_dir(config: ExperimentConfig, out: str | Path | None) -> Path:
    """``<out>/<time>-<name>/`` (a unique folder, claimed atomically); a config without a name
    of its own (``default``) is named after what runs: ``<method>-<mechanism>``."""
    root = Path(out) if out is not None else Path(config.run.out_dir)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    name = config.name
    if name == "default":
        name = f"{config.method.name}-{config.privacy.mechanism}"
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "run"
    return claim_dir(root, f"{stamp}-{safe}")


def start_run_dir(config: ExperimentConfig, run_dir: Path, *, engine: str = "sim") -> None:
    """Write what a new run is: config.yaml (to read) and the run record (to resume against)."""
    (run_dir / "config.yaml").write_text(config.to_yaml())
    write_record(run_dir, config, engine=engine)


class RunLogHandler(logging.Handler):
    """``run.log`` for what the server may read, and ``<run>.client-local/client.log`` (made
    on the first such record, 0600) for records computed on a client's private data: those
    logged with ``extra={"local_only": True}`` (small-class warnings with exact counts)."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__()
        self.run_dir = run_dir
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self._server = logging.FileHandler(run_dir / "run.log")
        self._client: logging.FileHandler | None = None

    def emit(self, record: logging.LogRecord) -> None:
        target = self._server
        if getattr(record, "local_only", False):
            if self._client is None:
                from protofl.engine.rundir import open_client_local

                path = open_client_local(self.run_dir) / "client.log"
                path.touch(mode=0o600, exist_ok=True)
                self._client = logging.FileHandler(path)
            target = self._client
        target.setFormatter(self.formatter)
        target.emit(record)

    def close(self) -> None:
        for h in (self._server, self._client):
            if h is not None:
                h.close()
        super().close()


def attach_log(run_dir: Path) -> logging.Handler:
    handler = RunLogHandler(run_dir)
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


def device_facts(device: torch.device) -> dict[str, Any]:
    """The resolved ``run.device`` as the run records it: ``device`` (``cpu``, ``cuda:0``) and,
    on a GPU, its name and whether torch's deterministic algorithms were on."""
    from protofl.models.device import describe_device

    info = describe_device(device)
    out: dict[str, Any] = {"device": info["device"]}
    if device.type == "cuda":
        out["device_name"] = info["name"]
        out["deterministic_algorithms"] = info["deterministic_algorithms"]
    return out


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
    check_diagnostics(config)  # as does a diagnostic whose hook nobody registered
    run_dir = make_run_dir(config, out)
    start_run_dir(config, run_dir)
    return _execute(
        config, run_dir, home=home, progress=progress, data=data, resume=False, console=True
    )


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
    prepare_run_dir(config, run_dir, resume=resume)
    return _execute(config, run_dir, home=home, progress=progress, data=None, resume=resume)


def prepare_run_dir(config: ExperimentConfig, run_dir: Path, *, resume: bool) -> None:
    """Make ``run_dir`` a run folder for ``config`` (config.yaml and the run record, unless
    there); with ``resume``, check that its config is the one it was made with."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume:
        check_resume(run_dir, config)
    if not (run_dir / "config.yaml").exists():
        (run_dir / "config.yaml").write_text(config.to_yaml())
    if read_record(run_dir) is None:
        write_record(run_dir, config)


def resume_experiment(
    run_dir: str | Path, *, home: Path | None = None, progress: bool | None = None
) -> RunResult:
    """Continue a stopped or killed run of the ``sim`` engine from its last complete round
    (up to its configured rounds plus any extension)."""
    run_dir = Path(run_dir)
    config = read_run_config(run_dir)
    check_resume(run_dir, config)  # an edited config.yaml is refused, naming the keys
    return _execute(
        config, run_dir, home=home, progress=progress, data=None, resume=True, console=True
    )


def read_run_config(run_dir: Path) -> ExperimentConfig:
    """``run_dir/config.yaml`` (a folder without one is not a run folder)."""
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no config.yaml)")
    return ExperimentConfig.from_yaml(run_dir / "config.yaml")


# ----- extending a finished run ---------------------------------------------------------------
def extend_experiment(
    run_dir: str | Path,
    rounds: int,
    *,
    home: Path | None = None,
    progress: bool | None = None,
) -> RunResult:
    """Continue a finished ``sim`` run for ``rounds`` more rounds at its calibrated noise; the
    extension and the new total epsilon are recorded (``extensions.json``, summary, log)."""
    run_dir = Path(run_dir)
    check_extend_rounds(rounds)
    config = read_run_config(run_dir)
    check_resume(run_dir, config)
    lock = FolderLock(run_dir, "run")
    lock.acquire()  # handed to _execute, which releases it
    try:
        entry = plan_extension(run_dir, config, rounds)
    except BaseException:
        lock.release()
        raise
    return _execute(
        config,
        run_dir,
        home=home,
        progress=progress,
        data=None,
        resume=True,
        lock=lock,
        extension=entry,
        console=True,
    )


def _execute(
    config: ExperimentConfig,
    run_dir: Path,
    *,
    home: Path | None,
    progress: bool | None,
    data: FederatedData | None,
    resume: bool,
    lock: FolderLock | None = None,
    extension: dict[str, Any] | None = None,
    console: bool = False,
) -> RunResult:
    """Drive one session; ``console``: a command's own run (not a sweep's), which prints the
    checkpoint size and disk warnings to stderr and turns SIGTERM/SIGHUP into an interrupt that
    names the command continuing the run (:class:`RunInterrupted`)."""
    show = config.run.progress if progress is None else progress
    threads_before = torch.get_num_threads()
    session = RunSession(config, run_dir, lock=lock, console=console)
    try:
        with _terminate_as_interrupt(console):
            return _drive(session, config, home, data, resume, extension, show)
    except RunInterrupted:
        raise
    except KeyboardInterrupt as exc:
        raise RunInterrupted(str(exc) or "interrupted", run_dir) from None
    finally:
        torch.set_num_threads(threads_before)
        session.close()


@contextmanager
def _terminate_as_interrupt(active: bool) -> Iterator[None]:
    """SIGTERM and SIGHUP act as Ctrl-C while ``active`` (a sweep installs its own)."""
    if not active:
        yield
        return
    from protofl.engine.rundir import terminate_as_interrupt as terminate

    with terminate():
        yield


def _drive(
    session: RunSession,
    config: ExperimentConfig,
    home: Path | None,
    data: FederatedData | None,
    resume: bool,
    extension: dict[str, Any] | None,
    show: bool,
) -> RunResult:
    if config.run.threads is not None:
        torch.set_num_threads(config.run.threads)
    session.open(home=home, data=data, resume=resume, extension=extension, show=show)
    if config.run.threads is None:
        # the trainable part is tiny: one intra-op thread avoids oversubscription (measured
        # 10x faster per step on a loaded 2-core machine); extraction above used them all
        torch.set_num_threads(1)
    history = _run_with_progress(session.sim, session.on_round, show, session.target)
    return session.finish(history)


_LOG_SCOPE: ContextVar[Path | None] = ContextVar("protofl_log_scope", default=None)


@contextmanager
def log_scope(run_dir: Path | None) -> Iterator[None]:
    """While open, only ``run_dir``'s ``run.log`` receives the engine's log lines (several runs
    open in one process, as in a fused sweep); outside any scope every open run's log does."""
    token = _LOG_SCOPE.set(run_dir)
    try:
        yield
    finally:
        _LOG_SCOPE.reset(token)


class RunSession:
    """One run folder open for rounds: its lock and log, its data and :class:`Simulation`
    (resumed from the last checkpoint), ``on_round`` (metrics.jsonl, checkpoints, log line) and
    ``finish`` (summary.json, artifacts).  ``_execute`` drives one session; a fused sweep
    (:mod:`protofl.engine.fused`) drives several in lockstep, so both write the same folder."""

    def __init__(
        self,
        config: ExperimentConfig,
        run_dir: Path,
        *,
        lock: FolderLock | None = None,
        console: bool = False,
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self._lock = lock
        # a command's own run: the disk warning goes to stderr, and the checkpoint size line
        # too unless the run is quiet (no progress display)
        self.console = console
        self.show = False
        self._disk_checked = False
        self._handler: logging.Handler | None = None
        self._tensorboard: Any = None
        self._tensorboard_local: Any = None
        self.sim: Simulation = None  # type: ignore[assignment]  # set by open()
        self.data: FederatedData | None = None
        self.setup_s = 0.0
        self.target = 0
        self.extensions: list[dict[str, Any]] = []
        self.state_dir: Path | None = None

    def open(
        self,
        *,
        home: Path | None,
        data: FederatedData | None = None,
        resume: bool = False,
        extension: dict[str, Any] | None = None,
        show: bool = False,
    ) -> Simulation:
        """Lock the folder, attach its log, build (or take) the data and the simulation, and
        load the last checkpoint when ``resume``; returns the simulation."""
        config, run_dir = self.config, self.run_dir
        self.show = show
        if self._lock is None:
            self._lock = FolderLock(run_dir, "run")
            self._lock.acquire()  # one process at a time in a run folder; released by close()
        self._handler = attach_log(run_dir)
        self._handler.addFilter(lambda record: _LOG_SCOPE.get() in (None, run_dir))
        t0 = time.perf_counter()
        home = home or protofl_home()
        if data is None:
            from protofl.progress import progress_notes

            with progress_notes(show):  # feature extraction on a fresh cache takes minutes
                data = build_federated_data(config, home)
        self.data = data
        self.setup_s = time.perf_counter() - t0
        log.info("data ready in %.1fs: %d clients", self.setup_s, len(data.clients))
        # run.client_state=disk: the clients' mapped store (rebuilt from the checkpoint on a
        # resume, removed once the run has finished: the last checkpoint holds it all)
        state_dir = run_dir / STATE_DIR if config.run.client_state == "disk" else None
        self.state_dir = state_dir
        sim = Simulation(config, data, upload_hooks=upload_hooks_for(config), state_dir=state_dir)
        self.sim = sim
        self.extensions = read_extensions(run_dir)
        self.target = target_rounds(run_dir, config)
        if extension is not None:
            log.warning("extension of %s: %s", run_dir, extension["note"])
        if self.target > config.federation.rounds:
            raise_release_limit(sim.mechanism, config.privacy.releases(self.target))
        if resume:
            state = load_latest_checkpoint(run_dir)
            if state is not None:
                sim.load_state_dict(state)
            log.info("resuming %s after round %d", run_dir, sim.round)
            # metrics.jsonl (and the client-local diagnostics.jsonl) may hold a round written
            # after the last checkpoint: both are rewritten from the history it restored
            rewrite_rounds(run_dir, [m.to_json() for m in sim.history])
        else:
            rewrite_rounds(run_dir, [])
        if config.run.tensorboard:
            from protofl.report.tensorboard import TensorBoardLogger

            # the server's scalars in the run folder, the local-only ones (training loss) in
            # the client-local folder
            self._tensorboard = TensorBoardLogger(run_dir)
            self._tensorboard_local = TensorBoardLogger(open_client_local(run_dir))
        return sim

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint of this run holds (``Simulation.state_dict``)."""
        return self.sim.state_dict()

    def on_round(self, m: RoundMetrics) -> None:
        """After each round: metrics.jsonl (the server's part of the row) and the client-local
        diagnostics.jsonl (its local-only fields), TensorBoard, the checkpoint, the log line."""
        row = m.to_json()
        if self._tensorboard is not None:
            server, local = split_round(row)
            self._tensorboard.log_round(server)
            self._tensorboard_local.log_round(local)
        append_round(self.run_dir, row)
        fed = self.config.federation
        if fed.checkpoint and (m.round % fed.checkpoint_every == 0 or m.round == self.target):
            t0 = time.perf_counter()
            save_checkpoint(
                self.run_dir, m.round, self.checkpoint_state(), keep=fed.keep_checkpoints
            )
            self.sim.page_out()  # writing it read every client's mapped state
            took = time.perf_counter() - t0
            log.info("checkpoint of round %d written in %.2fs", m.round, took)
            if not self._disk_checked:
                self._say(checkpoint_line(self.config, checkpoint_bytes(self.run_dir) or 0, took))
        if not self._disk_checked:
            self._disk_checked = True
            warning = disk_warning(self.config, self.run_dir, self.projected_bytes())
            if warning is not None:
                log.warning("%s", warning)
                if self.console:
                    print(f"protofl: warning: {warning}", file=sys.stderr, flush=True)
        log.info(
            "round %d: avg %.4f std %.4f loss %.4f", m.round, m.avg_acc, m.std_acc, m.train_loss
        )

    def _say(self, line: str) -> None:
        log.info("%s", line)
        if self.console and self.show:
            print(line, file=sys.stderr, flush=True)

    def projected_bytes(self) -> int:
        """What the run folder will hold at the end, projected after a round: the checkpoint
        size x the checkpoints kept, the releases' artifacts at the target round (with
        ``run.save_releases``) and the mapped client state (``run.client_state=disk``)."""
        fed, sim = self.config.federation, self.sim
        total = 0
        size = checkpoint_bytes(self.run_dir) if fed.checkpoint else None
        if size:
            saved = -(-self.target // fed.checkpoint_every)  # every k-th round and the last
            total += size * (saved if fed.keep_checkpoints == 0 else fed.keep_checkpoints)
        if self.config.run.save_releases and sim.releases:
            per_round = tensor_bytes(sim.releases) / len(sim.releases)
            total += int(per_round * self.target)
        if self.state_dir is not None and self.state_dir.is_dir():
            total += sum(f.stat().st_blocks * 512 for f in self.state_dir.rglob("*") if f.is_file())
        return total

    def finish(self, history: list[RoundMetrics]) -> RunResult:
        """Write summary.json (and the artifacts with ``run.save_releases``).  Local-only facts
        (the training loss, VPP's partition overlap, the exact training counts when the
        relation does not make them public) go to the client-local ``client-summary.json``;
        the returned summary holds everything."""
        config, run_dir, sim, data = self.config, self.run_dir, self.sim, self.data
        assert data is not None
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
                "setup_s": self.setup_s,
                "privacy": extended_privacy(
                    {
                        **sim.mechanism.describe(),
                        **sim.privacy_status(),
                        "dcr": config.privacy.use_dcr,
                        "guarantee": sim.guarantee(),
                    },
                    self.extensions,
                ),
                "units": "accuracies are fractions in [0, 1]; tables show percentages",
                # where it computed (run.device resolved on this machine; docs/performance.md)
                "environment": {**environment(), **device_facts(sim.device)},
            }
        )
        local = SUMMARY_LOCAL_FIELDS if sim.counts_public else (*SUMMARY_LOCAL_FIELDS, "num_train")
        write_summary(run_dir, summary, local=local)
        if config.run.save_releases:
            save_artifacts(sim, run_dir)
        if self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        return RunResult(run_dir=run_dir, summary=summary, history=history)

    def close(self) -> None:
        """Close TensorBoard, detach the log, release the folder lock (idempotent)."""
        wait_for_deletions()  # the dropped checkpoints are gone when the run returns
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard_local.close()
            self._tensorboard = self._tensorboard_local = None
        if self._handler is not None:
            logging.getLogger("protofl").removeHandler(self._handler)
            self._handler.close()
            self._handler = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def checkpoint_line(config: ExperimentConfig, size: int, seconds: float) -> str:
    """The console line after a run's first checkpoint: its size, how long it took, how often
    and how many are kept (the keys that change it)."""
    fed = config.federation
    every = "every round" if fed.checkpoint_every == 1 else f"every {fed.checkpoint_every} rounds"
    keep = (
        "keeping all" if fed.keep_checkpoints == 0 else f"keeping the latest {fed.keep_checkpoints}"
    )
    return (
        f"checkpoint: {_gb(size)} {every} (written in {seconds:.1f} s), {keep} "
        "(federation.keep_checkpoints; federation.checkpoint_every, federation.checkpoint=false)"
    )


def disk_warning(config: ExperimentConfig, run_dir: Path, projected: int) -> str | None:
    """One line when ``run_dir`` is projected to hold more than ``run.disk_warn_gb``."""
    limit = config.run.disk_warn_gb
    if limit <= 0 or projected <= limit * 1e9:
        return None
    return (
        f"{run_dir} will hold about {_gb(projected)} by round {target_rounds(run_dir, config)} "
        f"(checkpoints x federation.keep_checkpoints={config.federation.keep_checkpoints}, "
        f"artifacts, client state), more than run.disk_warn_gb={limit:g}; "
        "set federation.checkpoint_every=k, federation.checkpoint=false or "
        "run.save_releases=false for less"
    )


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor inside ``value`` (lists, dicts, tuples, release objects)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    if hasattr(value, "__dataclass_fields__"):
        return sum(tensor_bytes(getattr(value, f)) for f in value.__dataclass_fields__)
    return 0


def _run_with_progress(
    sim: Simulation, on_round: Any, show: bool, target: int
) -> list[RoundMetrics]:
    todo = max(target - sim.round, 0)
    if not show:
        return sim.run(todo, on_round=on_round)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (
        TextColumn("[bold]rounds"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("avg {task.fields[avg]}"),
        TimeElapsedColumn(),
    )
    with Progress(*cols, transient=False) as bar:
        task = bar.add_task("rounds", total=target, completed=sim.round, avg="-")

        def both(m: RoundMetrics) -> None:
            on_round(m)
            bar.update(task, advance=1, avg=f"{100 * m.avg_acc:.1f}%")

        return sim.run(todo, on_round=both)


def save_artifacts(sim: Simulation, run_dir: Path) -> None:
    """Save what later attacks need.  ``artifacts.pt`` (the run folder: what the server
    received) holds every round's releases as uploaded, client names and domains and the
    global state; the final client models and each client's training indices (the attacks'
    ground truth, which never leaves a client) go to the client-local ``client-artifacts.pt``
    (mode 0600), for weight-sharing methods too."""
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
            "global_state": sim.global_state,
        },
        run_dir / "artifacts.pt",
    )
    local = {
        "clients": [c.data.name for c in sim.clients],
        "train_indices": [torch.from_numpy(c.data.train_indices) for c in sim.clients],
        "models": [c.model.state_dict() for c in sim.clients],
    }
    write_private(open_client_local(run_dir) / CLIENT_ARTIFACTS, lambda fh: torch.save(local, fh))
