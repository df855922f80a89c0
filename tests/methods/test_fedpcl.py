"""FedPCL: aggregation, loss and evaluation by hand."""

from __future__ import annotations

import math

import pytest
import torch

from protofl.methods import create_method
from protofl.methods.base import Batch, ClientState, GlobalState, Upload
from protofl.methods.fedpcl import FedPCL
from tests.methods.helpers import (
    IDENTITY,
    _batch,
    _lse,
    _release,
)


def _pcl_uploads() -> list[Upload]:
    return [
        Upload(0, 0, _release([[1.0, 0.0], [0.0, 1.0]], [0, 1], [2, 2]), 4),
        Upload(1, 1, _release([[0.0, 2.0]], [0], [5]), 5),
    ]


def test_fedpcl_aggregation_unweighted_mean_and_filled_client_tables() -> None:
    m = create_method("fedpcl", {}, num_classes=3, num_domains=2, proto_dim=2)
    g = m.aggregate(_pcl_uploads(), 0)
    assert g["classes"].tolist() == [0, 1]  # class 2 missing everywhere: not invented
    # G_0 = ([1,0] + [0,2]) / 2 (unweighted over clients), G_1 from client 0 only
    assert torch.allclose(g["prototypes"], torch.tensor([[0.5, 1.0], [0.0, 1.0]]))
    # client 1 lacks class 1: its row is filled with G_1
    expected = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 2.0], [0.0, 1.0]]])
    assert torch.allclose(g["client_prototypes"], expected)


def test_fedpcl_loss_by_hand() -> None:
    m = create_method("fedpcl", {"tau": 1.0}, num_classes=3, num_domains=2, proto_dim=2)
    g = m.aggregate(_pcl_uploads(), 0)
    loss = m.client_loss(_batch([[1.0, 0.0]], [0], 3), g, ClientState())
    # cos(f, G) = [1/sqrt(5), 0]; cos(f, P_0) = [1, 0]; cos(f, P_1) = [0, 0]
    c = 1 / math.sqrt(5)
    ce_g = _lse(c, 0.0) - c
    ce_0 = _lse(1.0, 0.0) - 1.0
    ce_1 = math.log(2.0)
    assert loss.item() == pytest.approx(ce_g + (ce_0 + ce_1) / 2, rel=1e-6)
    # the optional head CE adds ce_weight * log(3) (zero logits over 3 classes)
    m2 = create_method(
        "fedpcl", {"tau": 1.0, "ce_weight": 0.5}, num_classes=3, num_domains=2, proto_dim=2
    )
    loss2 = m2.client_loss(_batch([[1.0, 0.0]], [0], 3), g, ClientState())
    assert loss2.item() == pytest.approx(loss.item() + 0.5 * math.log(3), rel=1e-6)


def test_fedpcl_skips_samples_without_a_global_prototype_and_falls_back_to_ce() -> None:
    m = create_method("fedpcl", {"tau": 1.0}, num_classes=3, num_domains=2, proto_dim=2)
    g = m.aggregate(_pcl_uploads(), 0)
    both = m.client_loss(_batch([[1.0, 0.0], [3.0, 3.0]], [0, 2], 3), g, ClientState())
    one = m.client_loss(_batch([[1.0, 0.0]], [0], 3), g, ClientState())
    assert both.item() == pytest.approx(one.item(), rel=1e-6)
    assert m.client_loss(_batch([[1.0, 0.0]], [0], 3), {}, ClientState()).item() == pytest.approx(
        math.log(3)
    )


def test_fedpcl_evaluates_by_nearest_local_unnoised_prototype() -> None:
    m = create_method("fedpcl", {}, num_classes=2, num_domains=1, proto_dim=2)
    assert isinstance(m, FedPCL)
    g: GlobalState = {
        "prototypes": torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
        "classes": torch.tensor([0, 1]),
    }
    state = ClientState()
    z = torch.tensor([[0.9, 0.1], [0.6, 0.4]])
    # no local prototypes yet: nearest global prototype
    assert m.predict(IDENTITY, z, g, state).tolist() == [0, 0]
    # the client's own class means: class 0 at [1, 0], class 1 at [1, 1] -> sample 1 is class 1
    m.after_training(
        state, torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 0.0]]), torch.tensor([0, 1, 0])
    )
    assert torch.allclose(state.tensors["local_prototypes"], torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    assert state.tensors["local_classes"].tolist() == [0, 1]
    assert m.predict(IDENTITY, z, g, state).tolist() == [0, 1]
    # refitted after the next round's training
    m.after_training(state, torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([0, 1]))
    assert m.predict(IDENTITY, z, g, state).tolist() == [1, 1]


class _ModeProbe(torch.nn.Module):
    """Records the mode of every forward (a model with dropout behaves differently in each)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.modes: list[bool] = []

    def features(self, z: torch.Tensor) -> torch.Tensor:
        self.modes.append(self.training)
        return self.lin(z)

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.features(z)
        return f, f


def test_moon_and_fedpcl_compute_their_references_in_eval_mode() -> None:
    from protofl.methods import create_method
    from protofl.methods.base import ClientState

    model = _ModeProbe()
    model.train()
    moon = create_method("moon", {}, num_classes=4, num_domains=1, proto_dim=4)
    state = ClientState()
    moon.begin_local(model, state, {}, 0)  # type: ignore[arg-type]
    z, y = torch.randn(6, 4), torch.arange(6) % 4
    f, logits = model(z)
    model.modes.clear()
    batch = Batch(z=z, y=y, f=f, f_raw=f, logits=logits, model=model, client=0, domain=0)  # type: ignore[arg-type]
    moon.client_loss(batch, {}, state)
    assert model.modes == [False, False] and model.training  # global and previous, then restored
    pcl = create_method("fedpcl", {}, num_classes=4, num_domains=1, proto_dim=4)
    model.modes.clear()
    pcl.fit_local_prototypes(model, ClientState(), z, y)  # type: ignore[attr-defined, arg-type]
    assert model.modes == [False] and model.training
