"""Grids of experiments: validate every point first, run them in parallel worker processes,
skip finished runs, resume stopped ones, and record the status of each in ``sweep.json``.

A sweep file::

    name: vpdr-vs-igpp            # optional (default: the file's stem)
    base: configs/digits4.yaml    # a config mapping, or a path (relative to the sweep file)
    grid:                         # dotted config key -> list of values (cartesian product)
      method.name: [fedproto, fpl]
      privacy.mechanism: [igpp, vpdr]
      privacy.epsilon: [0.5, 1.0]
      seed: [0, 1, 2]

Every grid point gets a deterministic folder ``<sweep_dir>/<index>-<slug>`` (a normal run folder).
A point whose folder holds ``summary.json`` is done and is skipped; one with checkpoints is
resumed from its last complete round; anything else starts afresh.  Each point runs on the
engine its ``run.engine`` names (:func:`protofl.engine.engines.run_engine_in_dir`: ``sim``, or
``flower`` with the sweep's ``flower`` options); an engine that cannot run in a given folder
(``flower-loopback``) is refused, naming ``run.engine``, before anything is created.

Fused runs (``fuse:``, default ``true``; ``protofl sweep --no-fuse`` turns it off)::

    fuse: true                    # run compatible points as one batched program

Points with ``federation.execution: batched`` that differ only in ``seed`` and ``privacy.*``
settings (mechanism, epsilon, noise seed, clip radius, ...; with DCR on, the DCR settings
must agree, since DCR trains with them; its soft clip takes each run's clip radius) form a
fused group: their clients train, evaluate and upload in one batched program
(:mod:`protofl.engine.fused`), each run keeping its own server step, ledger, noise streams and
run folder; results equal the separate runs to float rounding.  A group whose runs turn out
not to fit together (model shapes, a method that cannot batch, ...) runs its points one by one;
``sweep.log`` and each run's ``note`` in ``sweep.json`` say why.  Sequential points (the
default execution) never fuse, nor do points of another engine than ``sim`` (a fused group is
the in-process simulator's program): a ``run.engine: flower`` point always runs on its own.

Selecting a setting without looking at the test set (``select:``)::

    select:
      key: privacy.clip            # the setting to choose (not a grid axis)
      values: [5, 10, 15, 20]      # the candidates (default for privacy.clip: VPDR's grid)
      validation_fraction: 0.2     # share of every client's training data held out (default)
      metric: headline             # headline (each run's run.headline) | final | last5
      per: [method.name, privacy.mechanism]   # default: every grid axis but the seed

For every group of grid points that agree on ``per`` and every candidate value, one validation
run per grid point (seed) trains with ``data.validation_fraction`` set, so it evaluates on the
held-out part of the clients' training data and never reads the test set
(``<sweep_dir>/select/``). The value with the best mean validation accuracy over the group's
runs is chosen (a tie goes to the value listed first), then every grid point of the group runs
once more on its full training data with that value and reports test accuracy
(``<sweep_dir>/<index>-<slug>``). ``selection.json`` records the candidates, every validation
accuracy, the choice and the test accuracy at the choice, and what the selection costs in
privacy (``privacy``, per group and for the whole selection): every run releases the same
clients' training data, so the DP events of all validation and test runs are composed per client
(:func:`selection_privacy`), and the choice itself (argmax over validation accuracy computed on
private training data) is stated as not covered (``complete: false``).  Every validation and
test run's ``summary.json`` gets the same statement as ``privacy.selection``.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import multiprocessing
import os
import re
import shlex
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

import protofl.yamlio as yamlio
from protofl.config import ConfigError, ExperimentConfig, set_dotted
from protofl.engine.rundir import terminate_as_interrupt as _terminate_as_interrupt
from protofl.registry import nearest

log = logging.getLogger(__name__)

SWEEP_KEYS = ("name", "description", "base", "grid", "select", "fuse")
STATUS_FILE = "sweep.json"
LOG_FILE = "sweep.log"
ERROR_FILE = "error.txt"
SELECT_KEYS = ("key", "values", "validation_fraction", "metric", "per")
SELECT_METRICS = ("headline", "final", "last5")
SELECT_DEFAULT_VALUES: dict[str, list[Any]] = {"privacy.clip": [5.0, 10.0, 15.0, 20.0]}
"""Candidates when ``select.values`` is not given: VPDR Sec. 5.1 grid-searches R over these."""
SELECT_DIR = "select"
SELECTION_FILE = "selection.json"
VALIDATION_KEY = "data.validation_fraction"


# --------------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SweepPoint:
    """One grid point: its overrides, its validated config and its folder name."""

    index: int
    overrides: dict[str, Any]
    config: ExperimentConfig
    dirname: str

    def run_dir(self, sweep_dir: Path) -> Path:
        """This point's run folder inside ``sweep_dir``."""
        return sweep_dir / self.dirname

    def label(self) -> str:
        """``key=value, ...`` (short keys) for messages."""
        return ", ".join(f"{k}={_show(v)}" for k, v in self.overrides.items()) or "(base)"


