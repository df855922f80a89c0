"""A real Flower deployment on loopback: SuperLink + 2 SuperNodes + ``flwr run``.

Marked ``flower_deploy`` (skip locally with ``-m "not flower_deploy"``; CI runs it).  Every
started process is stopped by its id (process group) whether the run passed or failed, and the
test checks that none is left.  The deployment is authenticated (TLS, SuperNode keys, a partition
map from the registered identities).  One SuperNode is stopped after round 1: the server must
time the round out and finish the run with the other node.  A second run adds a SuperNode whose
key was never registered (the SuperLink refuses it) and a registered one bound to no partition
(the strategy refuses it and records it).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from protofl.config import ExperimentConfig
from protofl.engine.flower.app import write_flower_app
from protofl.engine.flower.deploy import LoopbackDeployment, group_alive
from protofl.methods.checks import tiny_config

pytestmark = [
    pytest.mark.flower_deploy,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
    pytest.mark.skipif(
        shutil.which("flower-superlink", path=str(Path(sys.executable).parent)) is None,
        reason="flower-superlink is not installed next to this Python",
    ),
]

ROUND_TIMEOUT = 20.0


def _two_clients(rounds: int) -> ExperimentConfig:
    """The tiny toy experiment with one client per domain (red, blue): two SuperNodes."""
    return tiny_config("fedproto", "vpdr", rounds=rounds).with_overrides(
        ["data.clients_per_domain=1"]
    )


def _wait_for_round(metrics: Path, rnd: int, proc_alive: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = list(metrics.parent.glob("*/metrics.jsonl")) if metrics.parent.exists() else []
        if files and len(files[0].read_text().splitlines()) >= rnd:
            return
        if not proc_alive():  # type: ignore[operator]
            raise AssertionError("flwr run ended before the round completed")
        time.sleep(0.5)
    raise AssertionError(f"round {rnd} did not complete within {timeout:.0f}s")


def test_loopback_deployment_runs_and_leaves_no_process(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    config = _two_clients(rounds=2)
    runs = tmp_path / "runs"
    app = write_flower_app(
        tmp_path / "app", config, out_dir=runs, round_timeout=ROUND_TIMEOUT, num_supernodes=2
    )
    dep = LoopbackDeployment(tmp_path / "deploy", 2)
    try:
        with dep:
            proc = dep.start_run(app)
            _wait_for_round(runs / "x", 1, lambda: proc.poll() is None, timeout=600)
            dep.stop_node(1)  # a SuperNode disappears mid-run
            code = proc.wait(timeout=600)
            assert code == 0, dep.logs()
    finally:
        pids = [p.pid for p in dep.procs]
        left = [pid for p in dep.procs for pid in group_alive(p.pid)]
    assert len(pids) == 4  # superlink, 2 supernodes, flwr run
    assert left == [], f"processes left behind: {left}"
    (summary_file,) = runs.glob("*/summary.json")
    summary = json.loads(summary_file.read_text())
    assert summary["rounds"] == 2 and summary["engine"] == "flower"
    assert summary["partition_map"] == {str(n): p for n, p in dep.partition_map.items()}
    assert sorted(summary["partition_map"].values()) == [0, 1]
    assert sorted(summary["clients"]) == ["blue", "red"]
    history = [json.loads(s) for s in next(runs.glob("*/metrics.jsonl")).read_text().splitlines()]
    assert history[0]["rejected"] == [] and sorted(history[0]["participants"]) == ["blue", "red"]
    assert history[1]["participants"] == ["red"]  # blue's node is gone
    assert history[1]["rejected"], "the vanished node must be reported"
    assert 0.0 <= summary["avg_acc"] <= 1.0
    # privacy against the server: every field the server received is on the allow-list (no
    # local-only diagnostics from deployed clients) and every client kept a secret noise key
    from protofl.engine.flower.codec import DIAGNOSTIC_RECORD, WIRE_FIELDS

    for phase, fields in summary["wire_fields"].items():
        allowed = {
            f"{record}.{key}"
            for record, keys in WIRE_FIELDS[phase].items()
            if record != DIAGNOSTIC_RECORD
            for key in keys
        }
        assert set(fields) <= allowed, phase
    assert "release.prototypes" in summary["wire_fields"]["release"]
    guarantee = summary["privacy"]["guarantee"]
    assert guarantee["noise_key"] == "secret"
    assert set(guarantee["noise_key_per_client"].values()) == {"secret"}
    print(f"loopback deployment test: {time.perf_counter() - t0:.1f}s")


def _wait_online(dep: LoopbackDeployment, node_ids: set[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not node_ids <= dep.online_node_ids():
        if time.monotonic() > deadline:
            raise AssertionError(f"nodes {sorted(node_ids)} not online after {timeout:.0f}s")
        time.sleep(1.0)


def test_an_unregistered_supernode_is_refused_and_an_unbound_one_recorded(
    tmp_path: Path,
) -> None:
    t0 = time.perf_counter()
    config = _two_clients(rounds=1)
    runs = tmp_path / "runs"
    app = write_flower_app(
        tmp_path / "app", config, out_dir=runs, round_timeout=ROUND_TIMEOUT, num_supernodes=2
    )
    dep = LoopbackDeployment(tmp_path / "deploy", 2)
    try:
        with dep:
            dep.start_node("rogue", 0, register=False)  # a key the SuperLink never saw
            rogue = dep.procs[-1]
            dep.start_node("intruder", 0)  # registered, bound to no partition, claims red's
            _wait_online(dep, set(dep.node_ids.values()), timeout=120)
            assert rogue.wait(timeout=120) != 0, "the unregistered SuperNode was let in"
            code = dep.flwr_run(app, timeout=600)
            assert code == 0, dep.logs()
    finally:
        left = [pid for p in dep.procs for pid in group_alive(p.pid)]
    assert left == [], f"processes left behind: {left}"
    deploy = tmp_path / "deploy"
    assert "Failed to activate SuperNode" in (deploy / "rogue.log").read_text()
    assert "No SuperNode found with the given public key" in (deploy / "superlink.log").read_text()
    assert "rogue" not in dep.node_ids and len(set(dep.node_ids.values())) == 3
    (summary_file,) = runs.glob("*/summary.json")
    summary = json.loads(summary_file.read_text())
    assert summary["rounds"] == 1 and sorted(summary["clients"]) == ["blue", "red"]
    bound = {str(n): p for n, p in dep.partition_map.items()}
    assert summary["partition_map"] == bound and str(dep.node_ids["intruder"]) not in bound
    (record,) = [json.loads(s) for s in next(runs.glob("*/metrics.jsonl")).read_text().splitlines()]
    assert sorted(record["participants"]) == ["blue", "red"]
    assert record["rejected"] == [
        {
            "client": "red",
            "node": str(dep.node_ids["intruder"]),
            "phase": "hello",
            "reason": "claims partition 0, its identity is bound to no partition",
        }
    ]
    print(f"authenticated deployment test: {time.perf_counter() - t0:.1f}s")
