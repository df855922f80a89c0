"""IGPP and VPP on the common release pipeline (privacy/prototype.py): sensitivity (property
tests), applied noise, events, selection, bad input."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protofl.privacy import MECHANISM_REGISTRY, PrivacyConfig, create_mechanism
from protofl.privacy.accounting import calibrate_gaussian
from protofl.privacy.igpp import IGPP
from protofl.privacy.ledger import PrivacyLedger
from protofl.privacy.prototype import clip_groups, clip_l2
from protofl.privacy.vpp import VPP, anova_scores, laplace_noise, topk_mask

DIM = 8
CLASSES = 3


def signal_data(
    n: int = 600, d: int = 64, c: int = 4, seed: int = 0, informative: int = 12
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % c
    mu = torch.zeros(c, d)
    mu[:, :informative] = 2.0 * torch.randn(c, informative, generator=g)
    x = mu[y] + torch.randn(n, d, generator=g)
    truth = torch.zeros(d, dtype=torch.bool)
    truth[:informative] = True
    return x, y, truth


# ---- sensitivity: hypothesis property tests -------------------------------------------------
vectors = st.lists(
    st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=DIM, max_size=DIM),
    min_size=4,
    max_size=12,
)


@st.composite
def neighbours(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """D (features, labels), D' = D with one example replaced (same label), and its index."""
    rows = draw(vectors)
    x = torch.tensor(rows, dtype=torch.float64)
    n = x.shape[0]
    labels = draw(st.lists(st.integers(0, CLASSES - 1), min_size=n, max_size=n))
    y = torch.tensor(labels)
    i = draw(st.integers(0, n - 1))
    new = draw(st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=DIM, max_size=DIM))
    x2 = x.clone()
    x2[i] = torch.tensor(new, dtype=torch.float64)
    return x, x2, y, i


def by_class(rel: object) -> dict[int, tuple[torch.Tensor, float]]:
    return {
        int(c): (p, float(s))
        for c, p, s in zip(rel.classes, rel.prototypes, rel.sensitivity)  # type: ignore[attr-defined]
    }


@settings(max_examples=60, deadline=None)
@given(data=neighbours(), clip=st.floats(0.1, 10.0), group_clip=st.booleans())
def test_igpp_sensitivity(
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int], clip: float, group_clip: bool
) -> None:
    x, x2, y, _ = data
    cfg = PrivacyConfig(mechanism="igpp", clip=clip, igpp_group_clip=group_clip)
    m = IGPP(cfg, rounds=1, dim=DIM)
    part = topk_mask(torch.arange(DIM, dtype=torch.float64), 3) if group_clip else None
    a = by_class(m.noiseless_release(x, y, num_classes=CLASSES, partition=part))
    b = by_class(m.noiseless_release(x2, y, num_classes=CLASSES, partition=part))
    assert a.keys() == b.keys()
    for c, (p, delta) in a.items():
        n = int((y == c).sum())
        assert delta == pytest.approx(2 * clip / n)
        assert float((p - b[c][0]).norm()) <= delta * (1 + 1e-9)


@settings(max_examples=60, deadline=None)
@given(
    data=neighbours(),
    clip=st.floats(0.1, 10.0),
    k=st.integers(1, DIM // 2),
    perm_seed=st.integers(0, 1000),
)
def test_vpp_group_sensitivity(
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int], clip: float, k: int, perm_seed: int
) -> None:
    x, x2, y, _ = data
    rho = k / DIM
    cfg = PrivacyConfig(mechanism="vpp", clip=clip, vpp_rho=rho)
    m = VPP(cfg, rounds=1, dim=DIM)
    assert m.k == k
    g = torch.Generator().manual_seed(perm_seed)
    mask = torch.zeros(DIM, dtype=torch.bool)
    mask[torch.randperm(DIM, generator=g)[:k]] = True
    a = by_class(m.noiseless_release(x, y, num_classes=CLASSES, partition=mask))
    b = by_class(m.noiseless_release(x2, y, num_classes=CLASSES, partition=mask))
    for c, (p, delta) in a.items():
        n = int((y == c).sum())
        d_a, d_b = m.group_sensitivity(n)
        assert d_a == pytest.approx(2 * clip * math.sqrt(k / DIM) / n)  # Delta_A = Delta*kappa_A
        assert math.hypot(d_a, d_b) == pytest.approx(delta)  # Delta^2 = Delta_A^2 + Delta_B^2
        diff = p - b[c][0]
        assert float(diff[mask].norm()) <= d_a * (1 + 1e-9)
        assert float(diff[~mask].norm()) <= d_b * (1 + 1e-9)
        assert float(diff.norm()) <= delta * (1 + 1e-9)