@dataclass(frozen=True)
class Selection:
    """``select:``: which setting to choose on validation splits, among which values."""

    key: str
    values: list[Any]
    validation_fraction: float = 0.2
    metric: str = "headline"
    per: tuple[str, ...] = ()
    """The grid axes whose values make one selection group (the others, the seed, are pooled)."""


@dataclass(frozen=True)
class ValidationPoint:
    """A validation run of a selection: grid point ``grid_index`` with candidate ``value``."""

    point: SweepPoint
    grid_index: int
    value_index: int


@dataclass
class SweepPlan:
    """A validated sweep: every point already holds an :class:`ExperimentConfig`."""

    name: str
    base: dict[str, Any]
    grid: dict[str, list[Any]]
    points: list[SweepPoint]
    source: str = "sweep"
    description: str = ""
    select: Selection | None = None
    validation: list[ValidationPoint] = field(default_factory=list)
    """With ``select``: the validation runs, built (and so checked) with the plan."""
    fuse: bool = True
    """Run compatible batched points as fused groups (``fuse:``; see the module doc)."""

    def default_dir(self) -> Path:
        """``<base run.out_dir>/<name>`` (so the same command finds the same sweep again)."""
        out = self.points[0].config.run.out_dir if self.points else "runs"
        return Path(out) / _safe(self.name)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "-", text).strip("-.") or "x"


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return "+".join(_show(v) for v in value)
    if isinstance(value, Mapping):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def point_slug(overrides: Mapping[str, Any], limit: int = 72) -> str:
    """A readable, filesystem-safe folder suffix: ``name-fedproto_epsilon-1_seed-0``."""
    parts = []
    for key, value in overrides.items():
        short = key.split(".")[-1]
        if isinstance(value, Mapping):
            shown = str(value.get("name", "")) or "cfg"
            shown += "-" + hashlib.sha256(_show(value).encode()).hexdigest()[:6]
        else:
            shown = _show(value)
        parts.append(f"{short}-{shown}")
    slug = _safe("_".join(parts)) if parts else "base"
    if len(slug) > limit:
        digest = hashlib.sha256(slug.encode()).hexdigest()[:8]
        slug = slug[: limit - 9].rstrip("-_.") + "-" + digest
    return slug


def _read_yaml(path: Path, what: str) -> Any:
    try:
        return yamlio.load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path} is not valid YAML: {exc}") from None


def load_sweep(
    path: str | Path, overrides: Sequence[str] = (), select: str | None = None
) -> SweepPlan:
    """Read a sweep file and validate every grid point (nothing runs).

    ``overrides`` are ``key=value`` strings (``protofl sweep --set``): a key that is a grid axis
    replaces that axis's values (``seed=[1, 2]`` runs only those seeds); any other key is set in
    the base config (``federation.checkpoint=false``). ``select`` (``protofl sweep --select``)
    is ``KEY`` or ``KEY=[values]``: it sets ``select.key`` (and ``select.values``), keeping the
    file's other ``select`` settings.
    """
    path = Path(path)
    data = _read_yaml(path, "sweep file")
    if not isinstance(data, Mapping):
        raise ConfigError(f"sweep file {path} must hold a mapping with base: and grid:")
    if overrides:
        data = apply_sweep_overrides(data, overrides, source=str(path), base_dir=path.parent)
    if select is not None:
        data = {**data, "select": _select_override(data.get("select"), select)}
    return plan_sweep(data, source=str(path), base_dir=path.parent, default_name=path.stem)


def apply_sweep_overrides(
    data: Mapping[str, Any],
    overrides: Sequence[str],
    *,
    source: str = "sweep",
    base_dir: Path | None = None,
) -> dict[str, Any]:
    """Return a copy of a sweep mapping with ``key=value`` overrides applied (see load_sweep)."""
    out = dict(data)
    base = json.loads(json.dumps(_resolve_base(data.get("base"), source, base_dir)))
    grid_raw = data.get("grid") or {}
    grid = dict(grid_raw) if isinstance(grid_raw, Mapping) else grid_raw
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} must look like key=value")
        key, raw = (part.strip() for part in item.split("=", 1))
        try:
            value = yamlio.load(raw) if raw else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {key}: {raw!r} is not valid YAML: {exc}") from None
        if isinstance(grid, dict) and key in grid:
            grid[key] = value if isinstance(value, list) else [value]
        else:
            try:
                set_dotted(base, key, value)
            except ConfigError as exc:
                raise ConfigError(f"--set {key}: {exc}") from None
    out["base"] = base
    out["grid"] = grid
    return out


