"""FedPLVM: alpha-sparsity, its loss variants by hand, local and server FINCH."""

from __future__ import annotations

import math

import pytest
import torch

from protofl.methods import create_method
from protofl.methods.base import ClientState, Upload
from protofl.methods.fedplvm import alpha_sparsity
from tests.methods.helpers import (
    _batch,
    _fpl_state,
    _lse,
    _release,
)


def test_alpha_sparsity_is_sign_preserving_and_finite() -> None:
    s = torch.tensor([-1.0, -0.0625, 0.0, 0.0625, 1.0], requires_grad=True)
    out = alpha_sparsity(s, 0.25)
    assert torch.allclose(out, torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0]))
    out.sum().backward()
    assert s.grad is not None and torch.isfinite(s.grad).all()


def _angle(deg: float) -> list[float]:
    return [math.cos(math.radians(deg)), math.sin(math.radians(deg))]


def test_fedplvm_loss_by_hand_all_variants() -> None:
    g = _fpl_state()
    f = [_angle(60.0)]  # cos to the clusters: [0.5, sqrt(3)/2, -0.5]
    s = [0.5, math.sqrt(3) / 2, -0.5]
    sa = [math.copysign(abs(v) ** 0.25, v) for v in s]
    ce = math.log(2.0)
    # L_alpha (multi-positive) and L_corr (2 * (cos(f, mean [0.5, 0.5]) - 1)^2, cos = cos 15 deg)
    l_alpha = _lse(*sa) - _lse(sa[0], sa[1])
    l_corr = 2 * (math.cos(math.radians(15.0)) - 1) ** 2
    params = {"tau": 1.0, "lam": 0.5}
    m = create_method("fedplvm", params, num_classes=2, num_domains=1, proto_dim=2)
    loss = m.client_loss(_batch(f, [0], 2), g, ClientState())
    assert loss.item() == pytest.approx(ce + 0.5 * (l_alpha + l_corr), rel=1e-5)
    # VPDR code's forms: SupCon mean of log-probs, |sum_pos s_alpha - |P_y||
    l_supcon = -((sa[0] - _lse(*sa)) + (sa[1] - _lse(*sa))) / 2
    l_abs = abs(sa[0] + sa[1] - 2)
    m2 = create_method(
        "fedplvm",
        {**params, "contrast": "supcon", "correction": "abs_sum"},
        num_classes=2,
        num_domains=1,
        proto_dim=2,
    )
    loss2 = m2.client_loss(_batch(f, [0], 2), g, ClientState())
    assert loss2.item() == pytest.approx(ce + 0.5 * (l_supcon + l_abs), rel=1e-5)


def test_fedplvm_negative_and_zero_cosines_give_finite_gradients() -> None:
    m = create_method("fedplvm", {"lam": 100.0}, num_classes=2, num_domains=1, proto_dim=2)
    b = _batch([[-1.0, 0.0], [0.0, 1.0], [0.0, -2.0]], [0, 1, 0], 2)  # cos -1 and exactly 0
    loss = m.client_loss(b, _fpl_state(), ClientState())
    assert torch.isfinite(loss)
    loss.backward()
    assert b.f.grad is not None and torch.isfinite(b.f.grad).all()


def test_fedplvm_local_clustering_and_server_finch() -> None:
    m = create_method("fedplvm", {}, num_classes=2, num_domains=2, proto_dim=2)
    fn = m.cluster_fn()
    assert fn is not None
    feats = torch.tensor([_angle(0), _angle(4), _angle(10), _angle(90), _angle(97)])
    assert fn(feats).tolist() == [0, 0, 0, 1, 1]
    assert (
        create_method(
            "fedplvm", {"local_clustering": False}, num_classes=2, num_domains=2, proto_dim=2
        ).cluster_fn()
        is None
    )
    ups = [
        Upload(0, 0, _release([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], [0, 0, 1], [3, 4, 5]), 12),
        Upload(1, 1, _release([[1.0, 0.2], [0.2, 1.0]], [0, 0], [2, 2]), 4),
    ]
    g = m.aggregate(ups, 0)
    assert g["cluster_classes"].tolist() == [0, 0, 1]
    assert torch.allclose(
        g["cluster_prototypes"], torch.tensor([[1.0, 0.1], [0.1, 1.0], [-1.0, 0.0]])
    )
    assert torch.allclose(g["prototypes"], torch.tensor([[0.55, 0.55], [-1.0, 0.0]]))
