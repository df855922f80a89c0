"""Helpers shared by the engine tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from protofl.config import ExperimentConfig


def toy_config(rounds: int, *extra: str) -> ExperimentConfig:
    """The generated ``toy`` set (every training image) with the fast ``pixels`` backbone for
    ``rounds`` rounds, no progress bar; ``extra`` overrides follow."""
    return ExperimentConfig().with_overrides(
        [
            "data.name=toy",
            "data.train_fraction=1",
            "backbone.name=pixels",
            "backbone.image_size=16",
            "backbone.proto_dim=32",
            f"federation.rounds={rounds}",
            "run.progress=false",
            *extra,
        ]
    )


def stop_in_round(patch: pytest.MonkeyPatch, stop: int) -> None:
    """Make every Simulation raise KeyboardInterrupt (a Ctrl-C) as round ``stop`` (1-based)
    starts, under ``patch`` (a ``monkeypatch.context()``)."""
    from protofl.engine import simulation

    original = simulation.Simulation.run_round

    def interrupted(self: simulation.Simulation) -> simulation.RoundMetrics:
        if self.round == stop - 1:
            raise KeyboardInterrupt
        return original(self)

    patch.setattr(simulation.Simulation, "run_round", interrupted)


def run_stopped_in_round(
    cfg: Any, stop: int, out: Path, monkeypatch: pytest.MonkeyPatch, **kw: Any
) -> Path:
    """Run ``cfg`` into ``out`` as if the user pressed Ctrl-C as round ``stop`` starts (``kw``:
    more arguments of ``run_experiment``); the run's folder."""
    from protofl.engine.runner import run_experiment

    with monkeypatch.context() as patch:
        stop_in_round(patch, stop)
        with pytest.raises(KeyboardInterrupt):
            run_experiment(cfg, out=out, **kw)
    return next(p for p in out.iterdir() if not p.name.endswith(".client-local"))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def checkpoint_differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two checkpoint states differ: tensors by dtype, shape and bytes (so NaN equals
    NaN), everything else exactly (NaN equal to NaN), wall-clock times left out."""
    if isinstance(a, torch.Tensor):
        same = (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and (a.numel() == 0 or torch.equal(_bytes(a), _bytes(b)))
        )
        return [] if same else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return [f"{path} (keys)"]
        return [d for k in a for d in checkpoint_differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list | tuple):
        if not isinstance(b, list | tuple) or len(a) != len(b):
            return [f"{path} (length)"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b))
            for d in checkpoint_differences(x, y, f"{path}[{i}]")
        ]
    if path.endswith(("wall_s", "setup_s", "environment")):
        return []
    same = a == b or (a != a and b != b)  # NaN equals NaN here
    return [] if same else [path]