def plan_sweep(
    data: Mapping[str, Any],
    *,
    source: str = "sweep",
    base_dir: Path | None = None,
    default_name: str = "sweep",
) -> SweepPlan:
    """Validate a sweep mapping into a plan; errors name the file, the point and the key."""
    for key in data:
        if key not in SWEEP_KEYS:
            raise ConfigError(
                f"{source}: unknown sweep key {key!r}{nearest(str(key), list(SWEEP_KEYS))}; "
                f"valid keys: {', '.join(SWEEP_KEYS)}"
            )
    base = _resolve_base(data.get("base"), source, base_dir)
    grid_raw = data.get("grid") or {}
    if not isinstance(grid_raw, Mapping):
        raise ConfigError(f"{source}: grid must map dotted config keys to lists of values")
    grid: dict[str, list[Any]] = {}
    for key, values in grid_raw.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{source}: grid key {key!r} must be a dotted config key")
        if not isinstance(values, list) or not values:
            raise ConfigError(
                f"{source}: grid.{key} must be a non-empty list of values, got {values!r}"
            )
        grid[key] = list(values)
    # every key must exist in the config: check it once on its own, naming the key
    for key, values in grid.items():
        _build_point(base, {key: values[0]}, source, key)
    name = str(data.get("name") or default_name)
    fuse = data.get("fuse", True)
    if not isinstance(fuse, bool):
        raise ConfigError(f"{source}: fuse must be true or false, got {fuse!r}")
    combos = list(itertools.product(*grid.values())) if grid else [()]
    points = make_points(base, [dict(zip(grid.keys(), c)) for c in combos], name, source)
    _check_registries(points, source)
    select = _parse_select(data.get("select"), base, grid, source)
    validation: list[ValidationPoint] = []
    if select is not None:
        pairs = [(p, j) for p in points for j in range(len(select.values))]
        vpoints = make_points(
            base,
            [
                {
                    **p.overrides,
                    select.key: select.values[j],
                    VALIDATION_KEY: select.validation_fraction,
                }
                for p, j in pairs
            ],
            f"{name}-select",
            source,
            what="validation run",
        )
        _check_registries(vpoints, source)
        validation = [ValidationPoint(v, p.index, j) for v, (p, j) in zip(vpoints, pairs)]
    return SweepPlan(
        name=name,
        base=base,
        grid=grid,
        points=points,
        source=source,
        description=str(data.get("description") or ""),
        select=select,
        validation=validation,
        fuse=fuse,
    )


def make_points(
    base: Mapping[str, Any],
    combos: Sequence[Mapping[str, Any]],
    name: str,
    source: str,
    *,
    dir_index: Sequence[int] | None = None,
    what: str = "grid point",
) -> list[SweepPoint]:
    """One validated :class:`SweepPoint` per override mapping, indexed in order; folder names
    ``<dir_index>-<slug>`` (default: the position); two points with one config fail."""
    points: list[SweepPoint] = []
    numbers = list(dir_index) if dir_index is not None else list(range(len(combos)))
    width = max(3, len(str(max(numbers, default=0))))
    seen: dict[str, int] = {}
    for index, (number, combo) in enumerate(zip(numbers, combos)):
        overrides = dict(combo)
        slug = point_slug(overrides)
        if "name" not in overrides:
            overrides_with_name = {**overrides, "name": f"{_safe(name)}-{slug}"}
        else:
            overrides_with_name = dict(overrides)
        label = ", ".join(f"{k}={_show(v)}" for k, v in overrides.items())
        config = _build_point(base, overrides_with_name, source, f"{what} {number} ({label})")
        fingerprint = json.dumps({**config.to_dict(), "name": None}, sort_keys=True)
        if fingerprint in seen:
            raise ConfigError(
                f"{source}: {what}s {seen[fingerprint]} and {number} give the same config "
                f"({label}); remove the duplicate value"
            )
        seen[fingerprint] = number
        points.append(
            SweepPoint(
                index=index,
                overrides=overrides,
                config=config,
                dirname=f"{number:0{width}d}-{slug}",
            )
        )
    return points