@settings(max_examples=40, deadline=None)
@given(data=neighbours(), clip=st.floats(0.1, 10.0))
def test_cluster_sensitivity_with_data_independent_membership(
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int], clip: float
) -> None:
    x, x2, y, _ = data

    def parity(f: torch.Tensor) -> torch.Tensor:  # membership by position: data-independent
        return torch.arange(f.shape[0]) % 2

    m = IGPP(PrivacyConfig(mechanism="igpp", clip=clip), rounds=1, dim=DIM)
    a = m.noiseless_release(x, y, num_classes=CLASSES, cluster_fn=parity)
    b = m.noiseless_release(x2, y, num_classes=CLASSES, cluster_fn=parity)
    assert torch.equal(a.counts, b.counts)
    for i in range(a.num_prototypes):
        assert float(a.sensitivity[i]) == pytest.approx(2 * clip / int(a.counts[i]))
        diff = float((a.prototypes[i] - b.prototypes[i]).norm())
        assert diff <= float(a.sensitivity[i]) * (1 + 1e-9)


@settings(max_examples=40, deadline=None)
@given(data=neighbours(), clip=st.floats(0.1, 10.0), mech=st.sampled_from(["igpp", "vpp"]))
def test_add_remove_sum_sensitivity(
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int], clip: float, mech: str
) -> None:
    x, _, y, i = data
    keep = torch.arange(x.shape[0]) != i
    cfg = PrivacyConfig(mechanism=mech, clip=clip, neighbouring="add_remove")
    m = create_mechanism(cfg, rounds=1, dim=DIM)
    part = topk_mask(torch.arange(DIM, dtype=torch.float64), 2)
    a = m.noiseless_release(x, y, num_classes=CLASSES, partition=part)  # type: ignore[attr-defined]
    b = m.noiseless_release(x[keep], y[keep], num_classes=CLASSES, partition=part)  # type: ignore[attr-defined]
    sums_a = {int(c): p * n for c, p, n in zip(a.classes, a.prototypes, a.counts)}
    sums_b = {int(c): p * n for c, p, n in zip(b.classes, b.prototypes, b.counts)}
    for c in sums_a:
        other = sums_b.get(c, torch.zeros(DIM, dtype=torch.float64))
        assert float((sums_a[c] - other).norm()) <= clip * (1 + 1e-9)
    for s, n in zip(a.sensitivity, a.counts):
        assert float(s) == pytest.approx(clip / int(n))


# ---- clipping ---------------------------------------------------------------------------------
def test_clipping() -> None:
    x = torch.randn(50, 16) * 10
    assert (clip_l2(x, 2.0).norm(dim=1) <= 2.0 + 1e-5).all()
    small = torch.randn(5, 16) * 0.01
    assert torch.allclose(clip_l2(small, 2.0), small)
    mask = torch.zeros(16, dtype=torch.bool)
    mask[:4] = True
    z = clip_groups(x, mask, 1.0, math.sqrt(3.0))
    assert (z[:, :4].norm(dim=1) <= 1.0 + 1e-5).all()
    assert (z[:, 4:].norm(dim=1) <= math.sqrt(3.0) + 1e-5).all()
    assert (z.norm(dim=1) <= 2.0 + 1e-5).all()


