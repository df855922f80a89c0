"""Shared fixtures: every test gets its own cache home, so nothing touches ~/.cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import protofl.attacks  # noqa: F401  (registers the engine's diagnostic hooks, as protofl.api does)


@pytest.fixture(autouse=True)
def _isolated_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    home = tmp_path_factory.mktemp("protofl-home")
    monkeypatch.setenv("PROTOFL_HOME", str(home))
    # deployed test nodes allow a large budget across runs unless a test sets its own
    # (tests/engine/flower/test_node_ledger.py); the default of a real node is epsilon 1
    monkeypatch.setenv("PROTOFL_NODE_BUDGET", "1e6")
    torch.set_num_threads(1)
    return home
