"""Shared fixtures: every test gets its own cache home, so nothing touches ~/.cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _isolated_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    home = tmp_path_factory.mktemp("protofl-home")
    monkeypatch.setenv("PROTOFL_HOME", str(home))
    torch.set_num_threads(1)
    return home