# ---- noise: empirical std vs stated std -------------------------------------------------------
def _residuals(mech: str, releases: int, **cfg: object) -> tuple[list[torch.Tensor], ...]:
    n_classes, per_class, d = 100, 7, 16
    y = torch.arange(n_classes * per_class) % n_classes
    x = torch.randn(n_classes * per_class, d, generator=torch.Generator().manual_seed(1)) * 3
    config = PrivacyConfig(mechanism=mech, epsilon=2.0, clip=2.0, **cfg)  # type: ignore[arg-type]
    m = create_mechanism(config, rounds=releases, dim=d)
    gen = torch.Generator().manual_seed(7)
    res, std, masks = [], [], []
    for _ in range(releases):
        rel = m.release(x, y, num_classes=n_classes, generator=gen, client="c")
        part = None
        if mech == "vpp":
            std_row = rel.noise_std[0]
            part = std_row < std_row.max()  # A has the smaller std (rho <= 0.5)
            masks.append(part)
        clean = m.noiseless_release(x, y, num_classes=n_classes, partition=part)  # type: ignore[attr-defined]
        assert torch.allclose(rel.noise_std, clean.noise_std)
        res.append(rel.prototypes - clean.prototypes)
        std.append(rel.noise_std)
    return res, std, masks


def test_igpp_noise_std_matches_stated() -> None:
    res, std, _ = _residuals("igpp", 150)
    r = torch.cat(res)  # [150*100, 16]
    s = torch.cat(std)
    sigma = calibrate_gaussian(2.0, 1e-5, 150)
    assert float(s[0, 0]) == pytest.approx(sigma * 2 * 2.0 / 7)  # sigma_iso * 2R/n
    emp = r.std(dim=0)
    assert torch.allclose(emp, s[0], rtol=0.03)


def test_vpp_noise_std_matches_stated_per_group() -> None:
    res, std, masks = _residuals("vpp", 150, vpp_rho=0.25)
    cfg_k = 4
    z = torch.cat([r / s for r, s in zip(res, std)])  # standardised residuals
    in_a = torch.cat([m.expand(100, -1) for m in masks])
    assert all(int(m.sum()) == cfg_k for m in masks)
    assert float(z[in_a].std()) == pytest.approx(1.0, rel=0.03)
    assert float(z[~in_a].std()) == pytest.approx(1.0, rel=0.03)
    assert torch.allclose(z.std(dim=0), torch.ones(16, dtype=z.dtype), rtol=0.03)
    m = VPP(PrivacyConfig(mechanism="vpp", epsilon=2.0, clip=2.0, vpp_rho=0.25), rounds=150, dim=16)
    b = m.budget
    s0, m0 = std[0][0], masks[0]
    n = 7
    assert float(s0[m0][0]) == pytest.approx(b.sigma_A * 2 * m.radius_a / n)  # Eq. (14)
    assert float(s0[~m0][0]) == pytest.approx(b.sigma_B * 2 * m.radius_b / n)


def test_laplace_noise_moments() -> None:
    g = torch.Generator().manual_seed(0)
    x = laplace_noise((200_000,), 3.0, g)
    assert float(x.abs().mean()) == pytest.approx(3.0, rel=0.02)
    assert float(x.var()) == pytest.approx(2 * 9.0, rel=0.03)


# ---- releases, events, ledger -------------------------------------------------------------
def test_registry_and_vpdr() -> None:
    assert {"none", "igpp", "vpp"} <= set(MECHANISM_REGISTRY.names())
    m = create_mechanism(PrivacyConfig(mechanism="vpdr"), rounds=5, dim=32)
    assert isinstance(m, VPP)


def test_determinism_and_generator() -> None:
    x, y, _ = signal_data(d=32)
    for mech in ("igpp", "vpp"):
        outs = []
        for seed in (0, 0, 1):
            m = create_mechanism(PrivacyConfig(mechanism=mech), rounds=1, dim=32)
            gen = torch.Generator().manual_seed(seed)
            outs.append(m.release(x, y, num_classes=4, generator=gen).prototypes)
        assert torch.equal(outs[0], outs[1])
        assert not torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("variant", ["paper", "normalized", "once", "normalized_once", "history"])
def test_vpp_events_and_ledger(variant: str) -> None:
    x, y, _ = signal_data(d=32)
    rounds = 6
    cfg = PrivacyConfig(mechanism="vpp", epsilon=2.0, vpp_variant=variant)
    m = create_mechanism(cfg, rounds=rounds, dim=32)
    ledger = PrivacyLedger(delta=cfg.delta, accountant=cfg.accountant)
    gen = torch.Generator().manual_seed(0)
    for r in range(rounds):
        rel = m.release(x, y, num_classes=4, generator=gen, client="alice")
        kinds = [e["kind"] for e in rel.events]
        selects = variant in ("paper", "normalized") or (variant.endswith("once") and r == 0)
        assert kinds == (["pure", "gaussian"] if selects else ["gaussian"])
        assert 0.0 <= rel.diagnostics["partition_overlap"] <= 1.0
        ledger.record(r, rel)
    spent = ledger.epsilon_spent()
    assert spent is not None and 0.99 * 2.0 <= spent <= 2.0
    with pytest.raises(RuntimeError, match="alice"):
        m.release(x, y, num_classes=4, generator=gen, client="alice")
    # another client has its own budget
    m.release(x, y, num_classes=4, generator=gen, client="bob")


