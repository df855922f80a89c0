"""COPA: FedAvg of the extractor, heads kept local, collaboration and ensemble by hand."""

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
from protofl.methods.base import Batch, ClientState, Upload
from protofl.methods.copa import CLIENTS, ENSEMBLE, ensemble_probs, stacked_heads
from tests.methods.helpers import LOG1P_E2


def copa(params: dict | None = None):
    return create_method("copa", params, num_classes=2, num_domains=2, proto_dim=2)


class Tiny(nn.Module):
    """features = identity, a 2x2 linear head without bias, zero to start."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, 2, bias=False)
        nn.init.zeros_(self.head.weight)

    def features(self, z: torch.Tensor) -> torch.Tensor:
        return z

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return z, self.head(z)


def broadcast(heads: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    m = copa()
    uploads = [
        Upload(client=c, domain=0, release=None, num_samples=1, extras={"head.weight": w})
        for c, w in heads.items()
    ]
    return m.aggregate(uploads, 0)


def test_heads_are_not_averaged() -> None:
    plan = copa().weight_plan([0, 1], [1, 3])
    states = [
        {"proj.weight": torch.tensor([1.0]), "head.weight": torch.tensor([5.0])},
        {"proj.weight": torch.tensor([3.0]), "head.weight": torch.tensor([7.0])},
    ]
    avg = combine_weights(plan, states, [1, 3])
    assert set(avg) == {"proj.weight"}
    assert avg["proj.weight"].item() == pytest.approx(0.25 * 1 + 0.75 * 3)


def test_server_stacks_every_clients_latest_head() -> None:
    gs = broadcast({1: torch.eye(2), 0: 2 * torch.eye(2)})
    assert gs[CLIENTS].tolist() == [0, 1]
    assert torch.equal(gs[ENSEMBLE + "head.weight"], torch.stack([2 * torch.eye(2), torch.eye(2)]))
    heads = stacked_heads(gs)
    assert set(heads) == {"weight"} and torch.equal(heads["weight"][1], torch.eye(2))


def test_ensemble_is_the_mean_softmax_by_hand() -> None:
    f = torch.tensor([[1.0, 0.0]])
    # own logits (0, 0) -> (1/2, 1/2); the other head is the identity -> softmax(1, 0)
    p = ensemble_probs(f, torch.zeros(1, 2), {"weight": torch.eye(2).unsqueeze(0)})
    e = math.e / (math.e + 1)
    assert p[0].tolist() == pytest.approx([(0.5 + e) / 2, (0.5 + 1 - e) / 2])


def batch(model: Tiny, f: list[list[float]], y: list[int], client: int = 0) -> Batch:
    ft = torch.tensor(f)
    return Batch(ft, torch.tensor(y), ft, ft, model.head(ft), model, client, 0)  # type: ignore[arg-type]


def test_collaboration_of_frozen_heads_by_hand() -> None:
    model = Tiny()
    gs = broadcast({0: torch.zeros(2, 2), 1: torch.eye(2)})
    b = batch(model, [[2.0, 0.0]], [0])
    # own head: logits (0, 0) -> log 2; client 1's frozen identity head: (2, 0) -> log(1 + e^-2)
    loss = copa().client_loss(b, gs, ClientState())
    assert loss.item() == pytest.approx(math.log(2) + LOG1P_E2, abs=1e-6)
    assert copa({"collab_weight": 0.5}).client_loss(b, gs, ClientState()).item() == pytest.approx(
        math.log(2) + 0.5 * LOG1P_E2, abs=1e-6
    )
    # the defining mechanism: without the other heads the loss is plain cross-entropy
    assert copa().client_loss(b, {}, ClientState()).item() == pytest.approx(math.log(2))
    # the frozen heads get no gradient; the features do
    loss.backward()
    assert model.head.weight.grad is not None


def test_ensemble_prediction_differs_from_the_own_head() -> None:
    model = Tiny()
    with torch.no_grad():
        model.head.weight.copy_(torch.tensor([[0.0, 0.0], [0.1, 0.0]]))  # own: class 1, barely
    gs = broadcast({0: torch.zeros(2, 2), 1: 5 * torch.eye(2), 2: 5 * torch.eye(2)})
    state = ClientState()
    copa().upload_extras(model, torch.zeros(1, 2), torch.zeros(1), state, 0)  # records its id
    z = torch.tensor([[1.0, 0.0]])
    assert copa().predict(model, z, gs, state).tolist() == [0]  # two confident heads: class 0
    assert copa({"eval": "own"}).predict(model, z, gs, state).tolist() == [1]


def test_bad_parameters_name_themselves() -> None:
    with pytest.raises(ValueError, match=re.escape("copa.collab_weight=-1 must be a number >= 0")):
        copa({"collab_weight": -1})
    with pytest.raises(ValueError, match="eval='prototype' is not one of ensemble, own"):
        copa({"eval": "prototype"})


def test_a_round_shares_the_extractor_and_keeps_each_head() -> None:
    from protofl.engine.federated_data import build_federated_data
    from protofl.engine.simulation import Simulation
    from protofl.methods.checks import tiny_config

    config = tiny_config("copa", "igpp", rounds=2)
    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulation(config, build_federated_data(config, Path(tmp)))
    sim.run()
    a, b = (c.model.state_dict() for c in sim.clients)
    assert all(torch.equal(a[k], b[k]) for k in a if not k.startswith("head."))
    assert any(not torch.equal(a[k], b[k]) for k in a if k.startswith("head."))
    assert sim.global_state[CLIENTS].tolist() == [0, 1]
    g = sim.guarantee()
    assert g["epsilon"] is None
    assert any(gap.startswith("classifier head") for gap in g["not_covered"])
