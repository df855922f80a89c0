"""FPL: clustered aggregation and its loss by hand."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from protofl.methods import create_method
from protofl.methods.base import ClientState, Upload
from tests.methods.helpers import (
    IDENTITY,
    _batch,
    _fpl_state,
    _lse,
    _release,
)


def test_fpl_aggregation_clusters_then_unbiased_mean(caplog: pytest.LogCaptureFixture) -> None:
    m = create_method("fpl", {}, num_classes=3, num_domains=4, proto_dim=2)
    ups = [
        Upload(0, 0, _release([[1.0, 0.0], [-1.0, 0.0]], [0, 1], [5, 5]), 10),
        Upload(1, 1, _release([[1.0, 0.2]], [0], [5]), 5),
        Upload(2, 2, _release([[0.0, 1.0]], [0], [5]), 5),
        Upload(3, 3, _release([[0.2, 1.0]], [0], [50]), 50),
    ]
    with caplog.at_level(logging.WARNING):
        g = m.aggregate(ups, 0)
    assert "classes [2]" in caplog.text  # a class missing everywhere is reported
    # class 0: FINCH (cosine) pairs {[1,0],[1,.2]} and {[0,1],[.2,1]}: two cluster prototypes
    # (plain means, counts ignored); class 1 has one prototype: itself
    assert g["cluster_classes"].tolist() == [0, 0, 1]
    assert torch.allclose(
        g["cluster_prototypes"], torch.tensor([[1.0, 0.1], [0.1, 1.0], [-1.0, 0.0]])
    )
    # unbiased prototype: mean of the cluster prototypes
    assert g["classes"].tolist() == [0, 1]
    assert torch.allclose(g["prototypes"], torch.tensor([[0.55, 0.55], [-1.0, 0.0]]))


def test_fpl_loss_by_hand() -> None:
    m = create_method("fpl", {"temperature": 0.5}, num_classes=2, num_domains=1, proto_dim=2)
    loss = m.client_loss(_batch([[1.0, 0.0]], [0], 2), _fpl_state(), ClientState())
    # cos(f, clusters) = [1, 0, -1] / T ; positives: the two class-0 clusters
    infonce = _lse(2.0, 0.0, -2.0) - _lse(2.0, 0.0)
    mse = ((1 - 0.5) ** 2 + (0 - 0.5) ** 2) / 2
    ce = math.log(2.0)
    assert loss.item() == pytest.approx(ce + infonce + mse, rel=1e-6)
    m2 = create_method(
        "fpl",
        {"temperature": 0.5, "w_contrast": 0.5, "w_mse": 0.5},
        num_classes=2,
        num_domains=1,
        proto_dim=2,
    )
    loss2 = m2.client_loss(_batch([[1.0, 0.0]], [0], 2), _fpl_state(), ClientState())
    assert loss2.item() == pytest.approx(ce + 0.5 * infonce + 0.5 * mse, rel=1e-6)


def test_fpl_default_temperature_is_stable_and_prototype_eval() -> None:
    m = create_method("fpl", {"eval": "prototype"}, num_classes=2, num_domains=1, proto_dim=2)
    assert m.params["temperature"] == 0.02
    b = _batch([[-3.0, 0.1], [1.0, 0.0]], [0, 1], 2)  # both far from their class: large logits
    loss = m.client_loss(b, _fpl_state(), ClientState())
    assert torch.isfinite(loss)
    loss.backward()
    assert b.f.grad is not None and torch.isfinite(b.f.grad).all()
    pred = m.predict(IDENTITY, torch.tensor([[0.1, 0.9], [-0.9, 0.2]]), _fpl_state(), ClientState())
    assert pred.tolist() == [0, 1]
