"""FedDAP: fusion weights, (class, domain) prototypes, DPA and CPCL by hand, its options."""

from __future__ import annotations

import math

import pytest
import torch

from protofl.engine.method_checks import check_method
from protofl.methods.feddap import cpcl_loss, domain_prototypes, dpa_loss, fusion_weights
from tests.methods.helpers import (
    LOG1P_E2,
    make,
    upload,
)


def test_fusion_weights_two_prototypes_are_exactly_half() -> None:
    w = fusion_weights(torch.tensor([[1.0, 0.0], [0.3, 2.0]]), tau=0.001)
    assert w.tolist() == [0.5, 0.5]


def test_fusion_weights_three_prototypes_by_hand() -> None:
    # cos(p1,p2)=0, cos(p1,p3)=cos(p2,p3)=1/sqrt2 -> S = (r, r, 2r), r = 1/sqrt2 (Eq. 4)
    p = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    r = 1 / math.sqrt(2)
    e = [math.exp(r), math.exp(r), math.exp(2 * r)]
    expected = [v / sum(e) for v in e]
    assert torch.allclose(fusion_weights(p, tau=1.0), torch.tensor(expected, dtype=torch.float64))
    # tau_agg = 0.001: all the weight on the most central prototype, no overflow
    w = fusion_weights(p, tau=0.001)
    assert torch.isfinite(w).all() and w[2] == pytest.approx(1.0) and w[0] < 1e-100


def test_domain_prototypes_fuse_within_class_and_domain() -> None:
    ups = [
        upload(0, 0, [[1.0, 0.0], [0.0, 1.0]], [0, 1]),
        upload(1, 0, [[3.0, 0.0]], [0]),  # lacks class 1
        upload(2, 1, [[0.0, 2.0]], [0]),
    ]
    gs = domain_prototypes(ups, fusion="similarity", tau_agg=0.001)
    keys = list(zip(gs["classes"].tolist(), gs["domains"].tolist()))
    assert keys == [(0, 0), (1, 0), (0, 1)]
    # (0, 0): two parallel prototypes, 50/50 -> (2, 0); (1, 0) and (0, 1) from one client each
    assert torch.allclose(gs["prototypes"], torch.tensor([[2.0, 0.0], [0.0, 1.0], [0.0, 2.0]]))
    mean = domain_prototypes(ups, fusion="mean", tau_agg=0.001)
    assert torch.allclose(mean["prototypes"], gs["prototypes"])


def test_domain_prototypes_three_clients_similarity_vs_mean() -> None:
    ups = [upload(i, 0, [p], [0]) for i, p in enumerate([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])]
    sim = domain_prototypes(ups, fusion="similarity", tau_agg=1.0)["prototypes"][0]
    r = 1 / math.sqrt(2)
    e = torch.tensor([math.exp(r), math.exp(r), math.exp(2 * r)])
    w = e / e.sum()
    assert torch.allclose(
        sim,
        w[0] * torch.tensor([1.0, 0])
        + w[1] * torch.tensor([0, 1.0])
        + w[2] * torch.tensor([2.0, 2.0]),
    )
    mean = domain_prototypes(ups, fusion="mean", tau_agg=1.0)["prototypes"][0]
    assert torch.allclose(mean, torch.tensor([1.0, 1.0]))


def test_domain_prototypes_reject_missing_domain() -> None:
    with pytest.raises(ValueError, match="domain"):
        domain_prototypes([upload(0, -1, [[1.0, 0.0]], [0])], fusion="mean", tau_agg=1.0)


def _gs(protos, classes, domains):
    return {
        "prototypes": torch.tensor(protos),
        "classes": torch.tensor(classes),
        "domains": torch.tensor(domains),
    }


def test_dpa_by_hand() -> None:
    gs = _gs([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]], [0, 1, 2], [0, 0, 1])
    f = torch.tensor([[2.0, 0.0], [0.0, 1.0], [5.0, 5.0]])
    y = torch.tensor([0, 1, 2])  # class 2 has no domain-0 prototype: left out of the mean
    expected = 1 - (1 + 1 / math.sqrt(2)) / 2
    assert dpa_loss(f, y, 0, gs, 3).item() == pytest.approx(expected)
    assert dpa_loss(f[2:], y[2:], 0, gs, 3).item() == 0.0


def test_cpcl_by_hand() -> None:
    # domain-1 prototypes: class 0 (1,0), class 1 (0,1); the domain-0 one is ignored
    gs = _gs([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]], [0, 0, 1], [0, 1, 1])
    f = torch.tensor([[3.0, 0.0]])
    y = torch.tensor([0])
    # -log(e^{1/0.5} / (e^{1/0.5} + e^{0/0.5})) = log(1 + e^-2)
    assert cpcl_loss(f, y, 0, gs, tau=0.5).item() == pytest.approx(LOG1P_E2)
    # a class-2 sample has no positive: contributes 0 but counts in the 1/B
    f2, y2 = torch.tensor([[3.0, 0.0], [1.0, 1.0]]), torch.tensor([0, 2])
    assert cpcl_loss(f2, y2, 0, gs, tau=0.5).item() == pytest.approx(LOG1P_E2 / 2)
    # only same-domain prototypes: nothing to contrast
    assert cpcl_loss(f, y, 1, _gs([[1.0, 0.0]], [0], [1]), tau=0.5).item() == 0.0


def test_cpcl_two_positives_by_hand() -> None:
    gs = _gs([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], [0, 0, 1], [1, 2, 1])
    f, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    pos = math.exp(1.0) + math.exp(0.0)
    expected = -math.log(pos / (pos + math.exp(-1.0)))
    assert cpcl_loss(f, y, 0, gs, tau=1.0).item() == pytest.approx(expected)


def test_feddap_params_and_personalized_mode() -> None:
    m = make("feddap")
    assert m.shares_weights and m.needs_domain and m.uses_prototypes
    assert m.params["tau_agg"] == 0.001 and m.params["tau_cross"] == 0.02
    assert not make("feddap", {"personalized": True}).shares_weights
    with pytest.raises(ValueError, match="tau_agg"):
        make("feddap", {"tau_agg": 0})
    with pytest.raises(ValueError, match="fusion"):
        make("feddap", {"fusion": "median"})
    with pytest.raises(ValueError, match="lambda_1"):
        make("feddap", {"lambda_1": 1.0})


def test_check_feddap_personalized() -> None:
    check_method("feddap", "none", {"personalized": True})
