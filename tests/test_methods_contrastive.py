"""FedPCL, FPL, FedPLVM: losses and aggregation against values computed by hand; conformance."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch

from protofl.methods import create_method
from protofl.methods.base import Batch, ClientState, GlobalState, Upload
from protofl.methods.fedpcl import FedPCL
from protofl.methods.fedplvm import alpha_sparsity
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


class _Identity:
    """A stand-in model whose feature is its input (``predict`` only calls ``features``)."""

    def features(self, z: torch.Tensor) -> torch.Tensor:
        return z


IDENTITY: Any = _Identity()


def _batch(f: list[list[float]], y: list[int], num_classes: int) -> Batch:
    ft = torch.tensor(f, requires_grad=True)
    return Batch(
        z=ft,
        y=torch.tensor(y),
        f=ft,
        f_raw=ft,
        logits=torch.zeros(len(y), num_classes),
        model=IDENTITY,
        client=0,
        domain=0,
    )


def _lse(*xs: float) -> float:
    return math.log(sum(math.exp(x) for x in xs))


# ----- FedPCL ---------------------------------------------------------------------------------
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
    m.begin_local(IDENTITY, state, g, 0)
    m.client_loss(_batch([[1.0, 0.0], [1.0, 1.0]], [0, 1], 2), g, state)
    m.client_loss(_batch([[1.0, 0.0]], [0], 2), g, state)
    m.end_local(IDENTITY, state, g, 0)
    assert torch.allclose(state.tensors["local_prototypes"], torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    assert state.tensors["local_classes"].tolist() == [0, 1]
    assert m.predict(IDENTITY, z, g, state).tolist() == [0, 1]
    # explicit training data (the hook the engine may pass) take precedence
    m.end_local(
        IDENTITY,
        state,
        g,
        0,
        train_z=torch.tensor([[0.0, 1.0], [1.0, 0.0]]),
        train_y=torch.tensor([0, 1]),
    )
    assert m.predict(IDENTITY, z, g, state).tolist() == [1, 1]


# ----- FPL ------------------------------------------------------------------------------------
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


def _fpl_state() -> GlobalState:
    return {
        "cluster_prototypes": torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]),
        "cluster_classes": torch.tensor([0, 0, 1]),
        "prototypes": torch.tensor([[0.5, 0.5], [-1.0, 0.0]]),
        "classes": torch.tensor([0, 1]),
    }


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


# ----- FedPLVM --------------------------------------------------------------------------------
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


# ----- validation -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "params", "named"),
    [
        ("fedpcl", {"tau": 0}, "tau"),
        ("fedpcl", {"ce_weight": -1}, "ce_weight"),
        ("fpl", {"temperature": -0.1}, "temperature"),
        ("fpl", {"w_mse": "x"}, "w_mse"),
        ("fpl", {"share_weights": 1}, "share_weights"),
        ("fedplvm", {"alpha": 1.5}, "alpha"),
        ("fedplvm", {"correction": "l1"}, "correction"),
        ("fedplvm", {"contrast": "x"}, "contrast"),
        ("fedplvm", {"lam": -1}, "lam"),
        ("fedplvm", {"metric": "l2"}, "metric"),
        ("fpl", {"temprature": 0.1}, "temprature"),
    ],
)
def test_bad_parameters_are_named(method: str, params: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        create_method(method, params, num_classes=2, num_domains=1, proto_dim=2)


def test_share_weights_option() -> None:
    for name in ("fpl", "fedplvm"):
        assert not create_method(name, {}, num_classes=2, num_domains=1, proto_dim=2).shares_weights
        on = create_method(name, {"share_weights": True}, num_classes=2, num_domains=1, proto_dim=2)
        assert on.shares_weights


# ----- conformance ----------------------------------------------------------------------------
# every registered method x mechanism: tests/test_methods_checks.py


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
    from protofl.methods.base import Batch, ClientState

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
