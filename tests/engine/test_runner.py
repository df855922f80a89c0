from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from protofl.cli import main
from protofl.config import ExperimentConfig
from protofl.engine.runner import run_experiment
from protofl.errors import ConfigError
from tests.engine.helpers import stop_in_round, toy_config


def _toy(rounds: int = 2, **extra: str) -> ExperimentConfig:
    return toy_config(rounds, *(f"{k}={v}" for k, v in extra.items()))


def test_run_folder_has_config_metrics_summary_and_log(tmp_path: Path) -> None:
    result = run_experiment(_toy(), out=tmp_path)
    d = result.run_dir
    assert d.parent == tmp_path
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "run.log", "artifacts.pt"):
        assert (d / name).exists(), name
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert set(rows[0]["acc"]) == {"red", "green", "blue", "grey"}
    summary = json.loads((d / "summary.json").read_text())
    assert 0 <= summary["avg_acc"] <= 1 and summary["rounds"] == 2
    assert summary["privacy"]["mechanism"] == "none"
    assert ExperimentConfig.from_yaml(d / "config.yaml") == _toy()


def test_same_seed_same_numbers_other_seed_other_numbers(tmp_path: Path) -> None:
    keys = ("acc", "avg_acc", "std_acc", "final_train_loss", "client_acc")
    a = run_experiment(_toy(), out=tmp_path).summary
    b = run_experiment(_toy(), out=tmp_path).summary
    c = run_experiment(_toy(seed="3"), out=tmp_path).summary
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert a["final_train_loss"] != c["final_train_loss"]


def test_several_clients_per_domain_and_dirichlet(tmp_path: Path) -> None:
    cfg = _toy(
        **{
            "data.clients_per_domain": "2",
            "data.partition": "dirichlet",
            "data.dirichlet_alpha": "1.0",
        }
    )
    result = run_experiment(cfg, out=tmp_path)
    assert len(result.summary["clients"]) == 8
    assert set(result.summary["acc"]) == {"red", "green", "blue", "grey"}
    assert sum(result.summary["num_train"].values()) == 4 * 4 * 40


def test_fedproto_beats_nothing_on_toy(tmp_path: Path) -> None:
    result = run_experiment(_toy(rounds=3), out=tmp_path)
    assert result.summary["avg_acc"] > 0.5  # chance is 0.25


def test_cli_run_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "run",
            "--quiet",
            "--json",
            "--out",
            str(tmp_path),
            "--set",
            "data.name=toy",
            "--set",
            "backbone.name=pixels",
            "--set",
            "backbone.image_size=16",
            "--set",
            "federation.rounds=1",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert Path(out["run_dir"]).exists()
    assert main(["run", "--set", "method.name=fedprot"]) == 2
    assert "did you mean 'fedproto'" in capsys.readouterr().err
    assert main(["run", "--set", "data.name=nope"]) == 2
    assert "valid data sets" in capsys.readouterr().err
    assert main(["run", "--set", "federation.rounds=0"]) == 2
    assert "federation.rounds" in capsys.readouterr().err


def test_cli_datasets_lists_availability(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["datasets"]) == 0
    out = capsys.readouterr().out
    assert "toy" in out and "available" in out


def test_features_not_finite_is_caught() -> None:
    from protofl.privacy.base import NoPrivacy
    from protofl.privacy.config import PrivacyConfig

    mech = NoPrivacy(PrivacyConfig(), rounds=1, dim=2)
    with pytest.raises(ValueError, match="client 'mnist'"):
        mech.release(
            torch.tensor([[float("nan"), 0.0]]),
            torch.tensor([0]),
            num_classes=1,
            generator=torch.Generator(),
            client="mnist",
        )


