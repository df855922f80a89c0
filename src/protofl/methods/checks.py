"""``check_method``: the conformance suite every registered method passes with every mechanism."""

from __future__ import annotations

import io
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from protofl.config import ExperimentConfig


@dataclass
class CheckReport:
    """What ``check_method`` measured (it raises AssertionError on the first failure)."""

    method: str
    mechanism: str
    losses: list[float]
    avg_acc: list[float]


def tiny_config(
    method: str,
    mechanism: str,
    params: dict[str, Any] | None = None,
    rounds: int = 3,
    seed: int = 0,
) -> ExperimentConfig:
    """Two clients' worth of work on the generated ``toy`` set with the fast ``pixels`` backbone."""
    return ExperimentConfig.from_dict(
        {
            "name": f"check-{method}-{mechanism}",
            "seed": seed,
            "data": {"name": "toy", "train_fraction": 1.0, "domains": ["red", "blue"]},
            "backbone": {
                "name": "pixels",
                "image_size": 16,
                "proto_dim": 32,
                "adapter_hidden": 8,
                "feature_cache": False,
            },
            "federation": {"rounds": rounds, "local_epochs": 2, "batch_size": 32, "lr": 3e-3},
            "method": {"name": method, "params": params or {}},
            "privacy": {"mechanism": mechanism, "epsilon": 8.0, "clip": 1.0},
            "run": {"progress": False, "save_releases": False},
        }
    )


def _run(config: ExperimentConfig) -> tuple[Any, list[Any]]:
    from protofl.engine.federated_data import build_federated_data
    from protofl.engine.simulation import Simulation

    with tempfile.TemporaryDirectory() as tmp:
        data = build_federated_data(config, Path(tmp))
    sim = Simulation(config, data)
    return sim, sim.run()


def check_method(
    name: str, mechanism: str = "none", params: dict[str, Any] | None = None
) -> CheckReport:
    """Run a method for a few tiny rounds and assert the contract.

    Finite losses; training loss lower at the end than in the first round; identical metrics
    for the same seed; server and client state round-trip through ``torch.save``; every
    upload carries prototypes, classes and counts consistent with the client's data.
    """
    config = tiny_config(name, mechanism, params)
    sim, hist = _run(config)
    losses = [h.train_loss for h in hist]
    assert all(math.isfinite(v) for v in losses), f"{name}/{mechanism}: non-finite loss {losses}"
    assert losses[-1] < losses[0], f"{name}/{mechanism}: training loss did not go down {losses}"
    assert all(0.0 <= h.avg_acc <= 1.0 for h in hist)

    _, hist2 = _run(config)
    a = [h.to_json() | {"wall_s": 0} for h in hist]
    b = [h.to_json() | {"wall_s": 0} for h in hist2]
    assert a == b, f"{name}/{mechanism}: two runs with the same seed differ"

    # uploads carry exactly the declared prototypes and counts
    for round_releases in sim.releases:
        for client, release in zip(sim.clients, round_releases):
            if not sim.method.uses_prototypes:
                assert release is None
                continue
            assert release is not None
            k = release.num_prototypes
            assert release.prototypes.shape[1] == config.backbone.proto_dim
            assert release.classes.shape == (k,) and release.counts.shape == (k,)
            labels = client.data.train_y
            for c in torch.unique(release.classes).tolist():
                got = int(release.counts[release.classes == c].sum())
                assert got == int((labels == c).sum()), f"{name}: class {c} count mismatch"
            assert set(release.classes.tolist()) == set(labels.unique().tolist())
            assert torch.isfinite(release.prototypes).all()

    # server and client state round-trip
    buf = io.BytesIO()
    torch.save(
        {
            "server": sim.method.state_dict(),
            "clients": [c.state.tensors for c in sim.clients],
            "global": sim.global_state,
        },
        buf,
    )
    buf.seek(0)
    restored = torch.load(buf, weights_only=True)
    fresh = type(sim.method)(
        config.method.params,
        num_classes=sim.method.num_classes,
        num_domains=sim.method.num_domains,
        proto_dim=sim.method.proto_dim,
    )
    fresh.load_state_dict(restored["server"])
    _assert_same(fresh.state_dict(), sim.method.state_dict(), f"{name}: server state")
    for saved, c in zip(restored["clients"], sim.clients):
        _assert_same(saved, c.state.tensors, f"{name}: client state")
    _assert_same(restored["global"], sim.global_state, f"{name}: global state")
    return CheckReport(name, mechanism, losses, [h.avg_acc for h in hist])


def _assert_same(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert set(a) == set(b), f"{what}: keys differ"
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f"{what}: {k} differs after round-trip"
        elif isinstance(x, dict):
            _assert_same(x, y, f"{what}.{k}")
        else:
            assert x == y, f"{what}: {k} differs after round-trip"
