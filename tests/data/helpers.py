"""Shared by the loaders' preflight tests: a run refused before it makes anything."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from protofl.config import ExperimentConfig
from protofl.data import DATASET_REGISTRY
from protofl.data.imagefolder import DatasetRootError
from protofl.engine.runner import run_experiment

FAST = ["backbone.name=pixels", "backbone.image_size=8", "federation.rounds=1"]


def preflight_config(*overrides: str) -> ExperimentConfig:
    """A fast run's config with ``overrides`` (data.name, data.root, data.options...)."""
    return ExperimentConfig().with_overrides([*FAST, *overrides])


def refused(tmp_path: Path, error: type[Exception], first_line: str, *overrides: str) -> str:
    """Run ``overrides``: it fails with ``error``, the message's first line matches the regex
    ``first_line``, and nothing is made under the output folder; the message."""
    out = tmp_path / "runs"
    with pytest.raises(error) as info:
        run_experiment(preflight_config(*overrides), out=out, home=tmp_path / "home")
    msg = str(info.value)
    assert re.search(first_line, msg.splitlines()[0]), msg
    assert not out.exists() or not any(out.iterdir()), sorted(out.rglob("*"))
    return msg


def missing_root_makes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, env: str
) -> None:
    """Data set ``name`` has a preflight; without a root (``$env`` unset) or with a root that
    does not exist a run fails before it makes anything."""
    assert DATASET_REGISTRY.get(name).preflight is not None
    monkeypatch.delenv(env, raising=False)
    refused(tmp_path, DatasetRootError, rf"'{name}' needs its root folder", f"data.name={name}")
    nowhere = tmp_path / "nowhere"
    refused(
        tmp_path,
        ValueError,
        r"data\.root=.*nowhere.* does not exist",
        f"data.name={name}",
        f"data.root={nowhere}",
    )
