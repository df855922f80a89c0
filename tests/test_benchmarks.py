"""The benchmarks' models of the work they time: their arithmetic counts match what the engine
computes (the floors in docs/performance.md divide by them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch.utils.flop_counter import FlopCounterMode

from protofl.config import ExperimentConfig
from protofl.data.cache import protofl_home
from protofl.engine.batched import BatchedTrainer
from protofl.engine.federated_data import build_federated_data
from protofl.engine.simulation import Simulation

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_suite import train_macs_per_row


@pytest.mark.parametrize("train_projection", [True, False])
def test_the_floor_counts_the_arithmetic_the_batched_trainer_does(train_projection: bool) -> None:
    """One batched round of 8 clients of 80 rows in batches of 16 (no step padded): torch's
    FLOP counter over the round equals 2 x the count x rows x epochs, to the FLOP."""
    over = {
        "data.name": "toy",
        "data.train_fraction": "1",
        "data.clients_per_domain": "2",
        "backbone.name": "pixels",
        "backbone.image_size": "16",
        "backbone.proto_dim": "32",
        "backbone.train_projection": str(train_projection).lower(),
        "federation.batch_size": "16",
        "federation.local_epochs": "2",
        "federation.execution": "batched",
        "run.progress": "false",
    }
    cfg = ExperimentConfig().with_overrides([f"{k}={v}" for k, v in over.items()])
    data = build_federated_data(cfg, protofl_home())
    rows = [c.num_train for c in data.clients]
    assert all(n % 16 == 0 for n in rows), rows  # full steps only: nothing padded
    sim = Simulation(cfg, data)
    sim.global_state = sim.method.aggregate(sim.collect_uploads(), 0)
    trainer = BatchedTrainer(sim)
    trainer.train(sim.clients)  # adopts the clients (a round like any other)
    with FlopCounterMode(display=False) as counter:
        trainer.train(sim.clients)
    expected = 2 * train_macs_per_row(cfg, data) * sum(rows) * cfg.federation.local_epochs
    assert counter.get_total_flops() == expected


def test_the_count_refuses_a_head_it_does_not_model() -> None:
    cfg = ExperimentConfig().with_overrides(["backbone.head=mlp"])
    with pytest.raises(ValueError, match=r"backbone\.head='mlp'"):
        train_macs_per_row(cfg, None)  # type: ignore[arg-type]
