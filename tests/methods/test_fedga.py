"""FedGA: the generalisation adjustment of the aggregation weights, by hand."""

from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from protofl.engine.round import combine_weights
from protofl.methods import create_method
from protofl.methods.base import ClientState, Upload, WeightPlan
from protofl.methods.fedga import adjust_weights, step_size
from tests.methods.helpers import LOG1P_E2


def fedga(params: dict | None = None, rounds: int | None = 10):
    return create_method(
        "fedga", params, num_classes=2, num_domains=2, proto_dim=2, seed=0, rounds=rounds
    )


def up(client: int, n: int = 1, gap: float | None = None) -> Upload:
    extras = {} if gap is None else {"gap": torch.tensor(gap, dtype=torch.float64)}
    return Upload(client=client, domain=0, release=None, num_samples=n, extras=extras)


def test_one_adjustment_by_hand() -> None:
    # gaps 0.3, 0.1, 0.2: mean 0.2, centred (0.1, -0.1, 0), max |.| 0.1 -> a += 0.05 (1, -1, 0)
    a = adjust_weights(torch.full((3,), 1 / 3), torch.tensor([0.3, 0.1, 0.2]), 0.05)
    assert a.tolist() == pytest.approx([1 / 3 + 0.05, 1 / 3 - 0.05, 1 / 3])


def test_adjustment_clips_at_zero_and_renormalises() -> None:
    # gaps (0, 1, 1): centred (-2/3, 1/3, 1/3) / (2/3) = (-1, 0.5, 0.5); 0.02 - 0.05 < 0 -> 0
    a = adjust_weights(torch.tensor([0.02, 0.49, 0.49]), torch.tensor([0.0, 1.0, 1.0]), 0.05)
    assert a.tolist() == pytest.approx([0.0, 0.5, 0.5])


def test_equal_gaps_change_nothing() -> None:
    a = adjust_weights(torch.tensor([0.2, 0.8]), torch.tensor([0.4, 0.4]), 0.05)
    assert a.tolist() == pytest.approx([0.2, 0.8])


def test_step_size_decays_linearly_over_the_run() -> None:
    assert step_size(0.05, 0, 10, "linear") == pytest.approx(0.05)
    assert step_size(0.05, 5, 10, "linear") == pytest.approx(0.025)
    assert step_size(0.05, 9, 10, "none") == pytest.approx(0.05)
    with pytest.raises(
        ValueError, match=re.escape("fedga.decay='linear' needs the run's number of rounds")
    ):
        step_size(0.05, 1, None, "linear")


def test_server_weights_follow_the_gaps_and_are_used_for_averaging() -> None:
    m = fedga()
    m.aggregate([up(0), up(1), up(2, n=2)], 0)  # round 0: no gaps yet, uniform 1/3
    assert m.weights_of([0, 1, 2]) == pytest.approx([1 / 3] * 3)
    m.aggregate([up(0, gap=0.3), up(1, gap=0.1), up(2, n=2, gap=0.2)], 1)  # d = 0.05 (r = 0)
    expected = [1 / 3 + 0.05, 1 / 3 - 0.05, 1 / 3]
    plan = m.weight_plan([0, 1, 2], [1, 1, 2])
    assert plan.coefficients == pytest.approx(expected)
    states = [{"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])}, {"w": torch.tensor([4.0])}]
    got = combine_weights(plan, states, [1, 1, 2])["w"].item()
    assert got == pytest.approx(expected[0] * 1 + expected[1] * 2 + expected[2] * 4)
    # the defining mechanism: with unequal gaps the average is not FedAvg's (0.25, 0.25, 0.5)
    fedavg = combine_weights(WeightPlan(), states, [1, 1, 2])["w"].item()
    assert fedavg == pytest.approx(2.75)
    assert abs(got - fedavg) > 0.4


def test_decayed_step_in_a_later_round() -> None:
    m = fedga()
    m.aggregate([up(0), up(1)], 0)
    m.aggregate([up(0, gap=1.0), up(1, gap=0.0)], 6)  # gaps of round 5: d = 0.05 * (1 - 5/10)
    assert m.weights_of([0, 1]) == pytest.approx([0.5 + 0.025, 0.5 - 0.025])


def test_initial_counts_and_late_joiners() -> None:
    m = fedga({"initial": "counts"})
    m.aggregate([up(0, n=1), up(1, n=3)], 0)
    assert m.weights_of([0, 1]) == pytest.approx([0.25, 0.75])
    m.aggregate([up(2, n=100)], 1)  # a late joiner enters with the mean weight 0.5, renormalised
    assert m.weights_of([0, 1, 2]) == pytest.approx([0.25 / 1.5, 0.75 / 1.5, 0.5 / 1.5])


def test_non_finite_gap_is_ignored() -> None:
    m = fedga()
    m.aggregate([up(0), up(1)], 0)
    m.aggregate([up(0, gap=math.inf), up(1, gap=0.5)], 1)
    assert m.weights_of([0, 1]) == pytest.approx([0.5, 0.5])


class Linear2(nn.Module):
    """(f, logits) = (z, W z) with a 2x2 W, zero to start."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, 2, bias=False)
        nn.init.zeros_(self.head.weight)

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return z, self.head(z)


def test_client_gap_is_global_loss_minus_local_loss() -> None:
    m, model, state = fedga(), Linear2(), ClientState()
    z, y = torch.tensor([[2.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])
    assert m.upload_extras(model, z, y, state, 0) == {}  # no local model yet
    with torch.no_grad():
        model.head.weight.copy_(torch.eye(2))
    m.end_local(model, state, {}, 0)  # local model: logits (2, 0), (0, 2)
    with torch.no_grad():
        model.head.weight.zero_()  # the averaged model: logits 0, loss log 2
    gap = m.upload_extras(model, z, y, state, 0)["gap"]
    assert float(gap) == pytest.approx(math.log(2) - LOG1P_E2, abs=1e-6)


def test_own_weights_refuse_a_robust_rule() -> None:
    plan = WeightPlan(coefficients=(0.5, 0.5))
    states = [{"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])}]
    with pytest.raises(ValueError, match="weight_aggregation='median' ignores"):
        combine_weights(plan, states, [1, 1], rule="median", method="fedga")


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"step_size": 2}, "fedga.step_size=2 must be a number in"),
        ({"step_size": True}, "fedga.step_size=True"),
        ({"decay": "cosine"}, "fedga.decay='cosine' must be linear or none"),
        ({"initial": "random"}, "fedga.initial='random' must be uniform or counts"),
    ],
)
def test_bad_parameters_name_themselves(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        fedga(params)


def test_privacy_statement_names_the_gap_and_the_weights() -> None:
    from protofl.engine.federated_data import build_federated_data
    from protofl.engine.simulation import Simulation
    from protofl.methods.checks import tiny_config

    config = tiny_config("fedga", "igpp", rounds=1)
    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulation(config, build_federated_data(config, Path(tmp)))
    g = sim.guarantee()
    assert g["epsilon"] is None and not g["holds_against_server"]
    assert any(gap.startswith("generalisation gap") for gap in g["not_covered"])
    assert any(gap.startswith("model weights") for gap in g["not_covered"])
    assert sim.method.rounds == 1
