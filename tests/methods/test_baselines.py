"""FedAvg/FedProx/MOON: the proximal term and MOON's contrast by hand."""

from __future__ import annotations

import math

import pytest
import torch

from protofl.config import BackboneConfig
from protofl.methods.base import Batch, ClientState
from protofl.methods.baselines import moon_contrastive, proximal_term
from protofl.models.client import build_client_model
from tests.methods.helpers import (
    LOG1P_E2,
    make,
)


def test_proximal_term_by_hand() -> None:
    w = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[3.0]])}
    g = {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([[1.0]])}
    assert proximal_term(w, g).item() == pytest.approx(1 + 4 + 4)


def _batch(model, n: int = 5, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 6, generator=gen)
    y = torch.arange(n) % 3
    f, logits = model(z)
    return Batch(z=z, y=y, f=f, f_raw=f, logits=logits, model=model, client=0, domain=0)


def _model():
    cfg = BackboneConfig(name="pixels", proto_dim=4, adapter_hidden=2)
    return build_client_model(6, 3, cfg, torch.Generator().manual_seed(0))


def test_fedprox_loss_adds_half_mu_times_squared_drift() -> None:
    m, model, state = make("fedprox", {"mu": 0.5}), _model(), ClientState()
    m.begin_local(model, state, {}, 0)
    with torch.no_grad():
        model.head.weight.add_(0.1)  # 3 x 4 entries, each moved by 0.1
    b = _batch(model)
    ce = torch.nn.functional.cross_entropy(b.logits, b.y).item()
    assert m.client_loss(b, {}, state).item() == pytest.approx(ce + 0.25 * 12 * 0.01, rel=1e-5)


def test_moon_contrastive_by_hand() -> None:
    z = torch.tensor([[2.0, 0.0]])
    pos, neg = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 3.0]])
    # cos 1 and 0, temperature 0.5: -log(e^2 / (e^2 + e^0))
    assert moon_contrastive(z, pos, neg, 0.5).item() == pytest.approx(LOG1P_E2)
    assert moon_contrastive(z, pos, pos, 0.5).item() == pytest.approx(math.log(2.0))


def test_moon_first_round_negative_is_global_and_state_holds_tensors() -> None:
    m, model, state = make("moon"), _model(), ClientState()
    m.begin_local(model, state, {}, 0)
    b = _batch(model)
    ce = torch.nn.functional.cross_entropy(b.logits, b.y).item()
    assert m.client_loss(b, {}, state).item() == pytest.approx(ce + math.log(2.0), rel=1e-5)
    m.end_local(model, state, {}, 0)
    assert all(isinstance(v, torch.Tensor) for v in state.tensors.values())
    with pytest.raises(ValueError, match="temperature"):
        make("moon", {"temperature": 0})
