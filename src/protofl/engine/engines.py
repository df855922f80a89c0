"""Where the rounds run: the registered engines, chosen by ``run.engine`` like everything else.

============  ==================================================================================
engine        what runs the rounds
============  ==================================================================================
``sim``       the in-process simulator (:class:`~protofl.engine.simulation.Simulation`; its
              clients one after another or batched, ``federation.execution``); resumable
``flower``    Flower's ServerApp/ClientApp on Flower's Simulation Runtime (``ray``) or in this
              process (``inline``), see :mod:`protofl.engine.flower.run` (extra: flower);
              resumable (server checkpoints, node-local client state in the run folder)
``flower-loopback``  a real Flower deployment on this machine: a SuperLink and one SuperNode
              per client as separate processes, ``flwr run`` (extra: flower)
============  ==================================================================================

Every engine runs the same round (:mod:`protofl.engine.round`) and writes a run folder with
``summary.json``.  A new engine is one :class:`Engine` registered here (or by a plug-in
module): a function ``(config, options) -> RunResult``, and, if it can continue its own run
folders, ``resume(run_dir, options, extend)`` (``extend``: rounds added to a finished run,
0 for a plain resume).  :func:`resume_run` continues a run folder on the engine that made it
and on no other.  An engine that can run a config in a folder it is given (a sweep point's,
``<sweep>/<index>-<slug>``), starting it there or continuing it from its checkpoints, has
``run_in_dir(config, run_dir, options, resume)``; :func:`run_engine_in_dir` dispatches on
``run.engine`` and refuses, naming ``run.engine``, an engine without it (``flower-loopback``:
its deployment writes its own run folders) before anything is created.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from protofl.config import ExperimentConfig
from protofl.errors import ConfigError
from protofl.registry import Registry


class EngineResult(Protocol):
    """What an engine hands back: its run folder and summary."""

    @property
    def run_dir(self) -> Path | None:
        """The run folder (None when the engine wrote none)."""

    @property
    def summary(self) -> dict[str, Any]:
        """``summary.json``'s content."""


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineOptions:
    """Per-invocation settings that do not change results (where to write, how to show it,
    how Flower is started)."""

    out: str | Path | None = None
    progress: bool | None = None
    flower: dict[str, Any] = field(default_factory=dict)
    home: Path | None = None
    """The data and feature cache (``PROTOFL_HOME``); None: the default one."""


@dataclass(frozen=True)
class Engine:
    """A registered engine: a name, one line for ``--help`` and the function that runs."""

    name: str
    summary: str
    run: Callable[[ExperimentConfig, EngineOptions], EngineResult]
    resume: Callable[[Path, EngineOptions, int], EngineResult] | None = None
    run_in_dir: Callable[[ExperimentConfig, Path, EngineOptions, bool], EngineResult] | None = None
    """``(config, run_dir, options, resume)``: run ``config`` in ``run_dir`` (a sweep point's
    folder): afresh, or with ``resume`` from its last checkpoint (the folder's run must be this
    engine's and this config's); None: the engine only writes folders of its own making."""

    @property
    def resumable(self) -> bool:
        """Whether the engine continues (and extends) its own run folders."""
        return self.resume is not None


ENGINE_REGISTRY: Registry[Engine] = Registry("engine")


def register_engine(engine: Engine) -> Engine:
    """Add ``engine`` to the registry (its name must be new)."""
    ENGINE_REGISTRY.add(engine.name, engine)
    return engine


def _run_sim(config: ExperimentConfig, options: EngineOptions) -> EngineResult:
    from protofl.engine.runner import run_experiment

    return run_experiment(config, out=options.out, home=options.home, progress=options.progress)


def _resume_sim(run_dir: Path, options: EngineOptions, extend: int) -> EngineResult:
    from protofl.engine.runner import extend_experiment, resume_experiment

    if extend:
        return extend_experiment(run_dir, extend, home=options.home, progress=options.progress)
    return resume_experiment(run_dir, home=options.home, progress=options.progress)


def _sim_in_dir(
    config: ExperimentConfig, run_dir: Path, options: EngineOptions, resume: bool
) -> EngineResult:
    from protofl.engine.runner import run_in_dir

    return run_in_dir(config, run_dir, resume=resume, home=options.home, progress=options.progress)


def _run_flower(config: ExperimentConfig, options: EngineOptions) -> EngineResult:
    from protofl.engine.flower.run import run_flower_simulation  # optional dependency

    out = options.out if options.out is not None else config.run.out_dir
    return run_flower_simulation(
        config, out=out, home=options.home, progress=options.progress, **options.flower
    )


def _resume_flower(run_dir: Path, options: EngineOptions, extend: int) -> EngineResult:
    from protofl.engine.flower.run import resume_flower_simulation  # optional dependency

    return resume_flower_simulation(
        run_dir, extend=extend, home=options.home, progress=options.progress, **options.flower
    )


