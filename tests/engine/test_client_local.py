"""The run folder is the server's view; what only the clients' side holds (local-only
diagnostics, client models, training indices, exact counts that are not public) goes to the
client-local folder ``<run_dir>.client-local/`` beside it (0700, files 0600)."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from protofl.engine.round import LOCAL_ONLY_FIELDS
from protofl.engine.rundir import (
    CLIENT_ARTIFACTS,
    CLIENT_SUMMARY,
    DIAGNOSTICS,
    client_local_dir,
    read_rounds,
    split_fields,
)
from protofl.engine.runner import RunResult, resume_experiment, run_experiment
from protofl.methods.checks import tiny_config
from tests.engine.helpers import run_stopped_in_round


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _config(method: str = "fedproto", rounds: int = 2, *extra: str) -> Any:
    return tiny_config(method, "vpdr", rounds=rounds).with_overrides(
        ["run.save_releases=true", "run.mia_every=1", *extra]
    )


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, home: Path) -> RunResult:
    """fedproto + vpdr, 2 rounds, releases saved, MIA every round."""
    return run_experiment(_config(), out=tmp_path_factory.mktemp("runs"), home=home)


def test_the_client_local_folder_is_beside_the_run_folder_and_private(run: RunResult) -> None:
    local = client_local_dir(run.run_dir)
    assert local == run.run_dir.parent / f"{run.run_dir.name}.client-local"
    assert local.is_dir() and _mode(local) == 0o700
    assert not any(p.name.endswith(".client-local") for p in run.run_dir.iterdir())
    for name in (DIAGNOSTICS, CLIENT_ARTIFACTS, CLIENT_SUMMARY):
        assert _mode(local / name) == 0o600, name
    assert {p.name for p in local.iterdir()} == {DIAGNOSTICS, CLIENT_ARTIFACTS, CLIENT_SUMMARY}


def test_artifacts_hold_what_the_server_received_and_the_models_stay_client_side(
    run: RunResult,
) -> None:
    art = torch.load(run.run_dir / "artifacts.pt", weights_only=True)
    assert set(art) == {"releases", "clients", "domains", "global_state"}
    assert art["clients"] == ["red", "blue"] and len(art["releases"]) == 2
    released = {k for rnd in art["releases"] for r in rnd if r is not None for k in r}
    assert "diagnostics" not in released and "prototypes" in released
    local = torch.load(client_local_dir(run.run_dir) / CLIENT_ARTIFACTS, weights_only=True)
    assert local["clients"] == art["clients"]
    assert len(local["models"]) == len(local["train_indices"]) == 2
    assert all(len(idx) > 0 for idx in local["train_indices"])


def test_metrics_rows_hold_no_local_only_field_and_diagnostics_do(run: RunResult) -> None:
    rows = _rows(run.run_dir / "metrics.jsonl")
    assert [r["round"] for r in rows] == [1, 2]
    for row in rows:
        assert not {"feature_norms", "mia", "train_loss"} & set(row), sorted(row)
        assert "partition_overlap" not in row["privacy"] and row["privacy"]["epsilon_spent"]
        assert row["local_only"] == list(LOCAL_ONLY_FIELDS)
    local = _rows(client_local_dir(run.run_dir) / DIAGNOSTICS)
    assert [r["round"] for r in local] == [1, 2]
    for row, m in zip(local, run.history):
        assert set(row["mia"]) == set(row["feature_norms"]) == {"red", "blue"}
        assert row["train_loss"] == m.train_loss
        assert row["privacy"] == {"partition_overlap": m.privacy["partition_overlap"]}
        assert set(row) == {"round", "feature_norms", "mia", "train_loss", "privacy"}
    # the experimenter's readers join them again: every round as it ran
    assert read_rounds(run.run_dir) == [m.to_json() for m in run.history]


def test_summary_json_holds_no_local_only_fact(run: RunResult) -> None:
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert "final_train_loss" not in summary and "partition_overlap" not in summary["privacy"]
    assert summary["num_train"] == run.summary["num_train"]  # replace-one: counts are public
    local = json.loads((client_local_dir(run.run_dir) / CLIENT_SUMMARY).read_text())
    assert local["final_train_loss"] == run.summary["final_train_loss"]
    assert local["privacy"] == {"partition_overlap": run.summary["privacy"]["partition_overlap"]}
    assert "num_train" not in local


def test_checkpoints_are_private_from_creation(run: RunResult) -> None:
    checkpoints = sorted(run.run_dir.glob("checkpoint-*.pt"))
    assert checkpoints and all(_mode(p) == 0o600 for p in checkpoints)


def test_exact_counts_stay_client_side_when_they_are_not_public(tmp_path: Path, home: Path) -> None:
    config = tiny_config("fedproto", "igpp", rounds=1).with_overrides(
        ["privacy.neighbouring=add_remove", "privacy.addremove_counts=noisy"]
    )
    result = run_experiment(config, out=tmp_path, home=home)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert "num_train" not in summary
    local = json.loads((client_local_dir(result.run_dir) / CLIENT_SUMMARY).read_text())
    assert local["num_train"] == result.summary["num_train"] == {"red": 160, "blue": 160}


def test_the_membership_attack_runs_from_both_folders_and_names_a_missing_one(
    run: RunResult, tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from protofl.attacks.cli import main

    assert main(["attack", str(run.run_dir), "--attack", "mia", "--json"]) == 0
    mia = json.loads(capsys.readouterr().out)
    assert set(mia["clients"]) == {"red", "blue"} and 0.0 <= mia["mean"]["mia_auc"] <= 1.0
    # the run folder alone (what a server-side reader gets) cannot be attacked as ground truth
    alone = tmp_path / "alone"
    shutil.copytree(run.run_dir, alone)
    assert main(["attack", str(alone), "--attack", "mia"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and f"{alone}.client-local/{CLIENT_ARTIFACTS} is missing" in err[0]


def test_a_resumed_run_keeps_both_folders_whole(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config("fedproto", 3)
    reference = run_experiment(config, out=tmp_path / "ref", home=home)
    run_dir = run_stopped_in_round(config, 3, tmp_path / "stopped", monkeypatch, home=home)
    assert [r["round"] for r in _rows(client_local_dir(run_dir) / DIAGNOSTICS)] == [1, 2]
    resumed = resume_experiment(run_dir, home=home)
    assert resumed.summary["avg_acc"] == reference.summary["avg_acc"]
    assert [r["round"] for r in _rows(run_dir / "metrics.jsonl")] == [1, 2, 3]

    def same(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [split_fields(r, ["wall_s"])[0] for r in rows]

    assert same(read_rounds(run_dir)) == same(read_rounds(reference.run_dir))
    art = torch.load(client_local_dir(run_dir) / CLIENT_ARTIFACTS, weights_only=True)
    assert len(art["models"]) == 2


def test_a_weight_sharing_run_keeps_the_global_state_and_no_client_model(
    tmp_path: Path, home: Path
) -> None:
    config = tiny_config("fedavg", "none", rounds=1).with_overrides(["run.save_releases=true"])
    result = run_experiment(config, out=tmp_path, home=home)
    art = torch.load(result.run_dir / "artifacts.pt", weights_only=True)
    assert "models" not in art and "train_indices" not in art and art["global_state"]
    local = torch.load(client_local_dir(result.run_dir) / CLIENT_ARTIFACTS, weights_only=True)
    assert len(local["models"]) == 2


def test_the_report_reads_feature_norms_from_the_client_local_folder(run: RunResult) -> None:
    from protofl.report.plots import has_feature_norms
    from protofl.report.tables import load_run

    assert has_feature_norms(load_run(run.run_dir))
    # a copy of the run folder alone has no local diagnostics to show
    alone = run.run_dir.parent / "alone-copy"
    shutil.copytree(run.run_dir, alone, ignore=shutil.ignore_patterns("*.pt"))
    assert not has_feature_norms(load_run(alone))


def test_small_class_warnings_with_exact_counts_go_to_the_client_log_not_run_log(
    tmp_path: Path,
) -> None:
    """run.log is in the run folder: a warning naming a class's exact sample count (``only 2
    sample(s)``) is the client's, so it goes to ``<run>.client-local/client.log`` (0600)."""
    config = tiny_config("fedproto", "igpp", rounds=1).with_overrides(
        ["privacy.warn_min_count=1000", "run.save_releases=false"]
    )
    result = run_experiment(config, out=tmp_path)
    assert "sample(s)" not in (result.run_dir / "run.log").read_text()
    client_log = client_local_dir(result.run_dir) / "client.log"
    assert "local-only diagnostic" in client_log.read_text()
    assert _mode(client_log) == 0o600
