from __future__ import annotations

import pytest
import torch

from protofl.methods import create_method
from protofl.methods.base import Batch, ClientState, Upload
from protofl.models.client import ClientModel
from protofl.privacy.base import Release


def _release(protos: list[list[float]], classes: list[int], counts: list[int]) -> Release:
    p = torch.tensor(protos)
    return Release(
        p,
        torch.tensor(classes),
        torch.tensor(counts),
        torch.zeros(len(classes)),
        torch.zeros_like(p),
        "none",
    )


def test_aggregation_weights_by_counts_over_clients_with_the_class() -> None:
    m = create_method("fedproto", {}, num_classes=3, num_domains=2, proto_dim=2)
    ups = [
        Upload(0, 0, _release([[1.0, 0.0], [0.0, 2.0]], [0, 1], [1, 3]), 4),
        Upload(1, 1, _release([[3.0, 0.0]], [0], [3]), 3),
    ]
    g = m.aggregate(ups, 0)
    assert g["classes"].tolist() == [0, 1]  # class 2 missing everywhere: not invented
    # class 0: (1*[1,0] + 3*[3,0]) / 4 = [2.5, 0]; class 1 only from client 0
    assert torch.allclose(g["prototypes"], torch.tensor([[2.5, 0.0], [0.0, 2.0]]))
    u = create_method(
        "fedproto", {"weighting": "uniform"}, num_classes=3, num_domains=2, proto_dim=2
    ).aggregate(ups, 0)
    assert torch.allclose(u["prototypes"][0], torch.tensor([2.0, 0.0]))


def test_loss_is_ce_plus_lambda_mse_on_samples_with_a_prototype() -> None:
    m = create_method("fedproto", {"lam": 0.5}, num_classes=3, num_domains=1, proto_dim=2)
    f = torch.tensor([[1.0, 1.0], [0.0, 0.0], [5.0, 5.0]])
    logits = torch.zeros(3, 3)
    y = torch.tensor([0, 1, 2])
    g = {"prototypes": torch.tensor([[0.0, 1.0], [2.0, 0.0]]), "classes": torch.tensor([0, 1])}
    batch = Batch(z=f, y=y, f=f, f_raw=f, logits=logits, model=None, client=0, domain=0)  # type: ignore[arg-type]
    loss = m.client_loss(batch, g, ClientState())
    ce = torch.log(torch.tensor(3.0))
    # sample 0: (1-0)^2 + (1-1)^2 = 1; sample 1: (0-2)^2 + 0 = 4; mean over 2 samples x 2 dims
    mse = (1.0 + 4.0) / 4
    assert torch.isclose(loss, ce + 0.5 * mse)


def test_unknown_method_parameter_is_named() -> None:
    with pytest.raises(ValueError, match=r"no parameter 'lamda'.*did you mean 'lam'"):
        create_method("fedproto", {"lamda": 1}, num_classes=2, num_domains=1, proto_dim=2)


def test_prototype_evaluation_uses_nearest_global_prototype() -> None:
    from protofl.config import BackboneConfig

    m = create_method("fedproto", {"eval": "prototype"}, num_classes=2, num_domains=1, proto_dim=2)
    model = ClientModel(2, 2, BackboneConfig(proto_dim=2, adapter_hidden=1))
    with torch.no_grad():
        model.proj.weight.copy_(torch.eye(2))
        model.proj.bias.zero_()
        model.adapter.up.weight.zero_()
    g = {"prototypes": torch.tensor([[1.0, 0.0], [0.0, 1.0]]), "classes": torch.tensor([0, 1])}
    pred = m.predict(model, torch.tensor([[0.9, 0.1], [0.2, 0.7]]), g, ClientState())
    assert pred.tolist() == [0, 1]


# every registered method x mechanism: tests/test_methods_checks.py