def _resolve_base(base: Any, source: str, base_dir: Path | None) -> dict[str, Any]:
    if base is None:
        return {}
    if isinstance(base, Mapping):
        return dict(base)
    if isinstance(base, str):
        candidates = [Path(base)]
        if base_dir is not None and not Path(base).is_absolute():
            candidates.insert(0, base_dir / base)
        for cand in candidates:
            if cand.is_file():
                loaded = _read_yaml(cand, "base config")
                if loaded is None:
                    return {}
                if not isinstance(loaded, Mapping):
                    raise ConfigError(f"base config {cand} must hold a mapping")
                return dict(loaded)
        raise ConfigError(
            f"{source}: base config {base!r} does not exist "
            f"(looked in: {', '.join(str(c) for c in candidates)})"
        )
    raise ConfigError(f"{source}: base must be a config mapping or a path, got {base!r}")


def _build_point(
    base: Mapping[str, Any], overrides: Mapping[str, Any], source: str, where: str
) -> ExperimentConfig:
    data = json.loads(json.dumps(base))  # deep copy of plain YAML data
    try:
        for key, value in overrides.items():
            set_dotted(data, key, value)
        return ExperimentConfig.from_dict(data, source=source)
    except (ConfigError, ValueError) as exc:
        raise ConfigError(f"{source}: {where}: {exc}") from None


def check_engines(points: Sequence[SweepPoint], source: str) -> None:
    """Every point's ``run.engine`` must run in a folder it is given (a sweep point's): an
    unknown engine, or one that writes only folders of its own making (``flower-loopback``),
    fails naming the point and ``run.engine``, before anything is created."""
    from protofl.engine.engines import in_dir_engine

    for p in points:
        try:
            in_dir_engine(p.config)
        except ConfigError as exc:
            raise ConfigError(f"{source}: grid point {p.index} ({p.label()}): {exc}") from None


def _check_registries(points: Sequence[SweepPoint], source: str) -> None:
    """Unknown data sets, backbones, methods or method parameters, and engines that cannot run
    a sweep point, fail before any run."""
    from protofl.engine.federated_data import preflight

    check_engines(points, source)
    checked: set[str] = set()
    for p in points:
        cfg = p.config
        key = json.dumps(
            [
                cfg.data.name,
                cfg.data.options,
                cfg.backbone.name,
                cfg.backbone.options,
                cfg.method.name,
                cfg.method.params,
            ],
            sort_keys=True,
            default=str,
        )
        if key in checked:
            continue
        checked.add(key)
        try:
            preflight(cfg)
        except (ConfigError, ValueError) as exc:
            raise ConfigError(f"{source}: grid point {p.index} ({p.label()}): {exc}") from None


# --------------------------------------------------------------------------------------------
# select: choosing a setting on validation splits
# --------------------------------------------------------------------------------------------
def _select_override(current: Any, text: str) -> dict[str, Any]:
    """``--select KEY`` or ``--select KEY=[values]`` over the file's ``select`` mapping."""
    out = dict(current) if isinstance(current, Mapping) else {}
    key, _, raw = (part.strip() for part in text.partition("="))
    if not key:
        raise ConfigError(f"--select {text!r} must look like KEY or KEY=[values]")
    if out.get("key") not in (None, key):
        out.pop("values", None)  # another key: the file's candidates were for the old one
    out["key"] = key
    if raw:
        try:
            out["values"] = yamlio.load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--select {key}: {raw!r} is not valid YAML: {exc}") from None
    return out


