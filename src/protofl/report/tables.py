"""Paper-style result tables from finished run folders: per-domain accuracy, AVG and STD in
percent, grouped by config keys, mean +- std over the runs (seeds) of a group, best marked.

Definitions (both papers' conventions are available through ``metric``):

* ``final``: the final round's accuracies (VPDR) -- ``summary.json`` ``acc``, ``avg_acc``,
  ``std_acc``;
* ``last5``: the mean over the last 5 rounds (FedDAP) of every reported number -- each domain's
  accuracy, AVG and STD are averaged over the last ``min(5, rounds)`` rows of ``metrics.jsonl``;
* ``headline``: each run's own ``run.headline`` (``summary.json`` ``headline``, else its config;
  ``final`` for runs that record neither). Rows never mix metrics: the metric is part of a row's
  key, and the table shows it in a ``metric`` column.

AVG is the mean over domains of the per-domain accuracy (a domain with several clients counts
once, its clients averaged), STD the population standard deviation over domains; both as the
engine computes them.  Over the runs of a group a cell shows ``mean +- std`` with the *sample*
standard deviation (ddof=1); a group of one run shows the mean alone.  The best value of each
column is marked (highest; for STD the lowest), ties all marked, nothing marked when every row
shows the same value or there is only one row.

Rows group by what ran, not by what was configured: ``epsilon`` (``privacy.epsilon``) is the
largest epsilon spent over clients (``summary.json`` ``privacy.epsilon_spent``, rounded *up* to 4
significant digits; the configured value only for a run that records none), ``rounds``
(``federation.rounds``) the rounds run (``summary.json`` ``rounds``), and runs of different
engines (``sim``, ``flower``) or an extended run (``protofl extend``) and one that is not never
share a row: an ``engine`` column appears when engines differ, an ``extended`` column when a row
holds extended runs.  The configured values are their own keys: ``configured_epsilon`` and
``configured_rounds`` (any config key as ``configured.<dotted key>``).
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

import protofl.yamlio as yamlio

ALIASES: dict[str, str] = {
    "method": "method.name",
    "mechanism": "privacy.mechanism",
    "epsilon": "privacy.epsilon",
    "eps": "privacy.epsilon",
    "dataset": "data.name",
    "data": "data.name",
    "domains": "data.domains",
    "dcr": "privacy.dcr",
    "delta": "privacy.delta",
    "clip": "privacy.clip",
    "rho": "privacy.vpp_rho",
    "ratio": "privacy.vpp_ratio",
    "backbone": "backbone.name",
    "rounds": "federation.rounds",
    "partition": "data.partition",
    "alpha": "data.dirichlet_alpha",
    "seed": "seed",
    "engine": "engine",
    "extended": "extended",
}
CONFIGURED = "configured."
"""Prefix of a key read from the run's config as configured (``configured.privacy.epsilon``),
where the plain key says what ran."""
CONFIGURED_EPSILON = CONFIGURED + "privacy.epsilon"
CONFIGURED_ROUNDS = CONFIGURED + "federation.rounds"
for _name, _key in (("epsilon", CONFIGURED_EPSILON), ("rounds", CONFIGURED_ROUNDS)):
    for _sep in (" ", "_", "-", "."):
        ALIASES[f"configured{_sep}{_name}"] = _key
RAN_KEYS = ("privacy.epsilon", "federation.rounds", "engine", "extended")
"""Keys whose value is read from what ran (``summary.json``), not from the config."""
EPSILON_DIGITS = 4
"""Significant digits of the epsilon spent in group keys and tables (rounded up)."""
SHORT: dict[str, str] = {}
for _alias, _key in ALIASES.items():
    SHORT.setdefault(_key, _alias)

METRICS = ("final", "last5")
HEADLINE = "headline"
METRIC_CHOICES = (HEADLINE, *METRICS)
"""What ``--metric`` takes: a run's own headline, or one metric forced for every run."""
FORMATS = ("md", "csv", "latex", "html")
AVG, STD, HOLDOUT = "AVG", "STD", "held-out"
IGNORED_VARYING = ("name", "seed", "run.")


