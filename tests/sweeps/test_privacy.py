"""A selection sweep states what it costs in privacy: every validation run and every test run
releases the same clients' training data, so selection.json composes all their DP events, and
the choice (argmax over private validation accuracy) is stated as not covered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from protofl.methods.checks import tiny_config
from protofl.privacy.accounting import epsilon_spent
from protofl.sweeps import (
    TUNING_GAP,
    VALIDATION_GAP,
    format_selection,
    load_sweep,
    run_selection,
    selection_privacy,
)


def _selection(
    tmp_path: Path, name: str, grid: dict[str, Any], **privacy: Any
) -> tuple[dict[str, Any], Path, Any]:
    base = tiny_config("fedproto", "none", rounds=2).to_dict()
    base["federation"]["local_epochs"] = 1
    base["privacy"].update({"mechanism": "igpp", "epsilon": 1.0, **privacy.pop("privacy", {})})
    base["federation"].update(privacy.pop("federation", {}))
    base["method"]["params"] = {"eval": "prototype"}
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": name,
                "base": base,
                "grid": grid,
                "select": {
                    "key": "privacy.clip",
                    "values": [20.0, 0.5],
                    "validation_fraction": 0.3,
                },
            }
        )
    )
    plan = load_sweep(path)
    result = run_selection(plan, sweep_dir=tmp_path / name, jobs=1, progress=False)
    assert not result.failed
    record = json.loads((tmp_path / name / "selection.json").read_text())
    assert record == json.loads(json.dumps(result.record, default=str))
    return record, tmp_path / name, plan


def _releases(run_dir: Path) -> int:
    """The releases of the run's most-releasing client, from its metrics.jsonl."""
    counts: dict[str, int] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        for name in json.loads(line)["participants"]:
            counts[name] = counts.get(name, 0) + 1
    return max(counts.values())


def _events(run_dir: Path) -> list[dict[str, Any]]:
    """The DP events of a run's most-releasing client, rebuilt from what its summary states
    (sigma, VPP's selection epsilon), independently of the sweep's own bookkeeping."""
    privacy = json.loads((run_dir / "summary.json").read_text())["privacy"]
    one = [{"kind": "gaussian", "noise_multiplier": privacy["sigma"]}]
    if privacy["mechanism"] in ("vpp", "vpdr"):
        assert privacy["vpp_variant"] == "paper"  # one selection every release
        one = [{"kind": "pure", "epsilon": privacy["vpp_eps_select"]}, *one]
    return one * _releases(run_dir)


def test_selection_json_composes_every_run_and_states_tuning_not_covered(
    tmp_path: Path,
) -> None:
    record, sweep_dir, _ = _selection(
        tmp_path, "sel", {"privacy.mechanism": ["igpp", "none"], "seed": [0, 1]}
    )
    igpp, none = record["groups"]
    assert igpp["group"] == {"privacy.mechanism": "igpp"} and igpp["chosen"] is not None
    total = igpp["privacy"]
    # 2 candidates x 2 seeds validation runs + 2 seeds test runs, 2 releases each
    runs = [c for v in igpp["validation"] for c in v["runs"]] + list(igpp["test"]["runs"])
    assert len(runs) == 6 and total["runs"] == 6 and total["releases"] == 12
    assert sorted(r["run"] for r in total["per_run"]) == sorted(runs)
    events = [e for run in runs for e in _events(sweep_dir / run)]
    independent = epsilon_spent(events, delta=1e-5, accountant="pld")
    assert total["epsilon"] == pytest.approx(independent, rel=1e-9)
    for run in runs:  # each run states (1, 1e-5) for itself; the selection costs far more
        summary = json.loads((sweep_dir / run / "summary.json").read_text())
        assert summary["privacy"]["guarantee"]["epsilon"] == 1.0
    assert total["run_epsilon"] == 1.0 and total["epsilon"] > 2.0
    assert total["delta"] == 1e-5 and total["accountant"] == "pld"
    # the choice is not charged: the selection's guarantee is never complete
    assert total["complete"] is False and total["holds_against_server"] is False
    assert total["not_covered"][:2] == [VALIDATION_GAP, TUNING_GAP]
    assert "tuning (argmax over private validation accuracy)" in total["statement"]
    assert f"({total['epsilon']:.4g}, 1e-05)" in total["statement"]
    # a group without a mechanism has no guarantee, and neither has the whole selection
    assert none["privacy"]["epsilon"] is None
    assert "no privacy guarantee" in none["privacy"]["statement"]
    assert record["privacy"]["epsilon"] is None and record["privacy"]["runs"] == 12
    # every test run's summary says its own guarantee does not cover the selection
    for run in igpp["test"]["runs"]:
        note = json.loads((sweep_dir / run / "summary.json").read_text())["privacy"]["selection"]
        assert note["role"] == "test" and note["value"] == igpp["chosen"]
        assert note["epsilon"] == total["epsilon"] and note["complete"] is False
        assert "covers its own releases only, not the selection" in note["statement"]
    for c in igpp["validation"]:
        for run in c["runs"]:
            note = json.loads((sweep_dir / run / "summary.json").read_text())["privacy"][
                "selection"
            ]
            assert note["role"] == "validation" and note["value"] == c["value"]
            assert VALIDATION_GAP in note["not_covered"]
    # ... and so does the console
    text = format_selection(record)
    assert total["statement"] in text and none["privacy"]["statement"] in text
    assert "privacy of the whole selection: no privacy guarantee" in text


def test_partial_participation_and_vpdr_charge_the_most_releasing_client(
    tmp_path: Path,
) -> None:
    record, sweep_dir, plan = _selection(
        tmp_path,
        "vp",
        {"seed": [0]},
        privacy={"mechanism": "vpdr"},
        federation={"participation": 0.5, "rounds": 3},
    )
    (group,) = record["groups"]
    total = group["privacy"]
    runs = [c for v in group["validation"] for c in v["runs"]] + list(group["test"]["runs"])
    assert total["runs"] == 3
    spent = [
        json.loads((sweep_dir / r / "summary.json").read_text())["privacy"]["epsilon_spent"]
        for r in runs
    ]
    assert any(len(set(s.values())) > 1 for s in spent)  # the clients released unequally
    events = [e for run in runs for e in _events(sweep_dir / run)]
    assert any(e["kind"] == "pure" for e in events)
    assert total["releases"] == sum(_releases(sweep_dir / r) for r in runs)
    assert total["epsilon"] == pytest.approx(epsilon_spent(events, delta=1e-5), rel=1e-9)
    assert total["epsilon"] > max(max(s.values()) for s in spent)
    # with one group the whole selection is that group
    assert record["privacy"]["epsilon"] == total["epsilon"]
    # a ledger that disagrees with the counted releases gives no number, naming the run
    run = sweep_dir / runs[0]
    summary = json.loads((run / "summary.json").read_text())
    summary["privacy"]["epsilon_spent"] = {
        k: v / 2 for k, v in summary["privacy"]["epsilon_spent"].items()
    }
    (run / "summary.json").write_text(json.dumps(summary))
    config = plan.validation[0].point.config
    checked = selection_privacy([(runs[0], config, run)])
    assert checked["epsilon"] is None and runs[0] in checked["error"]
