"""The engine registry's entry point: what it says before a run whose privacy does nothing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from protofl.config import ExperimentConfig
from protofl.methods.checks import tiny_config
from protofl.methods.scope import mechanism_scope


def test_a_mechanism_on_a_method_without_prototypes_is_named_as_protecting_nothing() -> None:
    """Issue 43: fedavg with vpdr ran with no privacy and no warning."""
    line = mechanism_scope(
        ExperimentConfig().with_overrides(["method.name=fedavg", "privacy.mechanism=vpdr"])
    )
    assert line is not None
    assert "privacy.mechanism=vpdr adds no noise and protects nothing" in line
    assert "model weights leave every client without noise" in line and "DCR" in line
    local = ExperimentConfig().with_overrides(["method.name=local", "privacy.mechanism=igpp"])
    assert "uploads no prototypes" in (mechanism_scope(local) or "")
    assert mechanism_scope(ExperimentConfig().with_overrides(["privacy.mechanism=igpp"])) is None
    assert mechanism_scope(ExperimentConfig().with_overrides(["method.name=fedavg"])) is None


def test_the_warning_reaches_the_console_before_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from protofl.api import run

    config = tiny_config("fedavg", "igpp", rounds=1)
    with caplog.at_level(logging.WARNING, logger="protofl.methods.scope"):
        summary = run(config, out=tmp_path)
    assert any("protects nothing here" in r.getMessage() for r in caplog.records)
    assert summary["privacy"]["guarantee"]["epsilon"] is None