class NotARun(ValueError):
    """A folder that is not a finished run; the message says why."""


def resolve_key(key: str) -> str:
    """Short name -> dotted config key (``mechanism`` -> ``privacy.mechanism``)."""
    return ALIASES.get(key.strip(), key.strip())


def display_key(key: str) -> str:
    """Dotted key -> the column header (its short name when it has one)."""
    return SHORT.get(key, key)


# --------------------------------------------------------------------------------------------
# run folders
# --------------------------------------------------------------------------------------------
@dataclass
class RunRecord:
    """A finished run folder: its resolved config, summary and (lazily) its per-round metrics."""

    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    _metrics: list[dict[str, Any]] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        """The folder name."""
        return self.path.name

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """Rows of ``metrics.jsonl`` (empty when the file is missing)."""
        if self._metrics is None:
            self._metrics = read_metrics(self.path)
        return self._metrics

    def value(self, key: str) -> Any:
        """A value by dotted or short key: what ran for epsilon (the epsilon spent), rounds (the
        rounds run), ``engine`` and ``extended``; the config's value for every other key and for
        ``configured.<key>``.  Epsilon is None without a privacy mechanism."""
        key = resolve_key(key)
        if key.startswith(CONFIGURED):
            return self.configured(key[len(CONFIGURED) :])
        if key == "privacy.epsilon":
            return self.epsilon_ran()
        if key == "federation.rounds":
            return self.rounds_ran()
        if key == "engine":
            return self.engine
        if key == "extended":
            return self.extended
        return self.configured(key)

    def configured(self, key: str) -> Any:
        """A config value by dotted or short key (epsilon None without a privacy mechanism)."""
        key = resolve_key(key)
        if key == "privacy.epsilon" and self.configured("privacy.mechanism") == "none":
            return None
        node: Any = self.config
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return None
            node = node[part]
        return node

    def epsilon_ran(self) -> float | None:
        """The epsilon the run spent: the largest over clients, rounded up to
        :data:`EPSILON_DIGITS` significant digits; else the summary's stated epsilon; else
        the configured one (a run that records none).  None without a privacy mechanism."""
        priv = self.summary.get("privacy") or {}
        mechanism = self.configured("privacy.mechanism")
        if mechanism is None and isinstance(priv, Mapping):
            mechanism = priv.get("mechanism")
        if mechanism == "none":
            return None
        spent = self.epsilon_spent()
        if spent is None and isinstance(priv, Mapping):
            guarantee = priv.get("guarantee")
            for stated in (
                guarantee.get("epsilon") if isinstance(guarantee, Mapping) else None,
                priv.get("epsilon"),
            ):
                if isinstance(stated, int | float) and not isinstance(stated, bool):
                    spent = float(stated)
                    break
        if spent is None:
            configured = self.configured("privacy.epsilon")
            return float(configured) if isinstance(configured, int | float) else configured
        return ceil_significant(spent, EPSILON_DIGITS)

    def rounds_ran(self) -> Any:
        """The rounds the run ran (``summary.json`` ``rounds``; else the configured rounds)."""
        rounds = self.summary.get("rounds")
        if isinstance(rounds, int) and not isinstance(rounds, bool):
            return rounds
        return self.configured("federation.rounds")

    @property
    def engine(self) -> str:
        """``flower`` for a Flower run, else the engine its run record names (``sim``)."""
        recorded = self.summary.get("engine")
        if recorded:
            return str(recorded)
        from protofl.engine.rundir import record_engine

        try:
            return record_engine(self.path)
        except Exception:  # an unreadable record: the simulator made every run before them
            return "sim"

    @property
    def extended(self) -> bool:
        """Whether the run was extended past its configured rounds (``protofl extend``)."""
        priv = self.summary.get("privacy") or {}
        return bool(isinstance(priv, Mapping) and priv.get("extensions"))

    @property
    def domains(self) -> list[str]:
        """Domain names in the run's order."""
        return [str(d) for d in self.summary.get("domains") or self.summary.get("acc", {})]

    @property
    def headline(self) -> str:
        """The run's headline metric: ``summary.json`` ``headline``, else ``run.headline`` of
        its config, else ``final`` (runs made before ``run.headline`` existed)."""
        recorded = self.summary.get("headline")
        if isinstance(recorded, Mapping) and recorded.get("metric") in METRICS:
            return str(recorded["metric"])
        configured = self.value("run.headline")
        return str(configured) if configured in METRICS else "final"

    def resolve_metric(self, metric: str) -> str:
        """``final`` or ``last5``: ``metric`` itself, or the run's headline for ``headline``."""
        check_metric(metric)
        return self.headline if metric == HEADLINE else metric

    def scores(self, metric: str = "final") -> dict[str, float]:
        """Per-domain accuracy, AVG, STD (and held-out when the run has it), as fractions."""
        metric = self.resolve_metric(metric)
        if metric == "final":
            s = self.summary
            out = {str(k): float(v) for k, v in s["acc"].items()}
            out[AVG] = float(s["avg_acc"])
            out[STD] = float(s["std_acc"])
            if s.get("holdout_acc") is not None:
                out[HOLDOUT] = float(s["holdout_acc"])
            return out
        rows = self.metrics[-5:]
        if not rows:
            raise NotARun(f"{self.path}: no metrics.jsonl rows for --metric last5")
        out = {}
        for d in rows[-1]["acc"]:
            vals = [r["acc"][d] for r in rows if d in r.get("acc", {})]
            out[str(d)] = float(np.mean(vals))
        out[AVG] = float(np.mean([r["avg_acc"] for r in rows]))
        out[STD] = float(np.mean([r["std_acc"] for r in rows]))
        held = [float(r["holdout_acc"]) for r in rows if r.get("holdout_acc") is not None]
        if held:
            out[HOLDOUT] = float(np.mean(held))
        return out

    def epsilon_spent(self) -> float | None:
        """The largest epsilon spent over clients (None without a guarantee)."""
        eps = (self.summary.get("privacy") or {}).get("epsilon_spent")
        if isinstance(eps, Mapping):
            vals = [float(v) for v in eps.values() if v is not None]
            return max(vals) if vals else None
        return None

    def attack(self, kind: str = "mia") -> dict[str, Any] | None:
        """The parsed ``attack_<kind>.json`` of this run, when an attack was run on it."""
        path = self.path / f"attack_{kind}.json"
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None


