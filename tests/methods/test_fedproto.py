from __future__ import annotations

import pytest
import torch

from protofl.methods import create_method
from protofl.methods.base import Batch, ClientState, Upload
from protofl.models.client import ClientModel
from tests.methods.helpers import _release


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


# every registered method x mechanism: tests/engine/test_method_checks.py


# ----- share_weights: FedProto "with parameter averaging" (FedDAP Sec. 4.1) ----------------------
@pytest.mark.parametrize("bad", [1, "true", None])
def test_share_weights_must_be_a_bool(bad: object) -> None:
    with pytest.raises(ValueError, match=r"fedproto\.share_weights=.* must be a bool") as err:
        create_method("fedproto", {"share_weights": bad}, num_classes=2, num_domains=1, proto_dim=2)
    assert "\n" not in str(err.value)


def test_share_weights_turns_weight_averaging_on() -> None:
    off = create_method("fedproto", {}, num_classes=2, num_domains=1, proto_dim=2)
    assert off.params["share_weights"] is False and not off.shares_weights
    on = create_method(
        "fedproto", {"share_weights": True}, num_classes=2, num_domains=1, proto_dim=2
    )
    assert on.shares_weights
    # the aggregation and the objective do not change: only the engine's weight averaging does
    assert on.objective() == off.objective()


def test_weight_averaged_run_differs_from_the_personalised_one() -> None:
    from protofl.engine.method_checks import run_tiny
    from protofl.methods.checks import tiny_config

    def run(share: bool) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
        sim, hist = run_tiny(
            tiny_config(
                "fedproto", "none", {"share_weights": share}, rounds=2, clients_per_domain=2
            )
        )
        states = [
            {k: v.detach().clone() for k, v in c.model.state_dict().items()} for c in sim.clients
        ]
        return states, [h.avg_acc for h in hist] + [h.train_loss for h in hist]

    personal, personal_metrics = run(False)
    averaged, averaged_metrics = run(True)
    # averaged: every client ends the round with the same trainable weights
    for state in averaged[1:]:
        assert all(torch.equal(state[k], averaged[0][k]) for k in state)
    # personalised: the clients' weights stay their own
    assert any(not torch.equal(personal[1][k], personal[0][k]) for k in personal[0])
    assert averaged_metrics != personal_metrics


def test_weight_averaged_fedproto_passes_the_conformance_suite() -> None:
    from protofl.engine.method_checks import check_method

    check_method("fedproto", "igpp", {"share_weights": True})