def _parse_select(
    raw: Any, base: Mapping[str, Any], grid: Mapping[str, list[Any]], source: str
) -> Selection | None:
    """Validate ``select:`` (a mapping, or just the key); errors name ``select.<key>``."""
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = {"key": raw}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: select must be a mapping with key: and values:, got {raw!r}")
    for k in raw:
        if k not in SELECT_KEYS:
            raise ConfigError(
                f"{source}: unknown select key {k!r}{nearest(str(k), list(SELECT_KEYS))}; "
                f"valid keys: {', '.join(SELECT_KEYS)}"
            )
    key = raw.get("key")
    if not isinstance(key, str) or not key:
        raise ConfigError(f"{source}: select.key must name a dotted config key, got {key!r}")
    if key in grid:
        raise ConfigError(
            f"{source}: select.key={key} is also a grid axis; remove it from grid: (select "
            "tries select.values itself)"
        )
    if key == VALIDATION_KEY or key in ("seed", "name"):
        raise ConfigError(f"{source}: select.key={key} cannot be selected")
    values = raw.get("values", SELECT_DEFAULT_VALUES.get(key))
    if values is None:
        raise ConfigError(f"{source}: select.values is required for select.key={key}")
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{source}: select.values must be a non-empty list, got {values!r}")
    if len({json.dumps(v, sort_keys=True, default=str) for v in values}) < len(values):
        raise ConfigError(f"{source}: select.values {values!r} lists a value twice")
    for v in values:  # the key exists and takes every candidate (one line, naming it)
        _build_point(base, {key: v}, source, f"select.key={key}, value {_show(v)}")
    fraction = raw.get("validation_fraction", 0.2)
    if not isinstance(fraction, int | float) or isinstance(fraction, bool) or not 0 < fraction < 1:
        raise ConfigError(
            f"{source}: select.validation_fraction={fraction!r} must be a number in (0, 1)"
        )
    metric = raw.get("metric", "headline")
    if metric not in SELECT_METRICS:
        raise ConfigError(
            f"{source}: select.metric={metric!r}; choose one of {', '.join(SELECT_METRICS)}"
        )
    per_raw = raw.get("per")
    if per_raw is None:
        per = tuple(k for k in grid if k not in ("seed", "name"))
    else:
        if isinstance(per_raw, str):
            per_raw = [per_raw]
        if not isinstance(per_raw, list) or any(k not in grid for k in per_raw):
            raise ConfigError(
                f"{source}: select.per={per_raw!r} must list grid axes ({', '.join(grid)})"
            )
        per = tuple(per_raw)
    return Selection(key, list(values), float(fraction), str(metric), per)


def _score(summary: Mapping[str, Any], metric: str) -> float:
    """A finished run's AVG under ``metric`` (``headline``: the run's own ``run.headline``)."""
    if metric == "headline":
        headline = summary.get("headline")
        if isinstance(headline, Mapping) and headline.get("avg_acc") is not None:
            return float(headline["avg_acc"])
        return float(summary["avg_acc"])
    return float(summary["avg_acc_last5" if metric == "last5" else "avg_acc"])