def ceil_significant(value: float, digits: int) -> float:
    """``value`` rounded up to ``digits`` significant digits (an epsilon is never understated;
    1.9999999998 from the accountant is 2)."""
    if not math.isfinite(value) or value <= 0:
        return value
    step = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    return float(f"{math.ceil(value / step - 1e-6) * step:.{digits + 2}g}")


def check_metric(metric: str) -> None:
    """Raise ValueError unless ``metric`` is one of :data:`METRIC_CHOICES`."""
    if metric not in METRIC_CHOICES:
        raise ValueError(
            f"metric {metric!r} is unknown; choose one of: {', '.join(METRIC_CHOICES)}"
        )


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """``metrics.jsonl`` as a list of dicts, each round's local-only diagnostics merged back in
    from the run's client-local folder when it is there
    (:func:`protofl.engine.rundir.read_rounds`); a torn last line (a killed run) is ignored."""
    from protofl.engine.rundir import read_rounds

    return read_rounds(run_dir)


def load_run(path: str | Path) -> RunRecord:
    """Read a finished run folder; raises :class:`NotARun` saying why it is not one."""
    path = Path(path)
    if not path.exists():
        raise NotARun("does not exist")
    if not path.is_dir():
        raise NotARun("not a folder")
    summary_path = path / "summary.json"
    config_path = path / "config.yaml"
    if not summary_path.exists():
        if config_path.exists():
            hint = " (see error.txt)" if (path / "error.txt").exists() else ""
            raise NotARun(f"not finished: no summary.json (running, stopped or failed){hint}")
        raise NotARun("not a run folder (no config.yaml or summary.json)")
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, ValueError) as exc:
        raise NotARun(f"summary.json is unreadable ({exc})") from None
    if not isinstance(summary, dict) or not {"acc", "avg_acc", "std_acc"} <= set(summary):
        raise NotARun("summary.json lacks acc/avg_acc/std_acc")
    config: dict[str, Any] = {}
    if config_path.exists():
        config = _resolved_config(config_path)
    return RunRecord(path=path, config=config, summary=summary)


