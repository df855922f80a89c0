"""The Flower server keeps the latest ``federation.keep_checkpoints`` checkpoints, as the
simulator does (default 1; 0 keeps them all)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from protofl.engine.checkpoint import INDEX, wait_for_deletions
from protofl.engine.flower.run import run_flower_simulation
from protofl.methods.checks import tiny_config


def _saved(run_dir: Path) -> list[str]:
    wait_for_deletions()
    return sorted(p.name for p in run_dir.glob("checkpoint-*.pt"))


@pytest.mark.parametrize(
    ("keep", "left"),
    [
        (None, ["checkpoint-0003.pt"]),  # the default, 1: only the latest
        (0, ["checkpoint-0001.pt", "checkpoint-0002.pt", "checkpoint-0003.pt"]),
    ],
)
def test_the_flower_server_keeps_the_latest_keep_checkpoints(
    tmp_path: Path, keep: int | None, left: list[str]
) -> None:
    config = tiny_config("fedproto", "vpdr", rounds=3)
    if keep is not None:
        config = config.with_overrides([f"federation.keep_checkpoints={keep}"])
    result = run_flower_simulation(config, home=tmp_path, backend="inline", out=tmp_path / "runs")
    assert result.run_dir is not None
    assert _saved(result.run_dir) == left
    index = json.loads((result.run_dir / INDEX).read_text())
    assert [e["file"] for e in index] == left
