"""What a run's guarantee covers: stated per client in summary.json, the console and the report."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from protofl.engine.runner import run_experiment
from protofl.methods.checks import tiny_config
from protofl.privacy import PrivacyConfig
from protofl.privacy.guarantee import (
    CLUSTER_GAP,
    DIAGNOSTICS_GAP,
    EVALUATION_GAP,
    TRAINED_MAP_GAP,
    WEIGHTS_GAP,
    describe_guarantee,
)
from protofl.report.console import print_summary


def test_clustered_releases_say_membership_is_not_covered() -> None:
    cfg = PrivacyConfig(mechanism="igpp", epsilon=1.0)
    g = describe_guarantee(cfg, noise_key="secret", rounds=20, clustered=True)
    assert CLUSTER_GAP in g["not_covered"] and not g["complete"]
    assert "NOT covered: cluster membership" in g["statement"]
    plain = describe_guarantee(cfg, noise_key="secret", rounds=20)
    assert plain["complete"] and plain["not_covered"] == [] and plain["epsilon"] == 1.0
    assert plain["neighbouring"] == "replace_one" and "public" in plain["counts"]
    w = describe_guarantee(cfg, noise_key="secret", rounds=20, shares_weights=True)
    assert WEIGHTS_GAP in w["not_covered"] and not w["holds_against_server"]
    none = describe_guarantee(PrivacyConfig(), noise_key="derived", rounds=20)
    assert none["epsilon"] is None and none["statement"].startswith("no privacy guarantee")


def test_summary_and_console_state_the_guarantee(tmp_path: Path) -> None:
    config = tiny_config("fedplvm", "igpp", rounds=1).with_overrides(
        ["run.save_releases=false", "privacy.noise_seed=secret"]
    )
    result = run_experiment(config, out=tmp_path)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    g = summary["privacy"]["guarantee"]
    assert g["noise_key"] == "secret" and CLUSTER_GAP in g["not_covered"]
    console = Console(record=True, width=400)
    print_summary(summary, str(result.run_dir), console=console)
    text = console.export_text()
    assert "guarantee: (8, 1e-05)-local DP per client" in text
    assert "NOT covered: cluster membership" in text
    local = tiny_config("fedplvm", "igpp", rounds=1).with_overrides(
        ["method.params.local_clustering=false", "privacy.noise_seed=secret"]
    )
    g = run_experiment(local, out=tmp_path).summary["privacy"]["guarantee"]
    assert g["not_covered"] == [EVALUATION_GAP]  # only the simulator's reported accuracies


def test_evaluation_and_diagnostics_reaching_the_server_make_the_guarantee_incomplete() -> None:
    cfg = PrivacyConfig(mechanism="igpp", epsilon=1.0)
    g = describe_guarantee(cfg, noise_key="secret", rounds=20, evaluation_reported=True)
    assert EVALUATION_GAP in g["not_covered"] and not g["complete"]
    assert not g["holds_against_server"]
    d = describe_guarantee(cfg, noise_key="secret", rounds=20, diagnostics_reported=True)
    assert DIAGNOSTICS_GAP in d["not_covered"] and "NOT covered: diagnostics" in d["statement"]


def test_releases_through_a_map_trained_on_the_same_data_are_not_covered(tmp_path: Path) -> None:
    """The sensitivity 2R/n bounds one example's effect on a mean of features from a fixed map;
    a client that trains its adapter on its data between releases changes every feature when
    one example changes.  Every multi-round engine run says so; the first release (public
    initialisation) and the plug-in over a frozen encoder are covered."""
    from protofl.privacy import PrototypePrivacy

    cfg = PrivacyConfig(mechanism="igpp", epsilon=1.0)
    g = describe_guarantee(cfg, noise_key="secret", rounds=5, trained_feature_map=True)
    assert TRAINED_MAP_GAP in g["not_covered"] and not g["complete"]
    assert "NOT covered: the trained feature map" in g["statement"]
    assert describe_guarantee(cfg, noise_key="secret", rounds=1, trained_feature_map=True)[
        "complete"
    ]
    config = tiny_config("fedproto", "igpp", rounds=2).with_overrides(
        ["run.save_releases=false", "privacy.noise_seed=secret"]
    )
    g = run_experiment(config, out=tmp_path).summary["privacy"]["guarantee"]
    assert g["not_covered"] == [TRAINED_MAP_GAP, EVALUATION_GAP]
    facade = PrototypePrivacy(rounds=3, mechanism="igpp")
    assert facade.guarantee()["complete"]
    assert TRAINED_MAP_GAP in facade.guarantee(trained_feature_map=True)["not_covered"]
