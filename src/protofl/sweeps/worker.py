"""Sweep workers: one point (or one fused group) run in a worker process, through the engine
registry; orphaned workers exit with their driver."""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import protofl.yamlio as yamlio
from protofl.config import ExperimentConfig
from protofl.sweeps.plan import ERROR_FILE, FUSED_ENGINE

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# the worker
# --------------------------------------------------------------------------------------------
def _init_worker(hook_modules: Sequence[str] = ()) -> None:
    import torch

    from protofl.engine.hooks import load_hook_modules

    # the driver's diagnostic hooks (run.mia_every: protofl.attacks registers one), registered
    # here too: a point runs in a worker as it would in the driver
    load_hook_modules(hook_modules)

    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    _exit_with_driver()


ORPHAN_EXIT = 75


def _exit_with_driver() -> None:
    """Make this worker exit as soon as the sweep process that started it is gone.

    A worker forked from the forkserver is not the driver's child: when the driver is killed
    (``kill -9``, the OOM killer, a closed terminal) nothing stops the worker, which would go on
    writing rounds and checkpoints into the sweep folder, racing a resumed sweep.  The parent's
    sentinel (a pipe the driver holds) becomes readable when the driver dies; a daemon thread
    waits on it and ends the process.  The run resumes from its last checkpoint next time,
    exactly as after a kill of the whole process group.
    """
    parent = multiprocessing.parent_process()
    if parent is None:  # not a multiprocessing child (the inline driver)
        return

    def watch() -> None:
        parent.join()
        os._exit(ORPHAN_EXIT)

    threading.Thread(target=watch, name="protofl-orphan-watch", daemon=True).start()