def _resolved_config(path: Path) -> dict[str, Any]:
    try:
        raw = yamlio.load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise NotARun(f"config.yaml is unreadable ({exc})") from None
    if not isinstance(raw, dict):
        raise NotARun("config.yaml does not hold a mapping")
    try:
        from protofl.config import ExperimentConfig

        return ExperimentConfig.from_dict(raw).to_dict()
    except Exception:  # an older or foreign config: use what it says
        return raw


MAX_DEPTH = 4
"""How deep :func:`expand_paths` descends into folders of runs (sweep folders, runs/<group>/)."""


def _is_run_folder(path: Path) -> bool:
    return (path / "summary.json").exists() or (path / "config.yaml").exists()


def _sweep_runs(path: Path) -> list[Path] | None:
    """A sweep folder's runs in grid order (None: not a readable sweep folder)."""
    if not (path / "sweep.json").exists():
        return None
    try:
        status = json.loads((path / "sweep.json").read_text())
        return [path / r["dir"] for r in status.get("runs", [])]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _runs_below(path: Path, depth: int) -> list[Path]:
    """The run folders in ``path``: a sweep's runs in grid order, else its sub-folders in name
    order, descending into sweep folders and folders of runs; a run's client-local folder
    (``<run>.client-local``) and ``figures`` are never runs."""
    from protofl.engine.rundir import CLIENT_LOCAL_SUFFIX

    swept = _sweep_runs(path)
    if swept is not None:
        return swept
    if depth > MAX_DEPTH:
        return []
    out: list[Path] = []
    try:
        children = sorted(c for c in path.iterdir() if c.is_dir())
    except OSError:
        return []
    for c in children:
        if c.name.endswith(CLIENT_LOCAL_SUFFIX) or c.name == "figures":
            continue
        out += [c] if _is_run_folder(c) else _runs_below(c, depth + 1)
    return out


def expand_paths(paths: Iterable[str | Path]) -> list[Path]:
    """Run folders, sweep folders (their runs in grid order) and folders of runs -> folders.

    A folder of runs is searched below: its run folders, and the runs of its sweep folders and
    of its folders of runs (up to :data:`MAX_DEPTH` levels), in name order.
    """
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir() and not _is_run_folder(p):
            found = _runs_below(p, 0)
            if found:
                out += found
                continue
        out.append(p)
    return out


def collect_runs(
    paths: Iterable[str | Path], metric: str = "final"
) -> tuple[list[RunRecord], list[tuple[Path, str]]]:
    """Finished runs among ``paths`` (expanded), and ``(folder, reason)`` for every skipped one."""
    runs: list[RunRecord] = []
    skipped: list[tuple[Path, str]] = []
    seen: set[Path] = set()
    for p in expand_paths(paths):
        rp = p.resolve()
        if rp in seen:
            continue
        seen.add(rp)
        try:
            rec = load_run(p)
            rec.scores(metric)
        except NotARun as exc:
            skipped.append((p, str(exc)))
            continue
        except (KeyError, TypeError, ValueError) as exc:
            skipped.append((p, f"unreadable results ({type(exc).__name__}: {exc})"))
            continue
        runs.append(rec)
    return runs, skipped