def _flower_in_dir(
    config: ExperimentConfig, run_dir: Path, options: EngineOptions, resume: bool
) -> EngineResult:
    """A Flower run in ``run_dir``: resumed from its server checkpoint and its nodes' state
    (``resume``), or started afresh there.  A fresh start first removes what an earlier attempt
    left in the folder that a Flower run would pick up (server checkpoints; the simulated
    nodes' client state under ``nodes/``, which a node would otherwise continue from), writes
    config.yaml and the run record (engine ``flower``) and then runs as a resume from no
    checkpoint: :func:`~protofl.engine.flower.run.resume_flower_simulation`, round 1 on."""
    import shutil

    from protofl.engine.flower.run import resume_flower_simulation  # optional dependency
    from protofl.engine.rundir import check_resume, record_engine, write_record

    if resume:
        made_by = record_engine(run_dir)  # "sim" for a folder without a record
        if made_by != "flower":
            raise ConfigError(
                f"{run_dir}: this run was made by the {made_by!r} engine and resumes only on "
                "it, not with run.engine='flower'; start it anew in another folder"
            )
        check_resume(run_dir, config, engine="flower")  # an edited config is refused
    else:
        from protofl.engine.federated_data import preflight

        preflight(config)  # a bad name, option or data root fails before the folder is touched
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in run_dir.glob("checkpoint*"):
            stale.unlink()
        shutil.rmtree(run_dir / "nodes", ignore_errors=True)
        write_record(run_dir, config, engine="flower")
    (run_dir / "config.yaml").write_text(config.to_yaml())
    return resume_flower_simulation(
        run_dir, home=options.home, progress=options.progress, **options.flower
    )


@dataclass
class _LoopbackResult:
    run_dir: Path | None
    summary: dict[str, Any]


def _run_loopback(config: ExperimentConfig, options: EngineOptions) -> EngineResult:
    import tempfile

    from protofl.engine.flower.deploy import run_loopback  # optional dependency

    out = Path(options.out if options.out is not None else config.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="loopback-", dir=out))
    timeout = float(options.flower.get("round_timeout", 120.0))
    summary = run_loopback(config, work, round_timeout=timeout)
    runs = sorted((work / "runs").glob("*/summary.json"))
    return _LoopbackResult(run_dir=runs[-1].parent if runs else work, summary=summary)


register_engine(
    Engine(
        "sim",
        "the in-process simulator (sequential or batched clients)",
        _run_sim,
        _resume_sim,
        _sim_in_dir,
    )
)
register_engine(
    Engine(
        "flower",
        "Flower's ServerApp/ClientApp (Ray runtime, or inline)",
        _run_flower,
        _resume_flower,
        _flower_in_dir,
    )
)
register_engine(
    Engine(
        "flower-loopback",
        "a Flower deployment on this machine (SuperLink + one SuperNode per client)",
        _run_loopback,
    )
)


def run_engine(config: ExperimentConfig, options: EngineOptions | None = None) -> EngineResult:
    """Run ``config`` on the engine ``run.engine`` names (an unknown name fails first, with
    the valid ones)."""
    engine = ENGINE_REGISTRY.get(config.run.engine)
    from protofl.methods.scope import warn_mechanism_scope

    warn_mechanism_scope(config)
    return engine.run(config, options or EngineOptions())


def in_dir_engine(config: ExperimentConfig) -> Engine:
    """The engine ``run.engine`` names, if it can run in a given folder (a sweep point's);
    else a one-line :class:`~protofl.errors.ConfigError` naming ``run.engine`` and the engines
    that can (an unknown name fails too, with the valid ones)."""
    name = config.run.engine
    try:
        engine = ENGINE_REGISTRY.get(name)
    except ValueError as exc:
        raise ConfigError(f"run.engine={name!r}: {exc}") from None
    if engine.run_in_dir is None:
        able = [n for n in ENGINE_REGISTRY.names() if ENGINE_REGISTRY.get(n).run_in_dir]
        raise ConfigError(
            f"run.engine={name!r} cannot run in a run folder it is given (a sweep point's): "
            f"it writes folders of its own making; use run.engine={' or '.join(able)}"
        )
    return engine


def run_engine_in_dir(
    config: ExperimentConfig,
    run_dir: str | Path,
    options: EngineOptions | None = None,
    *,
    resume: bool = False,
) -> EngineResult:
    """Run ``config`` in ``run_dir`` on the engine ``run.engine`` names: afresh, or with
    ``resume`` from the folder's last checkpoint (its run must be that engine's and that
    config's).  An engine that cannot (:func:`in_dir_engine`) is refused before anything is
    created.  Unlike :func:`run_engine`, no mechanism-scope warning: a sweep gives it once per
    point, not once per attempt."""
    engine = in_dir_engine(config)
    assert engine.run_in_dir is not None  # in_dir_engine refuses the others
    return engine.run_in_dir(config, Path(run_dir), options or EngineOptions(), resume)


def resume_run(
    run_dir: str | Path,
    options: EngineOptions | None = None,
    *,
    engine: str | None = None,
    extend: int = 0,
) -> EngineResult:
    """Continue ``run_dir`` (``extend`` > 0: a finished run, for that many more rounds) on the
    engine that made it; ``engine``, if given, must be that engine (else a one-line refusal)."""
    from protofl.engine.rundir import record_engine

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no config.yaml)")
    made_by = record_engine(run_dir)
    what = "extended" if extend else "resumed"
    if engine is not None and engine != made_by:
        raise ConfigError(
            f"{run_dir}: this run was made by the {made_by!r} engine and is {what} only on it, "
            f"not on the {engine!r} engine (drop --engine)"
        )
    if made_by not in ENGINE_REGISTRY:
        raise ConfigError(
            f"{run_dir}: this run was made by the {made_by!r} engine, which cannot be {what} "
            "here (a Flower deployment's SuperNodes are not protofl's to restart); start a new run"
        )
    found = ENGINE_REGISTRY.get(made_by)
    if found.resume is None:
        raise ConfigError(f"{run_dir}: the {made_by!r} engine cannot continue a run; start anew")
    return found.resume(run_dir, options or EngineOptions(), extend)
