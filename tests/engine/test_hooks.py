"""The engine's diagnostic hooks come from a registry the layers above fill (protofl.attacks
registers ``mia``); a run that asks for one nobody registered fails before it starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from protofl.attacks.mia import MembershipDiagnostic
from protofl.engine.hooks import DIAGNOSTIC_HOOKS, check_diagnostics, upload_hooks_for
from protofl.engine.runner import run_experiment
from protofl.methods.checks import tiny_config


def test_importing_the_attacks_registers_the_membership_diagnostic() -> None:
    assert "mia" in DIAGNOSTIC_HOOKS
    (hook,) = upload_hooks_for(tiny_config("fedproto", "igpp").with_overrides(["run.mia_every=2"]))
    assert isinstance(hook, MembershipDiagnostic) and hook.every == 2
    assert upload_hooks_for(tiny_config("fedproto", "igpp")) == []  # run.mia_every=0: none


def test_a_diagnostic_nobody_registered_fails_before_the_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(DIAGNOSTIC_HOOKS, "_items", {})
    config = tiny_config("fedproto", "igpp").with_overrides(["run.mia_every=1"])
    with pytest.raises(RuntimeError, match=r"mia diagnostic.*import protofl.attacks"):
        run_experiment(config, out=tmp_path)
    assert not any(tmp_path.iterdir())
    check_diagnostics(tiny_config("fedproto", "igpp"))  # one that asks for none runs
