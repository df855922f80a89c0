"""A sweep's status: which runs are done, their summaries, ``sweep.json``, the result."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from protofl.config import ConfigError, ExperimentConfig
from protofl.sweeps.plan import STATUS_FILE, SweepPlan

log = logging.getLogger(__name__)


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


def _read_summary(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