def filter_runs(runs: Sequence[RunRecord], where: Iterable[str]) -> list[RunRecord]:
    """The runs whose config matches every ``key=value`` of ``where`` (keys dotted or short as
    in ``--by``; values in YAML, numbers compared as numbers: ``epsilon=1`` matches 1.0;
    ``epsilon=null`` matches runs without a privacy mechanism)."""
    tests: list[tuple[str, Any]] = []
    for item in where:
        if "=" not in item:
            raise ValueError(f"--where {item!r} must look like key=value")
        key, raw = (part.strip() for part in item.split("=", 1))
        tests.append((key, yamlio.load(raw) if raw else None))

    def same(a: Any, b: Any) -> bool:
        numbers = (int, float)
        if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool):
            return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
        return bool(a == b) or (a is not None and b is not None and str(a) == str(b))

    return [r for r in runs if all(same(r.value(k), v) for k, v in tests)]


# --------------------------------------------------------------------------------------------
# aggregation
# --------------------------------------------------------------------------------------------
def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, Mapping):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): node}


def _hashable(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, Mapping):
        return json.dumps(value, sort_keys=True, default=str)
    return value


def default_by(runs: Sequence[RunRecord]) -> list[str]:
    """Config keys that take different values among the runs (not the seed, name or run.*).

    A key that some runs lack and that is constant where present (a method's own parameter)
    does not count as varying.
    """
    flat = [_flatten(r.config) for r in runs]
    keys: list[str] = []
    for f in flat:
        keys += [k for k in f if k not in keys]
    varying = []
    for key in keys:
        if key in IGNORED_VARYING or any(key.startswith(p) for p in IGNORED_VARYING if "." in p):
            continue
        values = {_hashable(r.value(key)) for r, f in zip(runs, flat) if key in f}
        if len(values) > 1:
            varying.append(key)
    return varying


@dataclass
class Cell:
    """One table cell: mean and sample std (None for one run) over ``n`` runs, as fractions."""

    mean: float
    std: float | None
    n: int


@dataclass
class Group:
    """One row: the values of the group keys, the runs in it and the metric of its cells."""

    key: tuple[Any, ...]
    runs: list[RunRecord]
    cells: dict[str, Cell]
    metric: str = "final"
    """``final`` or ``last5``: what every cell of this row is."""
    engine: str = "sim"
    """The engine every run of this row ran on (``sim``, ``flower``)."""
    extended: bool = False
    """Whether the runs of this row were extended past their configured rounds."""


@dataclass
class ResultTable:
    """An aggregated table, ready for :func:`format_table`."""

    by: list[str]
    columns: list[str]
    groups: list[Group]
    metric: str
    """What was asked: ``final``, ``last5`` or ``headline`` (each row its runs' own)."""

    @property
    def shows_metric(self) -> bool:
        """Whether the rendered table has a ``metric`` column (rows follow their runs)."""
        return self.metric == HEADLINE

    @property
    def shows_engine(self) -> bool:
        """Whether the rendered table has an ``engine`` column (its rows ran on different
        engines and ``engine`` is not a group key)."""
        return "engine" not in self.by and len({g.engine for g in self.groups}) > 1

    @property
    def shows_extended(self) -> bool:
        """Whether the rendered table has an ``extended`` column (a row holds extended runs and
        ``extended`` is not a group key)."""
        return "extended" not in self.by and any(g.extended for g in self.groups)

    def extra_heads(self) -> list[str]:
        """The columns after the group keys that every row has: metric, engine, extended."""
        return (
            (["metric"] if self.shows_metric else [])
            + (["engine"] if self.shows_engine else [])
            + (["extended"] if self.shows_extended else [])
        )

    def extra_values(self, group: Group) -> list[str]:
        """A row's values of :meth:`extra_heads`."""
        return (
            ([group.metric] if self.shows_metric else [])
            + ([group.engine] if self.shows_engine else [])
            + (["yes"] if group.extended else ["no"] if self.shows_extended else [])
        )

    def best(self, column: str, digits: int = 2) -> set[int]:
        """Indices of the rows holding the best shown value of ``column`` (compared among the
        rows of the same metric: a final-round number is not ranked against a last-5 mean)."""
        marked: set[int] = set()
        for metric in dict.fromkeys(g.metric for g in self.groups):
            vals = {
                i: round(100 * g.cells[column].mean, digits)
                for i, g in enumerate(self.groups)
                if g.metric == metric and column in g.cells and math.isfinite(g.cells[column].mean)
            }
            if len(vals) < 2 or len(set(vals.values())) < 2:
                continue
            target = min(vals.values()) if column == STD else max(vals.values())
            marked |= {i for i, v in vals.items() if v == target}
        return marked


