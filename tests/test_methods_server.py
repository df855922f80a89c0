"""FedTGP, MPFT, FedDAP and the FedAvg/FedProx/MOON baselines: hand-computed losses and
aggregations on 2-3 vectors, parameter validation, and the conformance suite per mechanism."""

from __future__ import annotations

import math

import pytest
import torch

from protofl.config import BackboneConfig
from protofl.methods import create_method
from protofl.methods.base import Batch, ClientState, Upload
from protofl.methods.baselines import moon_contrastive, proximal_term
from protofl.methods.checks import check_method
from protofl.methods.feddap import cpcl_loss, domain_prototypes, dpa_loss, fusion_weights
from protofl.methods.fedtgp import adaptive_margin, margin_loss
from protofl.methods.mpft import distillation_kl, teacher_logits
from protofl.models.client import build_client_model
from protofl.privacy.base import Release

LOG1P_E2 = math.log1p(math.exp(-2.0))  # -log(e^2 / (e^2 + e^0)) = 0.126928...


def release(protos: list[list[float]], classes: list[int]) -> Release:
    p = torch.tensor(protos, dtype=torch.float32)
    return Release(
        prototypes=p,
        classes=torch.tensor(classes),
        counts=torch.ones(len(classes), dtype=torch.long),
        sensitivity=torch.full((len(classes),), math.inf),
        noise_std=torch.zeros_like(p),
        mechanism="none",
    )


def upload(client: int, domain: int, protos: list[list[float]], classes: list[int]) -> Upload:
    return Upload(client=client, domain=domain, release=release(protos, classes), num_samples=1)


def make(name: str, params: dict | None = None, *, num_classes: int = 3, dim: int = 2):
    return create_method(name, params, num_classes=num_classes, num_domains=2, proto_dim=dim)


# ----- FedDAP ------------------------------------------------------------------------------
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


# ----- FedTGP ------------------------------------------------------------------------------
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


# ----- MPFT --------------------------------------------------------------------------------
def test_distillation_kl_by_hand() -> None:
    t = 2.0
    teacher = torch.tensor([[t * math.log(3.0), 0.0]])  # softmax(teacher / T) = (3/4, 1/4)
    student = torch.zeros(1, 2)  # (1/2, 1/2)
    kl = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert distillation_kl(student, teacher, t).item() == pytest.approx(t * t * kl, rel=1e-5)
    assert distillation_kl(teacher, teacher, t).item() == pytest.approx(0.0, abs=1e-6)


def test_teacher_logits_by_hand() -> None:
    gs = {
        "mpft.adapter.down.weight": torch.tensor([[1.0, 0.0]]),  # hidden 1
        "mpft.adapter.up.weight": torch.tensor([[0.0], [2.0]]),
        "mpft.head.weight": torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
        "mpft.head.bias": torch.tensor([0.5, 0.0]),
    }
    u = torch.tensor([[3.0, 1.0]])
    # adapter: u + up(relu(down u)) = (3, 1) + (0, 6) = (3, 7)
    assert teacher_logits(u, gs, use_adapter=True).tolist() == [[3.5, 7.0]]
    assert teacher_logits(u, gs, use_adapter=False).tolist() == [[3.5, 1.0]]


def test_mpft_server_learns_released_prototypes() -> None:
    m = make("mpft", {"server_epochs": 200, "server_lr": 0.05}, num_classes=2, dim=4)
    ups = [
        upload(0, 0, [[2.0, 0, 0, 0], [0, 2.0, 0, 0]], [0, 1]),
        upload(1, 1, [[2.0, 0.2, 0, 0], [0.2, 2.0, 0, 0]], [0, 1]),
    ]
    gs = m.aggregate(ups, 0)
    x = torch.cat([u.release.prototypes for u in ups if u.release is not None])
    assert teacher_logits(x, gs, use_adapter=True).argmax(1).tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="teacher"):
        make("mpft", {"teacher": "ensemble"})


# ----- baselines ---------------------------------------------------------------------------
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


# ----- conformance -------------------------------------------------------------------------
# every registered method x mechanism: tests/test_methods_checks.py


def test_check_feddap_personalized() -> None:
    check_method("feddap", "none", {"personalized": True})


@pytest.mark.parametrize("name", ["fedtgp", "mpft"])
def test_the_experiment_seed_reaches_the_server_randomness(name: str) -> None:
    """Three seeds of a run used to share one server init and one shuffle stream."""
    from protofl.methods import create_method

    def server_weights(seed: int) -> list[torch.Tensor]:
        m = create_method(name, {}, num_classes=4, num_domains=2, proto_dim=8, seed=seed)
        model = m.build_generator() if name == "fedtgp" else m.build_server_model()  # type: ignore[attr-defined]
        return [p.detach().clone() for p in model.parameters()]

    a, b, again = server_weights(0), server_weights(1), server_weights(0)
    assert all(torch.equal(x, y) for x, y in zip(a, again))
    assert not all(torch.equal(x, y) for x, y in zip(a, b))