def test_igpp_ledger_spends_exactly_the_budget() -> None:
    x, y, _ = signal_data(d=32)
    cfg = PrivacyConfig(mechanism="igpp", epsilon=1.0)
    m = create_mechanism(cfg, rounds=20, dim=32)
    ledger = PrivacyLedger(delta=cfg.delta)
    gen = torch.Generator().manual_seed(0)
    for r in range(20):
        ledger.record(r, m.release(x, y, num_classes=4, generator=gen))
    assert ledger.epsilon_spent() == pytest.approx(1.0, rel=1e-6)
    assert ledger.epsilon_spent() <= 1.0


def test_vpp_partition_is_random_with_paper_defaults_but_not_normalized() -> None:
    """With H=0.1 every informative score is clipped to H: even without noise the paper's
    selection cannot find the informative dimensions; normalised scores can, given budget."""
    x, y, truth = signal_data(d=64, informative=13)
    raw = anova_scores(x, y, 4, 1e-3)
    assert torch.equal(topk_mask(raw, 13), truth)
    gen = torch.Generator().manual_seed(0)
    paper = create_mechanism(PrivacyConfig(mechanism="vpp"), rounds=30, dim=64)
    overlaps = [
        paper.release(x, y, num_classes=4, generator=gen, client=str(i)).diagnostics[
            "partition_overlap"
        ]
        for i in range(30)
    ]
    mean = sum(overlaps) / len(overlaps)
    assert abs(mean - 0.2) < 0.08  # chance level is k/d ~ 0.2
    huge = dict(mechanism="vpp", epsilon=1e7, vpp_variant="paper")
    rel = create_mechanism(PrivacyConfig(**huge), rounds=1, dim=64).release(  # type: ignore[arg-type]
        x, y, num_classes=4, generator=gen
    )
    assert rel.diagnostics["partition_overlap"] < 0.6  # clipped scores tie at H: still near chance
    huge["vpp_variant"] = "normalized"
    rel = create_mechanism(PrivacyConfig(**huge), rounds=1, dim=64).release(  # type: ignore[arg-type]
        x, y, num_classes=4, generator=gen
    )
    assert rel.diagnostics["partition_overlap"] == 1.0


