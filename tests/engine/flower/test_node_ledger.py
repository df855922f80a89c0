"""A deployed node's budget is per data partition, across runs, and the server cannot raise it."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest

from protofl.engine.flower.client_app import make_client_app
from protofl.engine.flower.inline import InlineGrid
from protofl.engine.flower.server_app import ServerOutcome, run_flower_server
from protofl.methods.checks import tiny_config
from protofl.privacy.accounting import epsilon_spent
from protofl.privacy.node_ledger import BudgetExceeded, NodeLedger, data_fingerprint


def _deployed_run(home: Path, config: Any, node_config: dict[str, str]) -> ServerOutcome:
    app = make_client_app(config, home, deployment=True)
    grid = InlineGrid(app, 2)
    for ctx in grid.contexts.values():
        ctx.node_config.update(node_config)
    outcome = ServerOutcome()
    run_flower_server(
        grid, config, out=None, min_nodes=2, wait_timeout=10.0, round_timeout=30.0, outcome=outcome
    )
    return outcome


def test_runs_on_the_same_data_share_one_node_budget(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 41: three runs differing only in name each printed epsilon 1 while their releases
    composed to more.  Now the node charges every release of its data to one ledger and the
    run that would pass the node's budget is refused, whatever the server's config says."""
    ledgers = tmp_path / "ledgers"
    node = {"ledger-dir": str(ledgers), "privacy-budget": "1.2"}
    first = tiny_config("fedproto", "igpp", rounds=2).with_overrides(
        ["name=first", "privacy.epsilon=1"]
    )
    outcome = _deployed_run(tmp_path, first, node)
    assert outcome.summary  # the first run fits: epsilon 1 of 1.2
    files = sorted(ledgers.glob("ledger-*.json"))
    assert len(files) == 2  # one per partition, named by the data
    assert stat.S_IMODE(ledgers.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    entries = json.loads(files[0].read_text())["entries"]
    assert [e["round"] for e in entries] == [1, 2]
    # the server raises epsilon in its config: the node's budget does not move
    greedy = tiny_config("fedproto", "igpp", rounds=2).with_overrides(
        ["name=second", "privacy.epsilon=4"]
    )
    third = first.with_overrides(["name=third"])  # or just asks again
    for config in (greedy, third):
        refused = _deployed_run(tmp_path, config, node)
        # both nodes' releases were refused before anything left: the server charged none
        spent = refused.summary["privacy"]["epsilon_spent"]
        assert spent and all(not eps for eps in spent.values()), (config.name, spent)
    for f in files:  # nothing past the budget was charged (or released)
        assert len(json.loads(f.read_text())["entries"]) == 2
        data = json.loads(f.read_text())
        events = [e for entry in data["entries"] for e in entry["events"]]
        assert epsilon_spent(events, delta=1e-5, accountant="pld") <= 1.2


def test_the_node_ledger_refuses_before_writing_and_names_the_node_config(tmp_path: Path) -> None:
    fp = data_fingerprint("digits4", "mnist", __import__("numpy").arange(10))
    ledger = NodeLedger(tmp_path, fp, budget=1.0, delta=1e-5, accountant="pld")
    event = [{"kind": "gaussian", "noise_multiplier": 8.0}]
    eps = ledger.charge("run-a", 1, "igpp", event)
    assert 0 < eps < 1.0
    with pytest.raises(BudgetExceeded, match=r"node config privacy-budget"):
        ledger.charge("run-b", 1, "igpp", [{"kind": "gaussian", "noise_multiplier": 0.5}])
    assert len(ledger.entries()) == 1 and ledger.epsilon_spent() == pytest.approx(eps)
    other = data_fingerprint("digits4", "mnist", __import__("numpy").arange(11))
    assert other != fp  # other data, another ledger
    with pytest.raises(ValueError, match="privacy-budget='x' is not a number"):
        NodeLedger.for_node({"privacy-budget": "x"}, fp, accountant="pld", default_folder=tmp_path)


def test_evaluation_and_diagnostics_that_reach_the_server_are_not_covered(
    tmp_path: Path,
) -> None:
    """Issue 41: per-round accuracy (a function of the training data) and the simulation's
    diagnostics record reached the server while the guarantee said complete."""
    from protofl.engine.flower.run import run_flower_simulation

    config = tiny_config("fedproto", "igpp", rounds=1).with_overrides(["privacy.noise_seed=secret"])
    result = run_flower_simulation(config, home=tmp_path, backend="inline")
    g = result.summary["privacy"]["guarantee"]
    assert g["complete"] is False and "per-client evaluation" in g["statement"]
    assert not any(n.startswith("diagnostics") for n in g["not_covered"])
    opted = config.with_overrides(["run.diagnostics=true"])
    g = run_flower_simulation(opted, home=tmp_path, backend="inline").summary["privacy"][
        "guarantee"
    ]
    assert any(n.startswith("diagnostics") for n in g["not_covered"])


def test_a_deployed_node_charges_its_one_release_once_under_release_schedule_once(
    tmp_path: Path,
) -> None:
    """release_schedule=once on a deployment: the node's own ledger holds the one release; the
    re-sends of rounds 2 and 3 are not charged again (issue 44)."""
    ledgers = tmp_path / "ledgers"
    config = tiny_config("fedproto", "igpp", rounds=3).with_overrides(
        ["privacy.epsilon=1", "privacy.release_schedule=once"]
    )
    outcome = _deployed_run(tmp_path, config, {"ledger-dir": str(ledgers), "privacy-budget": "1"})
    assert [len(m.rejected) for m in outcome.history] == [0, 0, 0]
    files = sorted(ledgers.glob("ledger-*.json"))
    assert len(files) == 2
    for f in files:
        assert [e["round"] for e in json.loads(f.read_text())["entries"]] == [1]
    spent = outcome.summary["privacy"]["epsilon_spent"]
    assert all(0.99 < eps <= 1.0 for eps in spent.values())