def _read_summary(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


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
# what a selection costs in privacy
# --------------------------------------------------------------------------------------------
VALIDATION_GAP = (
    "validation accuracy: every validation run evaluates on a held-out part of the clients' "
    "training data (data.validation_fraction) and reports the accuracy without noise (its "
    "metrics.jsonl and summary.json, selection.json); for these runs evaluation is not outside "
    "the guarantee's scope but private training data released outside any mechanism"
)
TUNING_GAP = (
    "tuning (argmax over private validation accuracy): the chosen value is a data-dependent "
    "choice made from those accuracies without a mechanism, and the test runs make their "
    "releases at it; composing the runs' releases does not charge the choice"
)
SELECTION_COMPOSES = (
    "per client, the DP events of every run of the selection in one ledger: every validation "
    "run (every candidate value, every seed) and every test run. The validation split is carved "
    "out of each client's training data and the test runs train on all of it, and the seeds "
    "draw their splits, partitions and noise from the same data set, so one example is in some "
    "client's training data in every run and every run releases it. Each run is charged the "
    "releases of its client with the most releases (every client makes one a round under full "
    "participation), counted from metrics.jsonl, each costing the events the run's mechanism "
    "charges for it (Mechanism.release_events, what a server charges), checked against the "
    "epsilon every client's ledger recorded in summary.json"
)


def _run_cost(label: str, config: ExperimentConfig, run_dir: Path) -> dict[str, Any]:
    """What one run of a selection released: the releases of its most-releasing client (counted
    from the ``participants`` of its ``metrics.jsonl`` rows), whether it has a guarantee, the
    epsilon it states and what that leaves out (its ``summary.json``), and an ``error`` when the
    epsilon its ledgers recorded is not what the counted releases compose to."""
    from protofl.privacy.accounting import epsilon_spent

    rows: dict[int, dict[str, Any]] = {}
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # the torn last line of a killed run
        if isinstance(row, dict) and isinstance(row.get("round"), int):
            rows[row["round"]] = row  # a resumed round's row replaces the first one
    counts: dict[str, int] = {}
    private = True
    for row in rows.values():
        spent = (row.get("privacy") or {}).get("epsilon_spent")
        if not isinstance(spent, Mapping) or any(v is None for v in spent.values()):
            private = False  # mechanism none, or no prototype release (weights only)
        names = row.get("participants")
        if not isinstance(names, list):
            names = list(spent) if isinstance(spent, Mapping) else []
        for name in names:
            counts[str(name)] = counts.get(str(name), 0) + 1
    summary = _read_summary(run_dir)
    finished = summary is not None and "avg_acc" in summary
    cost: dict[str, Any] = {
        "run": label,
        # charged releases (privacy.release_schedule=once: at most one, re-sent after)
        "releases": config.privacy.releases(max(counts.values(), default=0)),
        "epsilon": None,
        "finished": finished,
    }
    mechanism = _selection_mechanism(config)
    if not mechanism.is_private:
        private = False
    not_covered: list[str] = []
    outside: list[str] = []
    if summary is not None:
        privacy = summary.get("privacy") if isinstance(summary.get("privacy"), Mapping) else {}
        guarantee = privacy.get("guarantee") if isinstance(privacy, Mapping) else None
        guarantee = guarantee if isinstance(guarantee, Mapping) else {}
        if guarantee.get("epsilon") is None:
            private = False
        cost["epsilon"] = guarantee.get("epsilon")
        not_covered = [str(g) for g in guarantee.get("not_covered", [])]
        outside = [str(g) for g in guarantee.get("outside_scope", [])]
        recorded = privacy.get("epsilon_spent") if isinstance(privacy, Mapping) else None
        if private and isinstance(recorded, Mapping):
            composed: dict[int, float] = {}
            for client, eps in recorded.items():
                n = config.privacy.releases(counts.get(str(client), 0))
                if n not in composed:
                    events = [e for i in range(n) for e in mechanism.release_events(i)]
                    composed[n] = epsilon_spent(
                        events, delta=config.privacy.delta, accountant=config.privacy.accountant
                    )
                if eps is None or not math.isclose(composed[n], eps, rel_tol=1e-9, abs_tol=1e-12):
                    cost["error"] = (
                        f"{label}: {n} releases of client {client} compose to epsilon "
                        f"{composed[n]:.6g}, its ledger recorded {eps}"
                    )
                    break
    cost["private"] = private
    cost["not_covered"] = not_covered
    cost["outside_scope"] = outside
    return cost


_MECHANISMS: dict[str, Any] = {}
RunRef = tuple[str, ExperimentConfig, Path]
"""A run of a selection: its label in ``selection.json``, its config and its folder."""


def _selection_mechanism(config: ExperimentConfig) -> Any:
    """The run's mechanism as its server creates it (cached: calibrations repeat in a sweep)."""
    from protofl.privacy import create_mechanism

    fed = config.federation
    key = repr((config.privacy, fed.rounds, config.backbone.proto_dim))
    if key not in _MECHANISMS:
        _MECHANISMS[key] = create_mechanism(
            config.privacy,
            rounds=config.privacy.releases(fed.rounds),
            dim=config.backbone.proto_dim,
        )
    return _MECHANISMS[key]


def selection_privacy(
    runs: Sequence[RunRef],
    *,
    costs: Mapping[str, dict[str, Any]] | None = None,
    per_run: bool = True,
) -> dict[str, Any]:
    """The privacy cost of the selection runs ``(label, config, run folder)``, per client: their
    DP events composed in one :class:`~protofl.privacy.ledger.PrivacyLedger` (see
    :data:`SELECTION_COMPOSES`), at the smallest delta of the runs, with their accountant (pld
    when they differ).  It never covers the selection itself (:data:`TUNING_GAP`), so
    ``complete`` is false; ``epsilon`` is None when a run has no guarantee or its ledger does not
    match.  ``costs``: :func:`_run_cost` by label, where already computed."""
    from protofl.privacy.ledger import PrivacyLedger

    configs = [c for _, c, _ in runs]
    delta = min((c.privacy.delta for c in configs), default=1e-5)
    accountants = {c.privacy.accountant for c in configs}
    accountant = accountants.pop() if len(accountants) == 1 else "pld"
    ledger = PrivacyLedger(delta=delta, accountant=accountant)
    found: list[dict[str, Any]] = []
    for label, config, run_dir in runs:
        cost = (costs or {}).get(label) or _run_cost(label, config, run_dir)
        found.append(cost)
        mechanism = _selection_mechanism(config)
        for i in range(cost["releases"]):
            ledger.charge(i, mechanism.name, mechanism.release_events(i))
    gaps = [VALIDATION_GAP, TUNING_GAP]
    outside: list[str] = []
    for cost in found:
        gaps += [g for g in cost["not_covered"] if g not in gaps]
        outside += [g for g in cost["outside_scope"] if g not in outside]
    errors = [c["error"] for c in found if "error" in c]
    unguarded = [c["run"] for c in found if not c["private"]]
    stated = [c["epsilon"] for c in found if c["epsilon"] is not None]
    releases = sum(c["releases"] for c in found)
    out: dict[str, Any] = {
        "epsilon": None,
        "delta": delta,
        "accountant": accountant,
        "runs": len(found),
        "releases": releases,
        "run_epsilon": max(stated) if stated else None,
        "composes": SELECTION_COMPOSES,
        "unfinished": [c["run"] for c in found if not c["finished"]],
        "complete": False,
        "holds_against_server": False,
        "not_covered": gaps,
        "outside_scope": outside,
    }
    if per_run:
        out["per_run"] = [
            {k: c[k] for k in ("run", "releases", "epsilon", "finished")} for c in found
        ]
    short = "; ".join(g.split(":")[0] for g in gaps)
    if errors:
        out["error"] = "; ".join(errors)
        out["statement"] = f"no composed guarantee: {out['error']}"
    elif unguarded:
        out["statement"] = (
            "no privacy guarantee for the selection: "
            + ", ".join(unguarded[:3])
            + (f" and {len(unguarded) - 3} more" if len(unguarded) > 3 else "")
            + " released without one"
        )
    else:
        epsilon = ledger.epsilon_spent()
        out["epsilon"] = epsilon
        each = (
            ""
            if out["run_epsilon"] is None
            else f"; the epsilon {out['run_epsilon']:g} each run states holds for that run alone"
        )
        out["statement"] = (
            f"the selection's releases compose to ({epsilon:.4g}, {delta:g})-local DP per "
            f"client over {len(found)} runs ({releases} releases, {accountant}){each}; "
            f"NOT covered: {short}"
        )
    return out


def _record_privacy(
    record: dict[str, Any],
    plan: SweepPlan,
    tpoints: Sequence[SweepPoint],
    sweep_dir: Path,
) -> None:
    """Add each group's privacy cost and the whole selection's to ``record`` (see
    :func:`selection_privacy`) and state it in every run's ``summary.json``
    (``privacy.selection``): a run's own guarantee covers its releases only."""
    sel = plan.select
    assert sel is not None

    def member(overrides: Mapping[str, Any], group: Mapping[str, Any]) -> bool:
        return all(_show(overrides.get(k)) == _show(v) for k, v in group.items())

    everything: list[RunRef] = []
    costs: dict[str, dict[str, Any]] = {}
    labelled: list[tuple[dict[str, Any], list[RunRef], list[RunRef]]] = []
    for entry in record["groups"]:
        indices = {p.index for p in plan.points if member(p.overrides, entry["group"])}
        vruns = [
            (
                f"{SELECT_DIR}/{v.point.dirname}",
                v.point.config,
                sweep_dir / SELECT_DIR / v.point.dirname,
            )
            for v in plan.validation
            if v.grid_index in indices
        ]
        truns = (
            [
                (p.dirname, p.config, sweep_dir / p.dirname)
                for p in tpoints
                if member(p.overrides, entry["group"])
            ]
            if entry["chosen"] is not None
            else []
        )
        for label, config, run_dir in vruns + truns:
            costs[label] = _run_cost(label, config, run_dir)
        entry["privacy"] = selection_privacy(vruns + truns, costs=costs)
        everything += vruns + truns
        labelled.append((entry, vruns, truns))
    record["privacy"] = selection_privacy(everything, costs=costs, per_run=False)
    for entry, vruns, truns in labelled:
        total = entry["privacy"]
        common = {
            "key": sel.key,
            "selection_file": f"{SELECTION_FILE} in the sweep folder",
            "group": entry["group"],
            "epsilon": total["epsilon"],
            "delta": total["delta"],
            "complete": False,
            "not_covered": total["not_covered"],
        }
        for _, config, run_dir in vruns:
            _note_selection(
                run_dir,
                {
                    "role": "validation",
                    "value": _get_dotted(config, sel.key),
                    **common,
                    "statement": (
                        f"validation run of a selection of {sel.key}: this run's guarantee "
                        "covers its own releases only; its accuracy is computed on private "
                        "training data, not on a test split, and is NOT covered; the whole "
                        f"group: {total['statement']}"
                    ),
                },
            )
        for _, _, run_dir in truns:
            _note_selection(
                run_dir,
                {
                    "role": "test",
                    "value": entry["chosen"],
                    **common,
                    "statement": (
                        f"{sel.key}={_show(entry['chosen'])} was chosen on validation runs of the "
                        "same clients' training data: this run's guarantee covers its own "
                        f"releases only, not the selection; {total['statement']}"
                    ),
                },
            )


def _get_dotted(config: ExperimentConfig, key: str) -> Any:
    value: Any = config.to_dict()
    for part in key.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _note_selection(run_dir: Path, note: dict[str, Any]) -> None:
    """Put ``note`` into ``run_dir/summary.json`` as ``privacy.selection`` (finished runs)."""
    from protofl.data.cache import atomic_write_bytes

    summary = _read_summary(run_dir)
    if summary is None or not isinstance(summary.get("privacy"), dict):
        return
    note = json.loads(json.dumps(note, default=str))
    if summary["privacy"].get("selection") == note:
        return
    summary["privacy"]["selection"] = note
    atomic_write_bytes(run_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())


# --------------------------------------------------------------------------------------------
# status bookkeeping
# --------------------------------------------------------------------------------------------
def run_is_done(run_dir: Path) -> bool:
    """A run is complete when its ``summary.json`` exists and parses."""
    try:
        return "avg_acc" in json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return False


def _existing_config_problem(run_dir: Path, config: ExperimentConfig) -> str | None:
    path = run_dir / "config.yaml"
    if not path.exists():
        return None
    try:
        old = ExperimentConfig.from_yaml(path).to_dict()
    except (ConfigError, ValueError) as exc:
        return f"its config.yaml is unreadable ({exc})"
    new = config.to_dict()
    if old != new:
        diffs = _dict_diff(old, new)
        return "it was made with a different config (" + "; ".join(diffs[:3]) + ")"
    # the same config run on another engine (a sweep before points honoured run.engine ran
    # every point on the simulator): its results are not this point's
    from protofl.engine.rundir import read_record

    try:
        record = read_record(run_dir)
    except ConfigError:
        return None  # an unreadable record: the run itself says so (a resume refuses it)
    made_by = "sim" if record is None else str(record.get("engine", "sim"))
    if made_by != config.run.engine:
        return (
            f"it was run on the {made_by!r} engine, and this point has "
            f"run.engine={config.run.engine!r}"
        )
    return None


def _dict_diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in list(a) + [k for k in b if k not in a]:
            out += _dict_diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix.rstrip('.')}: {a!r} there, {b!r} now"]


