"""Running a sweep: choosing a setting on validation (``select:``), then the driver that
schedules points (and fused groups) on workers, resumes, reports progress and writes the status
(see :mod:`protofl.sweeps`)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from protofl.config import ConfigError
from protofl.engine.rundir import terminate_as_interrupt as _terminate_as_interrupt
from protofl.sweeps.plan import (
    ERROR_FILE,
    FUSED_ENGINE,
    LOG_FILE,
    SELECT_DIR,
    SELECTION_FILE,
    SweepPlan,
    SweepPoint,
    ValidationPoint,
    _show,
    check_engines,
    make_points,
)
from protofl.sweeps.privacy import _record_privacy
from protofl.sweeps.status import (
    RunStatus,
    SweepResult,
    _existing_config_problem,
    _read_summary,
    _write_status,
    run_is_done,
)
from protofl.sweeps.worker import (
    _init_worker,
    _mp_context,
    _pool_execute,
    _pool_execute_group,
    _rounds_done,
    execute_group,
    execute_point,
)

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# select: choosing a setting on validation splits
# --------------------------------------------------------------------------------------------
def _score(summary: Mapping[str, Any], metric: str) -> float:
    """A finished run's AVG under ``metric`` (``headline``: the run's own ``run.headline``)."""
    if metric == "headline":
        headline = summary.get("headline")
        if isinstance(headline, Mapping) and headline.get("avg_acc") is not None:
            return float(headline["avg_acc"])
        return float(summary["avg_acc"])
    return float(summary["avg_acc_last5" if metric == "last5" else "avg_acc"])


@dataclass
class SelectionResult:
    """What a selection sweep did: its validation runs, its test runs and the record."""

    sweep_dir: Path
    validation: SweepResult
    test: SweepResult
    record: dict[str, Any]

    @property
    def failed(self) -> list[RunStatus]:
        """Validation and test runs that failed."""
        return self.validation.failed + self.test.failed


def choose(plan: SweepPlan, select_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """From the finished validation runs in ``select_dir``: the selection record (per group:
    every candidate's validation accuracies and the choice) and, for every grid point of a
    group that could choose, its test overrides (``grid_index`` and ``overrides``)."""
    sel = plan.select
    assert sel is not None
    groups: dict[tuple[Any, ...], list[SweepPoint]] = {}
    for p in plan.points:
        groups.setdefault(tuple(_show(p.overrides.get(k)) for k in sel.per), []).append(p)
    by_point: dict[tuple[int, int], ValidationPoint] = {
        (v.grid_index, v.value_index): v for v in plan.validation
    }
    record: dict[str, Any] = {
        "key": sel.key,
        "grid": sel.values,
        "validation_fraction": sel.validation_fraction,
        "metric": sel.metric,
        "per": list(sel.per),
        "selected_on": "a seeded validation split of every client's training data "
        "(data.validation_fraction); the test set is not read during selection",
        "groups": [],
    }
    tests: list[dict[str, Any]] = []
    for members in groups.values():
        entry: dict[str, Any] = {
            "group": {k: members[0].overrides.get(k) for k in sel.per},
            "validation": [],
        }
        means: list[float] = []
        missing: list[str] = []
        for j, value in enumerate(sel.values):
            runs: dict[str, float] = {}
            for p in members:
                v = by_point[(p.index, j)]
                summary = _read_summary(select_dir / v.point.dirname)
                if summary is None or "avg_acc" not in summary:
                    missing.append(f"{SELECT_DIR}/{v.point.dirname}")
                    continue
                runs[f"{SELECT_DIR}/{v.point.dirname}"] = _score(summary, sel.metric)
            mean = sum(runs.values()) / len(runs) if len(runs) == len(members) else None
            entry["validation"].append({"value": value, "avg_acc": mean, "runs": runs})
            if mean is not None:
                means.append(mean)
        if missing:
            entry["status"] = "failed"
            entry["error"] = "validation runs did not finish: " + ", ".join(missing)
            entry["chosen"] = None
        else:
            best = max(range(len(means)), key=lambda i: (means[i], -i))  # ties: listed first
            entry["status"] = "chosen"
            entry["chosen"] = sel.values[best]
            for p in members:
                tests.append(
                    {
                        "grid_index": p.index,
                        "overrides": {**p.overrides, sel.key: sel.values[best]},
                    }
                )
        record["groups"].append(entry)
    return record, tests


def run_selection(
    plan: SweepPlan,
    *,
    sweep_dir: str | Path | None = None,
    jobs: int | None = None,
    home: Path | None = None,
    progress: bool = True,
    warm_cache: bool = True,
    flower: Mapping[str, Any] | None = None,
) -> SelectionResult:
    """Run a ``select:`` sweep: the validation runs, the choice per group, then the test runs
    at the chosen values; writes ``selection.json`` (see the module docstring).  ``flower``:
    as :func:`run_sweep`."""
    from protofl.engine.rundir import FolderLock

    if plan.select is None:
        raise ValueError(f"sweep {plan.name} has no select: section")
    check_engines(plan.points, plan.source)  # before the sweep folder exists
    sweep_dir = Path(sweep_dir) if sweep_dir is not None else plan.default_dir()
    select_dir = sweep_dir / SELECT_DIR
    with FolderLock(sweep_dir, "sweep"):
        vplan = SweepPlan(
            name=f"{plan.name}-select",
            base=plan.base,
            grid=plan.grid,
            points=[v.point for v in plan.validation],
            source=plan.source,
            description=f"validation runs choosing {plan.select.key} for sweep {plan.name}",
            fuse=plan.fuse,
        )
        vres = run_sweep(
            vplan,
            sweep_dir=select_dir,
            jobs=jobs,
            home=home,
            progress=progress,
            warm_cache=warm_cache,
            flower=flower,
        )
        record, tests = choose(plan, select_dir)
        tpoints = make_points(
            plan.base,
            [t["overrides"] for t in tests],
            plan.name,
            plan.source,
            dir_index=[t["grid_index"] for t in tests],
        )
        tplan = SweepPlan(
            name=plan.name,
            base=plan.base,
            grid=plan.grid,
            points=tpoints,
            source=plan.source,
            description=plan.description,
            fuse=plan.fuse,
        )
        tres = _run_sweep(
            tplan,
            sweep_dir=sweep_dir,
            jobs=jobs,
            home=home,
            progress=progress,
            warm_cache=warm_cache,
            on_update=None,
            fuse=plan.fuse,
            flower=flower,
        )
        _record_tests(record, plan, tpoints, tests, sweep_dir)
        _record_privacy(record, plan, tpoints, sweep_dir)
        from protofl.data.cache import atomic_write_bytes

        atomic_write_bytes(
            sweep_dir / SELECTION_FILE,
            (json.dumps(record, indent=1, default=str) + "\n").encode(),
        )
    return SelectionResult(sweep_dir=sweep_dir, validation=vres, test=tres, record=record)


def _record_tests(
    record: dict[str, Any],
    plan: SweepPlan,
    tpoints: Sequence[SweepPoint],
    tests: Sequence[Mapping[str, Any]],
    sweep_dir: Path,
) -> None:
    """Add each group's test accuracy at its chosen value (mean over its runs) to ``record``."""
    sel = plan.select
    assert sel is not None
    for entry in record["groups"]:
        if entry["chosen"] is None:
            continue
        runs: dict[str, float] = {}
        for point in tpoints:
            if all(_show(point.overrides.get(k)) == _show(v) for k, v in entry["group"].items()):
                summary = _read_summary(sweep_dir / point.dirname)
                if summary is not None and "avg_acc" in summary:
                    runs[point.dirname] = _score(summary, sel.metric)
        entry["test"] = {
            "value": entry["chosen"],
            "avg_acc": sum(runs.values()) / len(runs) if runs else None,
            "runs": runs,
        }


def format_selection(record: Mapping[str, Any]) -> str:
    """One line per group: the validation accuracy of every candidate, the choice, its test."""
    lines = [
        f"{record['key']} chosen on validation splits ({record['validation_fraction']:g} of "
        f"every client's training data, metric {record['metric']}); the test set was not read "
        "while choosing"
    ]
    for entry in record["groups"]:
        label = ", ".join(f"{k}={_show(v)}" for k, v in entry["group"].items()) or "all"
        shown = ", ".join(
            f"{_show(c['value'])}: "
            + ("-" if c["avg_acc"] is None else f"{100 * c['avg_acc']:.2f}")
            for c in entry["validation"]
        )
        if entry["chosen"] is None:
            lines.append(f"  {label}: validation AVG {shown}; no choice ({entry['error']})")
            if isinstance(entry.get("privacy"), Mapping):
                lines.append(f"    privacy: {entry['privacy']['statement']}")
            continue
        test = entry.get("test", {}).get("avg_acc")
        test_text = "not finished" if test is None else f"{100 * test:.2f}"
        lines.append(
            f"  {label}: validation AVG {shown} -> {record['key']}={_show(entry['chosen'])}, "
            f"test AVG {test_text}"
        )
        if isinstance(entry.get("privacy"), Mapping):
            lines.append(f"    privacy: {entry['privacy']['statement']}")
    if isinstance(record.get("privacy"), Mapping) and len(record["groups"]) > 1:
        lines.append(f"  privacy of the whole selection: {record['privacy']['statement']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------------------------
ProgressFn = Callable[[Sequence[RunStatus], int, int], None]


def run_sweep(
    plan: SweepPlan,
    *,
    sweep_dir: str | Path | None = None,
    jobs: int | None = None,
    home: Path | None = None,
    progress: bool = True,
    warm_cache: bool = True,
    on_update: ProgressFn | None = None,
    fuse: bool | None = None,
    flower: Mapping[str, Any] | None = None,
) -> SweepResult:
    """Run every grid point that is not yet complete; failed points do not stop the others.

    ``jobs`` worker processes (default: the number of cores) each run one point (or one fused
    group) at a time with one torch thread.  ``warm_cache`` first computes the frozen features
    of every distinct data set-up once in this process, so the workers only read the shared
    cache.  ``fuse`` (default: the plan's ``fuse:``, true) runs compatible batched points as
    fused groups (see the module doc).  Each point runs on its ``run.engine``; ``flower``: the
    options of a ``run.engine: flower`` point (``backend``, ``num_cpus``, ``round_timeout``,
    ``ray_address``, as :class:`~protofl.engine.engines.EngineOptions`'s ``flower``).
    """
    from protofl.engine.rundir import FolderLock

    if plan.select is not None:
        raise ValueError(f"sweep {plan.name} selects {plan.select.key}: run it with run_selection")
    check_engines(plan.points, plan.source)  # before the sweep folder exists
    sweep_dir = Path(sweep_dir) if sweep_dir is not None else plan.default_dir()
    with FolderLock(sweep_dir, "sweep"):  # one sweep at a time in a folder
        return _run_sweep(
            plan,
            sweep_dir=sweep_dir,
            jobs=jobs,
            home=home,
            progress=progress,
            warm_cache=warm_cache,
            on_update=on_update,
            fuse=plan.fuse if fuse is None else fuse,
            flower=flower,
        )


def _run_sweep(
    plan: SweepPlan,
    *,
    sweep_dir: Path,
    jobs: int | None,
    home: Path | None,
    progress: bool,
    warm_cache: bool,
    on_update: ProgressFn | None,
    fuse: bool = True,
    flower: Mapping[str, Any] | None = None,
) -> SweepResult:
    from protofl.data.cache import protofl_home

    t0 = time.perf_counter()
    home = Path(home) if home is not None else protofl_home()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    jobs = max(1, jobs or os.cpu_count() or 1)
    # refuse a folder that holds other runs under our names, before anything runs
    problems = []
    for p in plan.points:
        why = _existing_config_problem(p.run_dir(sweep_dir), p.config)
        if why:
            problems.append(f"{p.run_dir(sweep_dir)}: {why}")
    if problems:
        raise ConfigError(
            f"sweep folder {sweep_dir} holds runs that do not belong to this sweep; use another "
            "--out or delete them:\n  " + "\n  ".join(problems[:5])
        )
    runs = [
        RunStatus(index=p.index, dir=p.dirname, overrides=p.overrides, rounds=0)
        for p in plan.points
    ]
    todo: list[SweepPoint] = []
    for p, st in zip(plan.points, runs):
        d = p.run_dir(sweep_dir)
        if run_is_done(d):
            st.status, st.action = "done", "reused"
            summary = json.loads((d / "summary.json").read_text())
            st.avg_acc, st.rounds = summary.get("avg_acc"), int(summary.get("rounds", 0))
        else:
            todo.append(p)
    total_rounds = sum(p.config.federation.rounds for p in plan.points)
    _write_status(sweep_dir, plan, runs, jobs=jobs)

    display = _Display(plan, runs, total_rounds, enabled=progress)
    try:
        with display, _terminate_as_interrupt():
            if warm_cache and jobs > 1 and len(todo) > 1:
                _warm_feature_cache(todo, home, display)
            _drive(plan, todo, runs, sweep_dir, jobs, home, display, on_update, fuse, flower)
    except KeyboardInterrupt:
        for st in runs:
            if st.status in ("running", "pending"):
                st.status = "stopped"
        _write_status(sweep_dir, plan, runs, jobs=jobs, interrupted=True)
        raise
    wall = time.perf_counter() - t0
    _write_status(sweep_dir, plan, runs, jobs=jobs, wall_s=wall)
    return SweepResult(sweep_dir=sweep_dir, runs=runs, wall_s=wall)


def resume_command(
    sweep_file: str | Path,
    sweep_dir: str | Path,
    sets: Sequence[str] = (),
    *,
    select: str | None = None,
    no_fuse: bool = False,
) -> str:
    """The exact ``protofl sweep`` command that continues a stopped sweep in ``sweep_dir``:
    the same file, grid changes (``--set``) and selection, the folder as ``--out`` (finished
    runs are reused, stopped ones resume from their last checkpoint)."""
    argv = ["protofl", "sweep", str(sweep_file), "--out", str(sweep_dir)]
    for item in sets:
        argv += ["--set", item]
    if select is not None:
        argv += ["--select", select]
    if no_fuse:
        argv.append("--no-fuse")
    return shlex.join(argv)


def fusion_groups(todo: Sequence[SweepPoint], fuse: bool = True) -> list[list[SweepPoint]]:
    """The sweep's tasks in order: a fused group (``sim`` points whose configs have one
    :func:`~protofl.engine.fused.fusion_key`) or a single point (any other engine's points
    among them: they run on their own engine)."""
    if not fuse:
        return [[p] for p in todo]
    from protofl.engine.fused import fusion_key

    tasks: list[list[SweepPoint]] = []
    by_key: dict[str, list[SweepPoint]] = {}
    for p in todo:
        key = fusion_key(p.config) if p.config.run.engine == FUSED_ENGINE else None
        if key is None:
            tasks.append([p])
        elif key in by_key:
            by_key[key].append(p)
        else:
            by_key[key] = [p]
            tasks.append(by_key[key])
    return tasks


def _sweep_log(sweep_dir: Path, text: str, *, warn: bool = False) -> None:
    """A line in the sweep folder's ``sweep.log`` (and the log)."""
    (log.warning if warn else log.info)("sweep %s: %s", sweep_dir.name, text)
    stamp = datetime.now().isoformat(timespec="seconds")
    with contextlib.suppress(OSError), open(sweep_dir / LOG_FILE, "a") as fh:
        fh.write(f"{stamp} {text}\n")


def _announce(sweep_dir: Path, runs: list[RunStatus], tasks: list[list[SweepPoint]]) -> None:
    number = 0
    for task in tasks:
        if len(task) < 2:
            continue
        number += 1
        for p in task:
            runs[p.index].fused = number
        _sweep_log(
            sweep_dir,
            f"fused group {number}: {len(task)} runs as one batched program "
            f"({', '.join(p.dirname for p in task)})",
        )


def _report(sweep_dir: Path, st: RunStatus, out: Mapping[str, Any], reported: set[str]) -> None:
    note = out.get("note")
    line = f"fused group {st.fused}: {note}"
    if note and line not in reported:  # once a group (its runs share the note)
        reported.add(line)
        _sweep_log(sweep_dir, line, warn=True)


def _drive(
    plan: SweepPlan,
    todo: list[SweepPoint],
    runs: list[RunStatus],
    sweep_dir: Path,
    jobs: int,
    home: Path | None,
    display: _Display,
    on_update: ProgressFn | None,
    fuse: bool = True,
    flower: Mapping[str, Any] | None = None,
) -> None:
    if not todo:
        display.refresh(sweep_dir)
        return
    by_index = {p.index: p for p in plan.points}
    tasks = fusion_groups(todo, fuse)
    _announce(sweep_dir, runs, tasks)
    if jobs == 1 or (len(tasks) == 1 and len(tasks[0]) > 1):
        # one fused group and nothing else: in this process, with the cores as threads
        _drive_inline(
            plan, tasks, runs, sweep_dir, home, display, on_update, threads=jobs, flower=flower
        )
        return
    workers = min(jobs, len(tasks))
    threads = max(1, jobs // workers)
    from protofl.engine.hooks import hook_modules

    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=_mp_context(),
        initializer=_init_worker,
        initargs=(tuple(hook_modules()),),
    )
    futures: dict[Future[Any], list[int]] = {}
    reported: set[str] = set()
    try:
        for task in tasks:
            for p in task:
                d = p.run_dir(sweep_dir)
                d.mkdir(parents=True, exist_ok=True)
                (d / "config.yaml").write_text(p.config.to_yaml())
                runs[p.index].status = "running"
            fut: Future[Any]
            if len(task) == 1:
                p = task[0]
                d = p.run_dir(sweep_dir)
                fut = pool.submit(
                    _pool_execute, str(d), p.config.to_yaml(), str(home), dict(flower or {})
                )
            else:
                fut = pool.submit(
                    _pool_execute_group,
                    [str(p.run_dir(sweep_dir)) for p in task],
                    [p.config.to_yaml() for p in task],
                    str(home),
                    threads,
                )
            futures[fut] = [p.index for p in task]
        _write_status(sweep_dir, plan, runs, jobs=jobs)
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for fut in done:
                members = futures[fut]
                try:
                    result = fut.result()
                    outs: list[dict[str, Any]] = result if isinstance(result, list) else [result]
                except BrokenProcessPool as exc:
                    outs = [{"status": "failed", "error": f"worker process died ({exc})"}] * len(
                        members
                    )
                except Exception as exc:  # pragma: no cover - execute_point catches its own
                    outs = [{"status": "failed", "error": f"{type(exc).__name__}: {exc}"}] * len(
                        members
                    )
                for i, out in zip(members, outs):
                    _report(sweep_dir, runs[i], out, reported)
                    _apply(runs[i], out)
            if done:
                _write_status(sweep_dir, plan, runs, jobs=jobs)
            for st in runs:
                if st.status == "running":
                    st.rounds = min(
                        _rounds_done(sweep_dir / st.dir),
                        by_index[st.index].config.federation.rounds,
                    )
            display.refresh(sweep_dir)
            if on_update is not None:
                on_update(runs, sum(r.rounds for r in runs), display.total_rounds)
    except BaseException:
        # stop now: kill the workers (their runs resume from the last checkpoint next time)
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.terminate()
        raise
    else:
        pool.shutdown(wait=True)


def _apply(st: RunStatus, out: Mapping[str, Any]) -> None:
    st.status = out["status"]
    st.action = out.get("action")
    st.error = out.get("error")
    st.resumed_from = out.get("resumed_from")
    st.avg_acc = out.get("avg_acc")
    st.wall_s = out.get("wall_s")
    if "fused" in out and not out["fused"]:
        st.fused = None
    st.note = out.get("note")
    if out.get("rounds") is not None:
        st.rounds = int(out["rounds"])
    if st.status == "failed":
        log.info("sweep run %s failed: %s", st.dir, st.error)


def _drive_inline(
    plan: SweepPlan,
    tasks: list[list[SweepPoint]],
    runs: list[RunStatus],
    sweep_dir: Path,
    home: Path | None,
    display: _Display,
    on_update: ProgressFn | None,
    threads: int = 1,
    flower: Mapping[str, Any] | None = None,
) -> None:
    """Run the tasks one after another in this process (no worker start-up)."""
    jobs = threads
    reported: set[str] = set()
    for task in tasks:
        for p in task:
            runs[p.index].status = "running"
            d = p.run_dir(sweep_dir)
            d.mkdir(parents=True, exist_ok=True)
            (d / "config.yaml").write_text(p.config.to_yaml())
        _write_status(sweep_dir, plan, runs, jobs=jobs)
        display.refresh(sweep_dir)
        if len(task) == 1:
            p = task[0]
            d = p.run_dir(sweep_dir)
            outs = [execute_point(str(d), p.config.to_yaml(), str(home) if home else None, flower)]
        else:

            def on_round(member: int, m: Any, task: list[SweepPoint] = task) -> None:
                runs[task[member].index].rounds = int(m.round)
                display.refresh(sweep_dir)
                if on_update is not None:
                    on_update(runs, sum(r.rounds for r in runs), display.total_rounds)

            outs = execute_group(
                [str(p.run_dir(sweep_dir)) for p in task],
                [p.config.to_yaml() for p in task],
                str(home) if home else None,
                threads=threads,
                on_round=on_round,
            )
        for p, out in zip(task, outs):
            _report(sweep_dir, runs[p.index], out, reported)
            _apply(runs[p.index], out)
        _write_status(sweep_dir, plan, runs, jobs=jobs)
        display.refresh(sweep_dir)
        if on_update is not None:
            on_update(runs, sum(r.rounds for r in runs), display.total_rounds)


def _warm_feature_cache(todo: Sequence[SweepPoint], home: Path | None, display: _Display) -> None:
    """Build each distinct data set-up once here, so parallel workers only read the cache."""
    from protofl.data.cache import protofl_home
    from protofl.engine.federated_data import build_federated_data

    keys: dict[str, SweepPoint] = {}
    count: dict[str, int] = {}
    for p in todo:
        cfg = p.config
        if not cfg.backbone.feature_cache:
            continue
        key = json.dumps(
            [
                cfg.to_dict()["data"],
                cfg.backbone.name,
                cfg.backbone.options,
                cfg.backbone.image_size,
                cfg.seed,
            ],
            sort_keys=True,
            default=str,
        )
        keys.setdefault(key, p)
        count[key] = count.get(key, 0) + 1
    # a set-up used by one run only is left to that run
    keys = {k: p for k, p in keys.items() if count[k] > 1}
    if not keys:
        return
    home = home or protofl_home()
    for i, p in enumerate(keys.values()):
        display.note(f"preparing features {i + 1}/{len(keys)}")
        try:
            build_federated_data(p.config, home)
        except Exception as exc:  # the run itself will fail and report it
            log.info("feature cache for grid point %d not prepared: %s", p.index, exc)
    display.note("")


class _Display:
    """One rich progress bar for the whole grid (rounds of all runs, runs done and failed)."""

    def __init__(
        self, plan: SweepPlan, runs: list[RunStatus], total_rounds: int, *, enabled: bool
    ) -> None:
        self.plan = plan
        self.runs = runs
        self.total_rounds = total_rounds
        self.enabled = enabled
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> _Display:
        if not self.enabled:
            return self
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn(f"[bold]sweep {self.plan.name}"),
            BarColumn(),
            TextColumn("rounds {task.completed}/{task.total}"),
            TextColumn("runs {task.fields[done]}/{task.fields[n]}"),
            TextColumn("[red]{task.fields[failed]}"),
            TextColumn("{task.fields[note]}"),
            TimeElapsedColumn(),
        )
        self._progress.start()
        self._task = self._progress.add_task(
            "sweep", total=self.total_rounds, done=0, n=len(self.runs), failed="", note=""
        )
        self.refresh(None)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def note(self, text: str) -> None:
        """Show a short status text next to the bar."""
        if self._progress is not None:
            self._progress.update(self._task, note=text)

    def refresh(self, sweep_dir: Path | None) -> None:
        """Redraw from the run statuses."""
        if self._progress is None:
            return
        done = sum(1 for r in self.runs if r.status == "done")
        failed = sum(1 for r in self.runs if r.status == "failed")
        running = [r.dir for r in self.runs if r.status == "running"]
        rounds = sum(r.rounds if r.status != "failed" else 0 for r in self.runs) + sum(
            p.config.federation.rounds
            for p, r in zip(self.plan.points, self.runs)
            if r.status == "failed"
        )
        note = f"running {len(running)}" if running else ""
        self._progress.update(
            self._task,
            completed=min(rounds, self.total_rounds),
            done=done,
            failed=f"failed {failed}" if failed else "",
            note=note,
        )


def format_sweep_result(result: SweepResult) -> str:
    """The closing summary: counts, then every failed run with its error line."""
    n = len(result.runs)
    done = sum(1 for r in result.runs if r.status == "done")
    lines = [
        f"sweep {result.sweep_dir}: {done}/{n} runs complete "
        f"({result.count('reused')} already done, {result.count('ran')} ran, "
        f"{result.count('resumed')} resumed), {len(result.failed)} failed, "
        f"{_duration(result.wall_s)}"
    ]
    for r in result.failed:
        lines.append(f"  FAILED {r.dir}: {r.error}")
        err = result.sweep_dir / r.dir / ERROR_FILE
        if err.exists():
            lines.append(f"         traceback: {err}")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