def aggregate(
    runs: Sequence[RunRecord], by: Sequence[str] | None = None, metric: str = "final"
) -> ResultTable:
    """Group runs by keys (what ran for epsilon and rounds: :meth:`RunRecord.value`) and average
    every column over each group's runs.

    ``metric``: ``final``, ``last5`` or ``headline`` (each run's own; runs of different
    headlines go to different rows).  Runs of different engines, and extended runs and runs
    that were not, never share a row either.
    """
    check_metric(metric)
    if not runs:
        raise ValueError("no finished runs to tabulate")
    keys = [resolve_key(k) for k in by] if by is not None else default_by(runs)
    groups: dict[tuple[tuple[Any, ...], str, str, bool], list[RunRecord]] = {}
    for r in runs:
        row = tuple(_hashable(r.value(k)) for k in keys)
        groups.setdefault((row, r.resolve_metric(metric), r.engine, r.extended), []).append(r)
    domains: list[str] = []
    extra: list[str] = []
    for r in runs:
        sc = r.scores(metric)
        domains += [d for d in r.domains if d in sc and d not in domains]
        domains += [d for d in sc if d not in (AVG, STD, HOLDOUT) and d not in domains]
        if HOLDOUT in sc and HOLDOUT not in extra:
            extra.append(HOLDOUT)
    columns = [*domains, AVG, STD, *extra]
    out = []
    for (key, row_metric, engine, extended), members in groups.items():
        per_col: dict[str, list[float]] = {}
        for r in members:
            for col, v in r.scores(metric).items():
                per_col.setdefault(col, []).append(v)
        cells = {}
        for col in columns:
            vals = per_col.get(col)
            if not vals:
                continue
            arr = np.asarray(vals, dtype=np.float64)
            cells[col] = Cell(
                mean=float(arr.mean()),
                std=float(arr.std(ddof=1)) if len(arr) > 1 else None,
                n=len(arr),
            )
        out.append(
            Group(
                key=key,
                runs=list(members),
                cells=cells,
                metric=row_metric,
                engine=engine,
                extended=extended,
            )
        )
    return ResultTable(by=keys, columns=columns, groups=out, metric=metric)


# --------------------------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------------------------
def format_value(key: str, value: Any, fmt: str = "md") -> str:
    """A group-key value as shown in a table (epsilon None = no privacy = infinity)."""
    if value is None:
        if resolve_key(key) in ("privacy.epsilon", CONFIGURED_EPSILON):
            return {"latex": r"$\infty$", "csv": "inf"}.get(fmt, "∞")
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple | list):
        return "+".join(format_value(key, v, fmt) for v in value)
    return str(value)


def _cell_text(cell: Cell | None, digits: int, pm: str) -> str:
    if cell is None:
        return "-"
    text = f"{100 * cell.mean:.{digits}f}"
    if cell.std is not None:
        text += f"{pm}{100 * cell.std:.{digits}f}"
    return text


_LATEX_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}