def execute_point(
    run_dir: str,
    config_yaml: str,
    home: str | None,
    flower: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run (or resume) one grid point in ``run_dir`` on the engine its ``run.engine`` names
    (:func:`~protofl.engine.engines.run_engine_in_dir`; ``flower``: the Flower engine's options,
    :class:`~protofl.engine.engines.EngineOptions`); never raises: failures come back as
    ``{"status": "failed", "error": ..., "traceback": ...}`` (also written to ``error.txt``)."""
    from protofl.engine.checkpoint import CheckpointError
    from protofl.engine.engines import EngineOptions, run_engine_in_dir
    from protofl.methods.scope import warn_mechanism_scope

    t0 = time.perf_counter()
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / ERROR_FILE).unlink(missing_ok=True)
    action, resumed_from = "ran", None
    try:
        config = ExperimentConfig.from_dict(yamlio.load(config_yaml) or {}, source=run_dir)
        warn_mechanism_scope(config)
        (path / "config.yaml").write_text(config.to_yaml())
        options = EngineOptions(
            progress=False, flower=dict(flower or {}), home=Path(home) if home else None
        )
        resume = (path / "checkpoints.json").exists()
        if resume:
            action = "resumed"
            resumed_from = _last_checkpoint_round(path)
        try:
            result = run_engine_in_dir(config, path, options, resume=resume)
        except CheckpointError as exc:
            log.warning("%s: %s; starting the run again from round 0", path, exc)
            for f in path.glob("checkpoint*"):
                f.unlink()
            action, resumed_from = "ran", None
            result = run_engine_in_dir(config, path, options, resume=False)
        s = result.summary
        return {
            "status": "done",
            "action": action,
            "resumed_from": resumed_from,
            "avg_acc": s.get("avg_acc"),
            "rounds": s.get("rounds"),
            "wall_s": time.perf_counter() - t0,
        }
    except BaseException as exc:  # a failed run must not stop the sweep
        if isinstance(exc, KeyboardInterrupt):
            raise
        tb = traceback.format_exc()
        line = f"{type(exc).__name__}: {exc}".strip().splitlines()
        error = line[0] if line else type(exc).__name__
        with contextlib.suppress(OSError):
            (path / ERROR_FILE).write_text(tb)
        return {
            "status": "failed",
            "action": action,
            "error": error,
            "traceback": tb,
            "wall_s": time.perf_counter() - t0,
        }


def _pool_execute(
    run_dir: str, config_yaml: str, home: str, flower: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """In a worker: the forkserver's environment is from when it started, so set the cache
    home the sweep resolved before running the point."""
    os.environ["PROTOFL_HOME"] = home
    return execute_point(run_dir, config_yaml, home, flower)


def execute_group(
    run_dirs: Sequence[str],
    config_yamls: Sequence[str],
    home: str | None,
    *,
    threads: int = 1,
    on_round: Callable[[int, Any], None] | None = None,
) -> list[dict[str, Any]]:
    """Run (or resume) a fused group of points as one batched program; never raises.

    A group that cannot fuse (:class:`~protofl.engine.fused.FusionUnavailable`), or whose fused
    program fails, runs its points one by one (:func:`execute_point`, resuming from their
    checkpoints); each outcome's ``note`` then says why."""
    from protofl.engine.fused import FusedMember, FusionUnavailable, run_fused

    t0 = time.perf_counter()
    paths = [Path(d) for d in run_dirs]
    try:
        members: list[FusedMember] = []
        starts: list[tuple[str, int | None]] = []
        for path, text in zip(paths, config_yamls):
            config = ExperimentConfig.from_dict(yamlio.load(text) or {}, source=str(path))
            if config.run.engine != FUSED_ENGINE:  # fusion_groups never groups such points
                raise FusionUnavailable(
                    f"run.engine={config.run.engine!r} (only the {FUSED_ENGINE} engine fuses)"
                )
            path.mkdir(parents=True, exist_ok=True)
            (path / ERROR_FILE).unlink(missing_ok=True)
            (path / "config.yaml").write_text(config.to_yaml())
            resume = (path / "checkpoints.json").exists()
            members.append(FusedMember(config, path, resume))
            starts.append(("resumed", _last_checkpoint_round(path)) if resume else ("ran", None))
        results = run_fused(
            members, home=Path(home) if home else None, threads=threads, on_round=on_round
        )
    except FusionUnavailable as exc:
        return _one_by_one(run_dirs, config_yamls, home, f"not fused: {exc}")
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        line = (f"{type(exc).__name__}: {exc}".strip().splitlines() or [""])[0]
        note = f"the fused program stopped ({line}); its runs continued one by one"
        return _one_by_one(run_dirs, config_yamls, home, note)
    wall = time.perf_counter() - t0
    return [
        {
            "status": "done",
            "action": action,
            "resumed_from": resumed_from,
            "avg_acc": r.summary.get("avg_acc"),
            "rounds": r.summary.get("rounds"),
            "wall_s": wall,
        }
        for r, (action, resumed_from) in zip(results, starts)
    ]


def _one_by_one(
    run_dirs: Sequence[str], config_yamls: Sequence[str], home: str | None, note: str
) -> list[dict[str, Any]]:
    outs = []
    for d, text in zip(run_dirs, config_yamls):
        out = execute_point(d, text, home)
        out["fused"] = False
        out["note"] = note
        outs.append(out)
    return outs


def _pool_execute_group(
    run_dirs: list[str], config_yamls: list[str], home: str, threads: int
) -> list[dict[str, Any]]:
    """In a worker: :func:`execute_group` (see :func:`_pool_execute`)."""
    os.environ["PROTOFL_HOME"] = home
    return execute_group(run_dirs, config_yamls, home, threads=threads)


def _last_checkpoint_round(run_dir: Path) -> int | None:
    try:
        index = json.loads((run_dir / "checkpoints.json").read_text())
        return int(index[-1]["round"]) if index else None
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def _rounds_done(run_dir: Path) -> int:
    try:
        with open(run_dir / "metrics.jsonl", "rb") as fh:
            return sum(1 for line in fh if line.strip())
    except OSError:
        return 0


def _mp_context() -> Any:
    """forkserver (the engine imported once in the server, workers fork from it), else spawn."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch._dynamo", "protofl.engine.runner", "protofl.methods"])
        return ctx
    return multiprocessing.get_context("spawn")