def test_empty_and_small_classes(caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(12, DIM)
    y = torch.tensor([0] * 10 + [2] * 2)  # class 1 empty, class 2 tiny
    m = IGPP(PrivacyConfig(mechanism="igpp"), rounds=1, dim=DIM)
    with caplog.at_level(logging.WARNING, logger="protofl.privacy.prototype"):
        rel = m.release(x, y, num_classes=3, generator=torch.Generator(), client="carol")
    assert rel.classes.tolist() == [0, 2]
    assert rel.counts.tolist() == [10, 2]
    assert "carol" in caplog.text and "class 2" in caplog.text and "class 0" not in caplog.text
    # a client without samples releases (and is charged) nothing
    m2 = IGPP(PrivacyConfig(mechanism="igpp"), rounds=1, dim=DIM)
    empty = m2.release(
        torch.zeros(0, DIM),
        torch.zeros(0, dtype=torch.long),
        num_classes=3,
        generator=torch.Generator(),
    )
    assert empty.num_prototypes == 0 and empty.events == []


def test_add_remove_noisy_counts_releases_every_class() -> None:
    x = torch.randn(40, DIM)
    y = torch.zeros(40, dtype=torch.long)  # only class 0 present
    cfg = PrivacyConfig(
        mechanism="igpp", epsilon=1000.0, neighbouring="add_remove", addremove_counts="noisy"
    )
    m = IGPP(cfg, rounds=1, dim=DIM)
    rel = m.release(x, y, num_classes=3, generator=torch.Generator().manual_seed(0))
    assert rel.events == [{"kind": "gaussian", "noise_multiplier": m.sigma}]
    assert 0 in rel.classes.tolist()
    assert abs(int(rel.counts[rel.classes.tolist().index(0)]) - 40) <= 1
    with pytest.raises(ValueError, match="cluster"):
        IGPP(cfg, rounds=1, dim=DIM).release(
            x, y, num_classes=3, generator=torch.Generator(), cluster_fn=lambda f: f[:, 0] > 0
        )
    assert "add_remove" in m.describe()["neighbouring"]


def test_bad_features_name_client() -> None:
    x = torch.randn(10, DIM)
    x[3, 2] = float("nan")
    y = torch.zeros(10, dtype=torch.long)
    for mech in ("igpp", "vpp"):
        m = create_mechanism(PrivacyConfig(mechanism=mech), rounds=1, dim=DIM)
        with pytest.raises(ValueError, match="dave"):
            m.release(x, y, num_classes=2, generator=torch.Generator(), client="dave")
        with pytest.raises(ValueError, match="shape"):
            m.release(torch.randn(10, DIM + 1), y, num_classes=2, generator=torch.Generator())


def test_describe_and_state() -> None:
    m = VPP(PrivacyConfig(mechanism="vpp", vpp_variant="once"), rounds=3, dim=32)
    d = m.describe()
    for key in (
        "sigma",
        "accountant",
        "epsilon",
        "delta",
        "neighbouring",
        "clip",
        "vpp_sigma_A",
        "vpp_sigma_B",
        "vpp_laplace_scale",
        "vpp_k",
        "vpp_split",
        "vpp_variant",
    ):
        assert key in d
    x, y, _ = signal_data(d=32)
    gen = torch.Generator().manual_seed(0)
    first = m.release(x, y, num_classes=4, generator=gen, client="e")
    state = m.state_dict()
    m2 = VPP(PrivacyConfig(mechanism="vpp", vpp_variant="once"), rounds=3, dim=32)
    m2.load_state_dict(state)
    assert m2.releases_left("e") == 2
    again = m2.release(x, y, num_classes=4, generator=gen, client="e")
    assert torch.equal(first.noise_std, again.noise_std)  # the cached partition is reused
    assert [e["kind"] for e in again.events] == ["gaussian"]
    igpp_mech = IGPP(PrivacyConfig(mechanism="igpp"), rounds=3, dim=32)
    igpp = igpp_mech.describe()
    assert igpp["sigma"] == pytest.approx(calibrate_gaussian(1.0, 1e-5, 3))
    assert igpp_mech.max_noise_std(10) == pytest.approx(igpp["sigma"] * 2 * 5.0 / 10)
    assert igpp_mech.norm_bound(10) is not None
    # VPP: the largest std is B's; releases never exceed it
    assert m.max_noise_std(7) == pytest.approx(m.budget.sigma_B * 2 * m.radius_b / 7)
    counts = again.counts.clamp_min(1).unsqueeze(1).to(again.noise_std.dtype)
    assert float((again.noise_std * counts).max()) <= m.max_noise_std(1) * (1 + 1e-5)  # float32


def test_non_finite_scores_never_win_the_selection() -> None:
    """Features of magnitude ~1e200 give NaN/inf ANOVA scores; they count as 0, never as top."""
    vpp = VPP(PrivacyConfig(mechanism="vpp", vpp_variant="normalized"), rounds=1, dim=16)
    raw = torch.tensor(
        [float("nan"), float("inf"), -float("inf")] + [0.05] * 12 + [0.2], dtype=torch.float64
    )
    bounded = vpp.bounded_scores(raw)
    assert torch.isfinite(bounded).all() and bounded[:3].eq(0).all()
    assert int(bounded.argmax()) == 15
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 16, generator=g, dtype=torch.float64)
    x[:, 0] = 1e200 * torch.sign(x[:, 0])
    y = torch.arange(40) % 4
    assert not torch.isfinite(vpp.scores(x, y, 4)).all()
    rel = vpp.release(x, y, num_classes=4, generator=g, client="huge")
    assert 0.0 <= rel.diagnostics["partition_overlap"] <= 1.0