def latex_escape(text: str) -> str:
    """Escape LaTeX's special characters."""
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def format_table(table: ResultTable, fmt: str = "md", digits: int = 2) -> str:
    """Render as Markdown, CSV, LaTeX (booktabs) or an HTML ``<table>``."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is unknown; choose one of: {', '.join(FORMATS)}")
    best = {col: table.best(col, digits) for col in table.columns}
    heads = [display_key(k) for k in table.by] + table.extra_heads()

    def row_keys(g: Group, key_fmt: str) -> list[str]:
        keys = [format_value(k, v, key_fmt) for k, v in zip(table.by, g.key)]
        return keys + table.extra_values(g)

    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(
            [*heads, "n"] + [f"{c}_{s}" for c in table.columns for s in ("mean", "std")] + ["best"]
        )
        for i, g in enumerate(table.groups):
            row = row_keys(g, "csv")
            row.append(str(len(g.runs)))
            for col in table.columns:
                cell = g.cells.get(col)
                row.append("" if cell is None else f"{100 * cell.mean:.4f}")
                row.append("" if cell is None or cell.std is None else f"{100 * cell.std:.4f}")
            row.append(";".join(c for c in table.columns if i in best[c]))
            w.writerow(row)
        return buf.getvalue()
    rows = []
    for i, g in enumerate(table.groups):
        pm = {"md": " ± ", "latex": r" $\pm$ ", "html": " ± "}[fmt]
        cells = []
        for col in table.columns:
            text = _cell_text(g.cells.get(col), digits, pm)
            if i in best[col]:
                text = {
                    "md": f"**{text}**",
                    "latex": rf"\textbf{{{text}}}",
                    "html": f"<strong>{html.escape(text)}</strong>",
                }[fmt]
            elif fmt == "html":
                text = html.escape(text)
            cells.append(text)
        keys = row_keys(g, fmt)
        if fmt == "latex":
            keys = [k if k == r"$\infty$" else latex_escape(k) for k in keys]
        elif fmt == "html":
            keys = [html.escape(k) for k in keys]
        rows.append([*keys, str(len(g.runs)), *cells])
    cols = [*heads, "n", *table.columns]
    if fmt == "md":
        align = [":--"] * len(heads) + ["--:"] * (1 + len(table.columns))
        lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(align) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines) + "\n"
    if fmt == "latex":
        spec = "l" * len(heads) + "r" * (1 + len(table.columns))
        head = [latex_escape(c) for c in heads] + ["$n$"] + [latex_escape(c) for c in table.columns]
        lines = [
            f"\\begin{{tabular}}{{{spec}}}",
            r"\toprule",
            " & ".join(head) + r" \\",
            r"\midrule",
            *[" & ".join(r) + r" \\" for r in rows],
            r"\bottomrule",
            r"\end{tabular}",
        ]
        return "\n".join(lines) + "\n"
    head_html = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="{"key" if j < len(heads) else "num"}">{c}</td>' for j, c in enumerate(r)
        )
        + "</tr>\n"
        for r in rows
    )
    return (
        f'<table class="results">\n<thead><tr>{head_html}</tr></thead>\n<tbody>\n{body}'
        "</tbody>\n</table>\n"
    )


def describe_metric(metric: str) -> str:
    """One line saying what the numbers are."""
    check_metric(metric)
    which = {
        "final": "final round",
        "last5": "mean of the last 5 rounds",
        HEADLINE: "each run's headline (run.headline: final round or mean of the last 5 "
        "rounds, named in the metric column)",
    }[metric]
    return (
        f"Accuracy (%), {which}; AVG = mean over domains, STD = std over domains; "
        "mean ± sample std over the runs of a row (n); best per column marked (STD: lowest). "
        "epsilon = the largest epsilon spent over clients (rounded up), rounds = the rounds run; "
        "extended = runs continued past their configured rounds (protofl extend) at the "
        "calibrated noise."
    )
