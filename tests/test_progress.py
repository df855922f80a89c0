"""Long steps say what they are doing: feature extraction, report figures, attacks, the audit."""

from __future__ import annotations

from pathlib import Path

import pytest

from protofl.attacks.cli import main as attacks_main
from protofl.engine.runner import run_experiment
from protofl.methods.checks import tiny_config
from protofl.progress import note, progress_notes, step


def test_notes_only_while_enabled(capsys: pytest.CaptureFixture[str]) -> None:
    note("hidden")
    with progress_notes(True), step("work", 100, "images"):
        pass
    err = capsys.readouterr().err
    assert "hidden" not in err and "work ..." in err and "work: done in" in err


def test_feature_extraction_reports_each_domain_and_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_experiment(tiny_config("local", "none", rounds=1), out=tmp_path, progress=True)
    err = capsys.readouterr().err
    for domain in ("red", "blue"):
        for split in ("train", "test"):
            assert f"features toy/{domain}/{split}:" in err
    assert "images/s" in err
    run_experiment(tiny_config("local", "none", rounds=1), out=tmp_path, progress=False)
    assert "features toy" not in capsys.readouterr().err  # quiet runs stay quiet


def test_the_audit_says_which_mode_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = attacks_main(
        ["audit", "--mechanism", "igpp", "--epsilon", "2", "--mode", "fast", "--trials", "500"]
    )
    assert code == 0
    assert "audit, fast mode: 500 trials x 20 releases" in capsys.readouterr().err
