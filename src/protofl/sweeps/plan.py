"""A sweep's plan: the sweep file, its grid points (each a full, validated config), the
``select:`` option and the folder names; nothing runs here (see :mod:`protofl.sweeps`)."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import protofl.yamlio as yamlio
from protofl.config import ConfigError, ExperimentConfig, set_dotted
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


FUSED_ENGINE = "sim"
"""The engine whose points may fuse: a fused group is the in-process simulator's program."""


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
        # shallower keys first, so a dotted axis (privacy.epsilon) lands inside a section axis
        # (privacy: {mechanism: igpp}) whatever their order in the file
        for key in sorted(overrides, key=lambda k: k.count(".")):
            value = json.loads(json.dumps(overrides[key]))  # the grid's value stays as written
            _merge_dotted(data, key, value)
        return ExperimentConfig.from_dict(data, source=source)
    except (ConfigError, ValueError) as exc:
        raise ConfigError(f"{source}: {where}: {exc}") from None


def _merge_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` to ``value``; a mapping merges key by key into the section already there
    (its keys win, the base's other keys stay), as a preset's values sit under a config's."""
    node: Any = data
    for part in key.split(".")[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    current = node.get(key.split(".")[-1]) if isinstance(node, dict) else None
    if isinstance(value, dict) and isinstance(current, dict):
        for sub, v in value.items():
            _merge_dotted(current, sub, v)
        return
    set_dotted(data, key, value)


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
