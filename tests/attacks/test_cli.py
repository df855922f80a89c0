from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from protofl.attacks.artifacts import load_run, rebuild_clients
from protofl.attacks.cli import add_attack_parsers, main
from protofl.engine.runner import run_experiment
from protofl.methods.checks import tiny_config


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-round FedProto run on ``toy`` with the ``pixels`` backbone, releases saved."""
    cfg = tiny_config("fedproto", "none", rounds=3).with_overrides(
        ["run.save_releases=true", "federation.keep_checkpoints=2"]  # round 2's: exact attacks
    )
    home = tmp_path_factory.mktemp("home")
    return run_experiment(cfg, out=tmp_path_factory.mktemp("runs"), home=home).run_dir


def test_parsers_register_attack_and_audit_with_handlers() -> None:
    parser = argparse.ArgumentParser()
    add_attack_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["attack", "RUN", "--attack", "fsh", "--round", "1", "--json"])
    assert (
        args.run_dir == "RUN" and args.attack == "fsh" and args.round == 1 and callable(args.func)
    )
    args = parser.parse_args(["audit", "--mechanism", "vpp", "--epsilon", "2", "--trials", "500"])
    assert args.mechanism == "vpp" and args.epsilon == 2.0 and args.delta == 1e-5
    assert callable(args.func)


def _class_means(feats: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.stack([feats[labels == c].mean(dim=0) for c in torch.unique(labels)])


def test_artifacts_rebuild_the_feature_path_of_the_release(tiny_run: Path) -> None:
    art = load_run(tiny_run)
    assert art.rounds == 3 and art.clients == ["red", "blue"]
    # no privacy: a release is the exact class means of the release-time features, so the
    # rebuilt members and models must reproduce it (round 1: the seeded initial model; round 3:
    # the checkpoint after round 2; both exact)
    for round_ in (1, 3):
        (view,) = rebuild_clients(art, ["blue"], round_=round_)
        feats = view.phi_z(view.train_z)
        assert feats.shape == (len(art.train_indices[1]), 32)
        saved = art.release(round_, 1)["prototypes"]
        assert torch.allclose(_class_means(feats, view.train_labels), saved, atol=1e-5)
    # the final models have moved on from the models that made round 1's release
    (final,) = rebuild_clients(art, ["blue"])
    drift = (
        _class_means(final.phi_z(final.train_z), final.train_labels)
        - art.release(1, 1)["prototypes"]
    )
    assert float(drift.abs().max()) > 1e-3
    # the image path and the cached-representation path agree
    x = view.backbone.preprocess(view.train_images[:5])
    with torch.no_grad():
        assert torch.allclose(view.phi_images(x), feats[:5], atol=1e-4)


def test_attack_mia_and_fsh_end_to_end(tiny_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["attack", str(tiny_run), "--attack", "mia"]) == 0
    printed = capsys.readouterr().out
    assert "MIA" in printed and "mean" in printed
    mia = json.loads((tiny_run / "attack_mia.json").read_text())
    assert mia["round"] == 3 and mia["mechanism"] == "none" and mia["epsilon"] is None
    assert "checkpoint-0002.pt" in mia["feature_path"]
    for key in (
        "mia_auc",
        "mia_tpr_at_1fpr",
        "mia_advantage",
        "mia_f1",
        "mia_pc_auc",
        "mia_cal_auc",
    ):
        assert 0.0 <= mia["mean"][key] <= 1.0
    assert set(mia["clients"]) == {"red", "blue"}
    assert mia["device"] == "cpu"  # the run's run.device (auto), resolved on this machine

    code = main(
        [
            "attack",
            str(tiny_run),
            "--attack",
            "fsh",
            "--client",
            "red",
            "--round",
            "1",
            "--steps",
            "30",
            "--json",
        ]
    )
    assert code == 0
    fsh = json.loads(capsys.readouterr().out)
    assert fsh["round"] == 1 and list(fsh["clients"]) == ["red"]
    assert -1.0 <= fsh["mean"]["cos_sim"] <= 1.0 and fsh["mean"]["cffd"] >= 0
    assert 0.0 <= fsh["mean"]["top1_hit"] <= 1.0
    assert (tiny_run / "attack_fsh.json").exists() and (tiny_run / "attack_fsh_red.png").exists()
    assert fsh["settings"]["device"] == "cpu"


def test_attack_on_a_device_torch_cannot_see_is_one_line(
    tiny_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["attack", str(tiny_run), "--attack", "fsh", "--device", "cuda"]) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "torch sees no CUDA GPU" in errors[0]  # one line, no traceback


def test_attack_bad_input_names_what_is_missing(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["attack", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["attack", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "config.yaml" in err and "artifacts.pt" in err
    no_art = tmp_path / "no-artifacts"
    no_art.mkdir()
    shutil.copy(tiny_run / "config.yaml", no_art / "config.yaml")
    assert main(["attack", str(no_art)]) == 2
    err = capsys.readouterr().err
    assert "artifacts.pt" in err and "save_releases" in err and "config.yaml" not in err
    assert main(["attack", str(tiny_run), "--round", "9"]) == 2
    assert "round=9" in capsys.readouterr().err
    assert main(["attack", str(tiny_run), "--client", "purple"]) == 2
    assert "red, blue" in capsys.readouterr().err


def test_audit_cli_json_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "audit",
            "--mechanism",
            "igpp",
            "--epsilon",
            "2",
            "--trials",
            "2000",
            "--release-trials",
            "200",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("epsilon_claimed", "epsilon_lower_bound", "trials", "violation"):
        assert key in out
    assert out["trials"] == 2000 and out["violation"] is False
    assert (
        main(
            ["audit", "--mechanism", "vpp", "--epsilon", "1", "--mode", "fast", "--trials", "1000"]
        )
        == 0
    )
    assert "no violation" in capsys.readouterr().out
    assert main(["audit", "--mechanism", "igpp", "--epsilon", "1", "--trials", "10"]) == 2
    assert "trials=10" in capsys.readouterr().err
    assert main(["audit", "--mechanism", "igpp", "--epsilon", "0"]) == 2
    assert "epsilon=0.0" in capsys.readouterr().err
