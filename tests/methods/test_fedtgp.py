"""FedTGP: adaptive margin, margin loss, the server generator and its budgets."""

from __future__ import annotations

import math

import pytest
import torch

from protofl.methods import create_method
from protofl.methods.fedtgp import adaptive_margin, margin_loss
from tests.methods.helpers import (
    LOG1P_E2,
    make,
    upload,
)


def test_adaptive_margin_by_hand() -> None:
    # class means (0,0), (3,0), (0,4): gaps 3, 3, 4 -> max 4
    x = torch.tensor([[-1.0, 0.0], [1.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
    y = torch.tensor([0, 0, 1, 2])
    assert adaptive_margin(x, y, 3, cap=100.0) == pytest.approx(4.0)
    assert adaptive_margin(x, y, 3, cap=2.0) == pytest.approx(2.0)
    assert adaptive_margin(x[:2], y[:2], 3, cap=100.0) == 0.0


def test_margin_loss_by_hand() -> None:
    gen = torch.tensor([[0.0, 0.0], [3.0, 0.0]])
    x, y = torch.tensor([[0.0, 0.0]]), torch.tensor([0])
    # dist = (0, 3); logits = -(dist + 1 * onehot) = (-1, -3)
    assert margin_loss(gen, x, y, 1.0).item() == pytest.approx(LOG1P_E2, rel=1e-5)
    assert margin_loss(gen, x, y, 0.0).item() == pytest.approx(math.log1p(math.exp(-3)), rel=1e-5)


def test_fedtgp_server_generator_persists_and_round_trips() -> None:
    m = make("fedtgp", {"server_epochs": 30}, dim=4)
    ups = [
        upload(0, 0, [[1.0, 0, 0, 0], [0, 1.0, 0, 0]], [0, 1]),
        upload(1, 1, [[1.0, 0.1, 0, 0]], [0]),  # lacks class 1; class 2 missing everywhere
    ]
    gs = m.aggregate(ups, 0)
    assert gs["classes"].tolist() == [0, 1] and gs["prototypes"].shape == (2, 4)
    assert gs["margin"].item() == pytest.approx(math.dist([1.0, 0.05], [0.0, 1.0]))
    state = m.state_dict()
    assert state and all(k.startswith("tgp.") for k in state)
    fresh = make("fedtgp", {"server_epochs": 30}, dim=4)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.aggregate(ups, 1)["prototypes"], m.aggregate(ups, 1)["prototypes"])
    assert not torch.equal(m.state_dict()["tgp.embedding.weight"], state["tgp.embedding.weight"])


def test_fedtgp_budget_presets_and_overrides() -> None:
    up = make("fedtgp")
    assert up.server_setting("server_epochs") == 1000 and up.server_setting("server_lr") == 0.005
    ref = make("fedtgp", {"budget": "reference", "server_lr": 0.01})
    assert ref.server_setting("server_batch") == 256 and ref.server_setting("server_lr") == 0.01
    with pytest.raises(ValueError, match="budget"):
        make("fedtgp", {"budget": "huge"})
    with pytest.raises(ValueError, match="server_epochs"):
        make("fedtgp", {"server_epochs": 0})


@pytest.mark.parametrize("name", ["fedtgp", "mpft"])
def test_the_experiment_seed_reaches_the_server_randomness(name: str) -> None:
    """Three seeds of a run used to share one server init and one shuffle stream."""

    def server_weights(seed: int) -> list[torch.Tensor]:
        m = create_method(name, {}, num_classes=4, num_domains=2, proto_dim=8, seed=seed)
        model = m.build_generator() if name == "fedtgp" else m.build_server_model()  # type: ignore[attr-defined]
        return [p.detach().clone() for p in model.parameters()]

    a, b, again = server_weights(0), server_weights(1), server_weights(0)
    assert all(torch.equal(x, y) for x, y in zip(a, again))
    assert not all(torch.equal(x, y) for x, y in zip(a, b))