@dataclass
class RunStatus:
    """One grid point's state in ``sweep.json``."""

    index: int
    dir: str
    overrides: dict[str, Any]
    status: str = "pending"  # pending | running | done | failed | stopped
    action: str | None = None  # reused | ran | resumed
    error: str | None = None
    resumed_from: int | None = None
    rounds: int = 0
    avg_acc: float | None = None
    wall_s: float | None = None
    fused: int | None = None
    """The fused group this run ran in (numbered in ``sweep.log``), None: on its own."""
    note: str | None = None
    """Why a run planned for a fused group ran on its own."""

    def to_json(self) -> dict[str, Any]:
        """JSON-safe dict."""
        return dict(self.__dict__)


@dataclass
class SweepResult:
    """What a sweep did."""

    sweep_dir: Path
    runs: list[RunStatus]
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> list[RunStatus]:
        """Runs that raised (or were lost with their worker)."""
        return [r for r in self.runs if r.status == "failed"]

    def count(self, action: str) -> int:
        """How many runs were ``reused``, ``ran`` or ``resumed`` in this invocation."""
        return sum(1 for r in self.runs if r.action == action and r.status == "done")


def _write_status(
    sweep_dir: Path, plan: SweepPlan, runs: Sequence[RunStatus], **extra: Any
) -> None:
    from protofl.data.cache import atomic_write_bytes

    payload = {
        "name": plan.name,
        "source": plan.source,
        "description": plan.description,
        "updated": datetime.now().isoformat(timespec="seconds"),
        "base": plan.base,
        "grid": plan.grid,
        "counts": {
            s: sum(1 for r in runs if r.status == s)
            for s in ("done", "failed", "running", "pending", "stopped")
        },
        **extra,
        "runs": [r.to_json() for r in runs],
    }
    atomic_write_bytes(
        sweep_dir / STATUS_FILE, (json.dumps(payload, indent=1, default=str) + "\n").encode()
    )


def read_status(sweep_dir: str | Path) -> dict[str, Any]:
    """The parsed ``sweep.json`` of a sweep folder."""
    path = Path(sweep_dir) / STATUS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{sweep_dir} is not a sweep folder (no {STATUS_FILE})")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


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


FUSED_ENGINE = "sim"
"""The engine whose points may fuse: a fused group is the in-process simulator's program."""


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
