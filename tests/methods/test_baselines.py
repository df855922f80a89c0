"""FedAvg/FedProx/MOON: the proximal term and MOON's contrast by hand."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from protofl.config import BackboneConfig
from protofl.engine.federated_data import build_federated_data
from protofl.engine.simulation import Simulation
from protofl.methods import baselines, fedga
from protofl.methods.base import Batch, ClientState
from protofl.methods.baselines import moon_contrastive, proximal_term
from protofl.methods.checks import tiny_config
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


@pytest.mark.parametrize("execution", ["sequential", "batched"])
@pytest.mark.parametrize("method", ["moon", "fedga"])
def test_model_snapshots_leave_out_frozen_parameters_and_train_as_full_copies(
    method: str, execution: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MOON's and FedGA's per-client snapshots hold buffers and trainable parameters only (a
    frozen projection is the same in every snapshot); the run equals one whose snapshots copy
    the whole state dict, as they did before (bitwise in sequential mode, to float rounding
    batched, where the frozen projection is one shared product)."""
    cfg = tiny_config(method, "igpp", rounds=3).with_overrides(
        ["backbone.train_projection=false", f"federation.execution={execution}"]
    )

    def run() -> Simulation:
        sim = Simulation(cfg, build_federated_data(cfg, tmp_path))
        sim.run()
        return sim

    new = run()
    frozen = {n for n, p in new.clients[0].model.named_parameters() if not p.requires_grad}
    assert "proj.weight" in frozen
    full = set(new.clients[0].model.state_dict())
    prefixes = ("moon.global.", "moon.prev.") if method == "moon" else ("fedga.local.",)
    for c in new.clients:
        for prefix in prefixes:
            kept = {k[len(prefix) :] for k in c.state.tensors if k.startswith(prefix)}
            assert kept == full - frozen, (prefix, kept)
    whole = lambda model: {n: w.detach().clone() for n, w in model.state_dict().items()}  # noqa: E731
    monkeypatch.setattr(baselines, "model_snapshot", whole)
    monkeypatch.setattr(fedga, "model_snapshot", whole)
    old = run()
    assert any(k.endswith("proj.weight") for k in old.clients[0].state.tensors)
    assert [h.client_acc for h in new.history] == [h.client_acc for h in old.history]
    for a, b in zip(new.clients, old.clients):
        for (n, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
            if execution == "sequential":
                assert torch.equal(x, y), n
            else:
                torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
