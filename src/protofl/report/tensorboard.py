"""Optional TensorBoard scalars for a run (``run.tensorboard: true``; off by default).

Needs the ``tensorboard`` package (not a dependency of protofl): ``pip install tensorboard``.
Scalars go to ``<run_dir>/tensorboard/``; view them with ``tensorboard --logdir <run_dir>``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

INSTALL_HINT = (
    "TensorBoard logging (run.tensorboard: true) needs the 'tensorboard' package, which is not "
    "installed: pip install tensorboard (or set run.tensorboard: false)"
)


class TensorBoardLogger:
    """Writes each round's metrics as scalars: ``acc/<domain>``, ``acc/AVG``, ``acc/STD``,
    ``client_acc/<client>``, ``loss/train``, ``time/round_s``, ``privacy/epsilon_max``,
    ``acc/held_out``."""

    def __init__(self, run_dir: str | Path, subdir: str = "tensorboard") -> None:
        try:
            import tensorboard  # noqa: F401
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(INSTALL_HINT) from exc
        self.log_dir = Path(run_dir) / subdir
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log_round(self, metrics: Any) -> None:
        """Log one round (a ``RoundMetrics`` or its ``to_json()`` dict)."""
        m: Mapping[str, Any] = metrics.to_json() if hasattr(metrics, "to_json") else metrics
        step = int(m["round"])
        scalars: dict[str, Any] = {
            "acc/AVG": m.get("avg_acc"),
            "acc/STD": m.get("std_acc"),
            "loss/train": m.get("train_loss"),
            "time/round_s": m.get("wall_s"),
            "acc/held_out": m.get("holdout_acc"),
        }
        for d, v in (m.get("acc") or {}).items():
            scalars[f"acc/{d}"] = v
        for c, v in (m.get("client_acc") or {}).items():
            scalars[f"client_acc/{c}"] = v
        eps = (m.get("privacy") or {}).get("epsilon_spent")
        if isinstance(eps, Mapping):
            vals = [float(v) for v in eps.values() if v is not None]
            if vals:
                scalars["privacy/epsilon_max"] = max(vals)
        for tag, value in scalars.items():
            if isinstance(value, int | float) and math.isfinite(float(value)):
                self.writer.add_scalar(tag, float(value), step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