def test_membership_inference_every_round_is_written_to_metrics(tmp_path: Path) -> None:
    cfg = _toy(**{"privacy.mechanism": "igpp", "run.mia_every": "1"})
    result = run_experiment(cfg, out=tmp_path)
    from protofl.engine.rundir import read_rounds

    rows = read_rounds(result.run_dir)  # metrics.jsonl + the client-local diagnostics.jsonl
    assert len(rows) == 2
    for row in rows:
        assert set(row["mia"]) == {"red", "green", "blue", "grey"}
        assert 0.0 <= row["mia"]["red"]["mia_auc"] <= 1.0
        assert set(row["feature_norms"]["red"]) >= {"mean", "q50", "frac_above_clip"}


def test_cli_stops_quietly_when_its_reader_goes_away(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse
    import sys

    from protofl import cli

    def closed_pipe(args: argparse.Namespace) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    parser = cli.build_parser()
    real_parse = parser.parse_args

    def parse(argv: object = None) -> argparse.Namespace:
        args = real_parse(["config"])
        args.func = closed_pipe
        return args

    monkeypatch.setattr(parser, "parse_args", parse)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    with open(tmp_path / "out.txt", "w") as out:
        monkeypatch.setattr(sys, "stdout", out)
        assert cli.main([]) == 141  # 128 + SIGPIPE, no traceback


def test_ctrl_c_in_a_run_is_one_line_and_the_run_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On main, Ctrl-C during `protofl run` printed a traceback; now one line and exit 130,
    and the run folder resumes to the uninterrupted numbers."""
    from protofl.engine.runner import resume_experiment
    from protofl.methods.checks import tiny_config

    cfg = tiny_config("fedproto", "none", rounds=3)
    path = tmp_path / "cfg.yaml"
    path.write_text(cfg.to_yaml())
    reference = run_experiment(cfg, out=tmp_path / "ref").summary
    with monkeypatch.context() as patch:
        stop_in_round(patch, 3)
        assert main(["run", str(path), "--quiet", "--out", str(tmp_path / "stopped")]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("protofl: stopped (interrupted)"), err
    (run_dir,) = (tmp_path / "stopped").glob("*/config.yaml")  # (and its .client-local)
    run_dir = run_dir.parent
    assert f"`protofl run --resume {run_dir}` continues it" in err[0]  # issue 43: the command
    resumed = resume_experiment(run_dir).summary
    assert resumed["avg_acc"] == reference["avg_acc"]


def test_noisy_add_remove_counts_are_accepted_and_weight_the_average(tmp_path: Path) -> None:
    from protofl.engine.federated_data import build_federated_data
    from protofl.engine.simulation import Simulation
    from protofl.methods.checks import tiny_config

    config = tiny_config("feddap", "igpp", rounds=4).with_overrides(
        ["privacy.neighbouring=add_remove", "privacy.addremove_counts=noisy", "privacy.epsilon=1"]
    )
    sim = Simulation(config, build_federated_data(config, tmp_path))
    assert not sim.counts_public
    for _ in range(4):
        m = sim.run_round()
        assert m.rejected == []
    for c, release in zip(sim.clients, sim.releases[-1]):
        assert release is not None
        assert sim.public_count(c) == int(release.counts.sum()) != c.data.num_train


# ----- extending a finished run ---------------------------------------------------------------
def _accountant_epsilon(sigma: float, releases: int, delta: float) -> float:
    from protofl.privacy.accounting import epsilon_spent

    events = [{"kind": "gaussian", "noise_multiplier": sigma}] * releases
    return epsilon_spent(events, delta=delta, accountant="pld")


def test_extending_a_finished_run_composes_every_release_and_says_so(tmp_path: Path) -> None:
    from protofl.engine.runner import extend_experiment

    config = _toy(2, **{"privacy.mechanism": "igpp", "privacy.epsilon": "1"})
    first = run_experiment(config, out=tmp_path)
    run_dir = first.run_dir
    config_text = (run_dir / "config.yaml").read_text()
    sigma, delta = first.summary["privacy"]["sigma"], first.summary["privacy"]["delta"]
    original = max(first.summary["privacy"]["epsilon_spent"].values())
    assert original <= 1.0

    result = extend_experiment(run_dir, 2, progress=False)
    privacy = result.summary["privacy"]
    total = _accountant_epsilon(sigma, 4, delta)  # T + N = 4 releases at the calibrated sigma
    assert privacy["epsilon"] == pytest.approx(total, rel=1e-9) and total > 1.0 > 0
    assert all(e == pytest.approx(total, rel=1e-9) for e in privacy["epsilon_spent"].values())
    assert privacy["sigma"] == sigma  # the noise is what was calibrated, not recalibrated
    assert privacy["calibrated"] == {
        "mechanism": "igpp",
        "epsilon": 1.0,
        "delta": delta,
        "rounds": 2,
        "accountant": "pld",
        "release_schedule": "every_round",
    }
    statement = privacy["guarantee"]["statement"]
    assert statement.startswith(f"({total:g}, {delta:g})-local DP") and "(4 releases)" in statement
    assert "EXTENDED" in statement and privacy["guarantee"]["epsilon"] == privacy["epsilon"]
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["rounds"] == 4 and on_disk["privacy"]["epsilon"] == privacy["epsilon"]
    record = json.loads((run_dir / "extensions.json").read_text())["extensions"]
    assert [(e["from_round"], e["to_round"], e["rounds"]) for e in record] == [(2, 4, 2)]
    assert record[0]["epsilon_before"] == pytest.approx(original, rel=1e-9)
    assert record[0]["epsilon_after"] == pytest.approx(total, rel=1e-9)
    log_text = (run_dir / "run.log").read_text()
    assert "the original epsilon no longer holds" in log_text and "raised from 2 to 4" in log_text
    rounds = [json.loads(s)["round"] for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3, 4]
    assert (run_dir / "config.yaml").read_text() == config_text  # what the run was calibrated for

    # a stopped extension resumes to the extended target; a second extension composes on
    from protofl.engine.runner import resume_experiment

    again = resume_experiment(run_dir, progress=False)
    assert (
        again.summary["rounds"] == 4 and again.summary["privacy"]["epsilon"] == privacy["epsilon"]
    )
    more = extend_experiment(run_dir, 1, progress=False)
    assert more.summary["privacy"]["epsilon"] == pytest.approx(
        _accountant_epsilon(sigma, 5, delta), rel=1e-9
    )

    # editing config.yaml by hand is still refused, extended or not
    (run_dir / "config.yaml").write_text(config_text.replace("rounds: 2", "rounds: 5"))
    from protofl.config import ConfigError

    with pytest.raises(ConfigError, match=r"federation\.rounds: 2 -> 5"):
        resume_experiment(run_dir)
    with pytest.raises(ConfigError, match=r"federation\.rounds: 2 -> 5"):
        extend_experiment(run_dir, 1)


def test_the_release_limit_is_raised_explicitly_never_bypassed() -> None:
    from protofl.engine.extension import raise_release_limit
    from protofl.privacy import create_mechanism
    from protofl.privacy.config import PrivacyConfig

    mech = create_mechanism(PrivacyConfig(mechanism="igpp", epsilon=1.0), rounds=2, dim=8)
    x, y = torch.randn(6, 8), torch.tensor([0, 0, 1, 1, 0, 1])
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        mech.release(x, y, num_classes=2, generator=gen, client="c")
    with pytest.raises(RuntimeError, match="calibrated for"):
        mech.release(x, y, num_classes=2, generator=gen, client="c")
    sigma = mech.sigma
    raise_release_limit(mech, 3)
    mech.release(x, y, num_classes=2, generator=gen, client="c")
    assert mech.sigma == sigma  # same noise: the epsilon spent grows instead
    with pytest.raises(RuntimeError, match="calibrated for"):
        mech.release(x, y, num_classes=2, generator=gen, client="c")
    with pytest.raises(ValueError, match="below"):
        raise_release_limit(mech, 2)


def test_extend_refuses_unfinished_runs_and_bad_rounds_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from protofl.config import ConfigError
    from protofl.engine.runner import extend_experiment

    run_dir = run_experiment(_toy(2), out=tmp_path / "a").run_dir
    for bad in ("0", "-3"):
        assert main(["extend", str(run_dir), "--rounds", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "whole number of rounds >= 1" in err
    with pytest.raises(SystemExit):  # argparse: not an integer
        main(["extend", str(run_dir), "--rounds", "two"])
    assert "invalid int value" in capsys.readouterr().err
    (run_dir / "summary.json").unlink()  # as a run killed before its end leaves it
    assert main(["extend", str(run_dir), "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has not finished" in err and "--resume" in err
    assert not (run_dir / "extensions.json").exists()
    bare = run_experiment(_toy(1, **{"federation.checkpoint": "false"}), out=tmp_path / "b")
    with pytest.raises(ConfigError, match=r"federation\.checkpoint=false"):
        extend_experiment(bare.run_dir, 1)
    assert main(["extend", str(tmp_path / "nowhere"), "--rounds", "1"]) == 2
    assert "is not a run folder" in capsys.readouterr().err


def test_release_schedule_once_extends_without_spending(tmp_path: Path) -> None:
    from protofl.engine.runner import extend_experiment

    config = _toy(2, **{"privacy.mechanism": "igpp", "privacy.release_schedule": "once"})
    first = run_experiment(config, out=tmp_path / "runs")
    eps = first.summary["privacy"]["guarantee"]["epsilon"]
    assert max(first.summary["privacy"]["epsilon_spent"].values()) == pytest.approx(eps, rel=1e-3)
    result = extend_experiment(first.run_dir, 2, progress=False)
    privacy = result.summary["privacy"]
    assert privacy["guarantee"]["epsilon"] == eps  # the one release is re-sent: no new cost
    assert max(privacy["epsilon_spent"].values()) == pytest.approx(eps, rel=1e-3)
    assert result.summary["rounds"] == 4


def test_one_shot_private_class_means_classify_by_nearest_mean_with_a_complete_guarantee(
    tmp_path: Path,
) -> None:
    """Issue 44, item 2: every client releases its class means once with the whole budget
    (release_schedule once), nothing trains (local_epochs 0) and the server's global means
    classify by nearest mean (fedproto eval: prototype).  No model depends on the private data
    beyond the release, so with a secret key nothing is listed as not covered; batched and
    sequential execution agree."""
    overrides = {
        "privacy.mechanism": "igpp",
        "privacy.release_schedule": "once",
        "privacy.noise_seed": "secret",
        "federation.local_epochs": "0",
        "method.params.eval": "prototype",
    }
    seq = run_experiment(_toy(1, **overrides), out=tmp_path / "seq")
    guarantee = seq.summary["privacy"]["guarantee"]
    assert guarantee["complete"] and guarantee["not_covered"] == []
    assert "one release" in guarantee["statement"]
    assert seq.summary["final_train_loss"] == 0.0
    derived = {**overrides, "privacy.noise_seed": "derived"}
    a = run_experiment(_toy(1, **derived), out=tmp_path / "a")
    b = run_experiment(
        _toy(1, **derived, **{"federation.execution": "batched"}), out=tmp_path / "b"
    )
    assert a.summary["acc"] == b.summary["acc"]
    # training between releases brings the gaps back
    trained = run_experiment(
        _toy(
            2,
            **{
                **overrides,
                "federation.local_epochs": "1",
                "privacy.release_schedule": "every_round",
            },
        ),
        out=tmp_path / "t",
    )
    gaps = " ".join(trained.summary["privacy"]["guarantee"]["not_covered"])
    assert "trained feature map" in gaps and "per-client evaluation" in gaps
    with pytest.raises(ConfigError, match=r"federation\.local_epochs"):
        _toy(1, **{"federation.local_epochs": "-1"})
