"""Poisson-subsampled releases (privacy.sample_rate, issue 44 item 3): the accountant against
independent references, the calibration, the mechanism's fixed-denominator release, the
sample's secrecy, the guarantee and the audit."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from scipy.special import gammaln, logsumexp
from scipy.stats import norm

from protofl.attacks.audit import audit_mechanism
from protofl.privacy.accounting import (
    calibrate_gaussian,
    calibrate_sampled,
    epsilon_spent,
    split_events,
    summarise_events,
)
from protofl.privacy.base import create_mechanism
from protofl.privacy.config import PrivacyConfig
from protofl.privacy.guarantee import describe_guarantee
from protofl.privacy.igpp import IGPP
from protofl.privacy.ledger import PrivacyLedger
from protofl.privacy.noise import NoiseKey

DELTA = 1e-5


def _events(z: float, q: float, t: int) -> list[dict[str, Any]]:
    return [{"kind": "poisson_gaussian", "noise_multiplier": z, "sample_rate": q}] * t


# --- independent references (scipy only, no dp-accounting) -----------------------------------
def _exact_delta(z: float, q: float, eps: float) -> float:
    """delta(eps) of ONE Poisson-subsampled Gaussian, add/remove, sensitivity 1, noise std z:
    the larger hockey-stick divergence of P = (1-q)N(0,z^2) + qN(1,z^2) and Q = N(0,z^2), in
    closed form (the likelihood ratio is monotone in x)."""
    e = math.exp(eps)
    # H_e(P||Q): x > x1 where (1 - q) + q exp((2x - 1)/(2 z^2)) = e^eps
    x1 = z * z * math.log((e - 1.0 + q) / q) + 0.5
    remove = (1 - q) * norm.sf(x1 / z) + q * norm.sf((x1 - 1.0) / z) - e * norm.sf(x1 / z)
    add = 0.0
    if math.exp(-eps) > 1.0 - q:  # H_e(Q||P): x < x2 where the ratio p/q is e^-eps
        x2 = z * z * math.log((math.exp(-eps) - 1.0 + q) / q) + 0.5
        add = norm.cdf(x2 / z) - e * ((1 - q) * norm.cdf(x2 / z) + q * norm.cdf((x2 - 1.0) / z))
    return max(remove, add, 0.0)


def _exact_epsilon(z: float, q: float, delta: float) -> float:
    lo, hi = 0.0, 20.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _exact_delta(z, q, mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def _rdp_reference(z: float, q: float, t: int, delta: float) -> float:
    """Integer-order RDP of the subsampled Gaussian (Mironov, Talwar, Zhang 2019, Eq. for
    integer alpha: A = sum_k C(a,k) (1-q)^(a-k) q^k exp((k^2 - k)/(2 z^2))), composed t times
    and converted with eps = rdp + log(1/delta)/(alpha - 1): a valid, looser upper bound."""
    best = math.inf
    for a in range(2, 257):
        k = np.arange(a + 1)
        log_terms = (
            gammaln(a + 1)
            - gammaln(k + 1)
            - gammaln(a - k + 1)
            + (a - k) * math.log1p(-q)
            + k * math.log(q)
            + (k * k - k) / (2 * z * z)
        )
        rdp = float(logsumexp(log_terms)) / (a - 1)
        best = min(best, t * rdp + math.log(1 / delta) / (a - 1))
    return best


@pytest.mark.parametrize(("z", "q"), [(1.0, 0.1), (2.0, 0.3), (0.8, 0.02), (4.0, 0.5)])
def test_one_release_matches_the_exact_divergence(z: float, q: float) -> None:
    exact = _exact_epsilon(z, q, DELTA)
    ours = epsilon_spent(_events(z, q, 1), delta=DELTA)
    assert ours >= exact - 1e-9  # pessimistic: never below the truth
    assert ours <= exact + 5e-3  # and tight (discretisation 1e-3)


@pytest.mark.parametrize(("z", "q", "t"), [(1.0, 0.1, 20), (2.0, 0.3, 20), (3.0, 0.05, 100)])
def test_composition_within_the_independent_rdp_bound(z: float, q: float, t: int) -> None:
    pld = epsilon_spent(_events(z, q, t), delta=DELTA)
    rdp = epsilon_spent(_events(z, q, t), delta=DELTA, accountant="rdp")
    ref = _rdp_reference(z, q, t, DELTA)
    assert pld <= ref  # the tight accountant is below any valid RDP bound
    assert pld <= rdp <= ref * 1.0001  # dp-accounting's RDP (fractional orders too) <= ours
    assert pld >= 0.7 * ref  # and not absurdly below it (a broken composition would be)
    # more releases cost more, a larger sample costs more
    assert epsilon_spent(_events(z, q, t + 5), delta=DELTA) > pld
    assert epsilon_spent(_events(z, min(1.0, 2 * q), t), delta=DELTA) > pld


def test_sample_rate_one_is_the_plain_gaussian() -> None:
    plain = epsilon_spent([{"kind": "gaussian", "noise_multiplier": 3.0}] * 4, delta=DELTA)
    assert epsilon_spent(_events(3.0, 1.0, 4), delta=DELTA) == pytest.approx(plain, rel=1e-12)
    assert calibrate_sampled(1.0, DELTA, 4, 1.0) == calibrate_gaussian(1.0, DELTA, 4)


@pytest.mark.parametrize(("eps", "t", "q"), [(1.0, 20, 0.1), (0.5, 5, 0.3), (2.0, 1, 0.2)])
def test_calibration_meets_the_budget_tightly(eps: float, t: int, q: float) -> None:
    z = calibrate_sampled(eps, DELTA, t, q)
    assert epsilon_spent(_events(z, q, t), delta=DELTA) <= eps
    assert epsilon_spent(_events(z * 0.995, q, t), delta=DELTA) > eps  # not wastefully loose
    assert z < calibrate_gaussian(eps, DELTA, t)  # amplification: less noise on the sum
    z_rdp = calibrate_sampled(eps, DELTA, t, q, "rdp")
    assert epsilon_spent(_events(z_rdp, q, t), delta=DELTA, accountant="rdp") <= eps
    assert z_rdp >= z


def test_events_validate_and_have_no_gaussian_summary() -> None:
    for bad in ({"sample_rate": 0.0}, {"sample_rate": 1.5}, {"noise_multiplier": -1.0}):
        with pytest.raises(ValueError, match="poisson_gaussian event"):
            split_events([{**_events(1.0, 0.5, 1)[0], **bad}])
    with pytest.raises(ValueError, match="no Gaussian summary"):
        summarise_events(_events(1.0, 0.5, 1))
    with pytest.raises(ValueError, match=r"rdp-classic. cannot compose"):
        epsilon_spent(_events(1.0, 0.5, 1), delta=DELTA, accountant="rdp-classic")


# --- configuration ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sample_rate": 0.0}, r"privacy.sample_rate=0.0 is out of range"),
        ({"sample_rate": 1.2}, r"privacy.sample_rate=1.2 is out of range"),
        ({"sample_rate": True}, r"privacy.sample_rate=True is out of range"),
        ({"sample_rate": 0.5, "neighbouring": "replace_one"}, "add/remove neighbouring only"),
        ({"sample_rate": 0.5, "mechanism": "vpp"}, "mechanism igpp only"),
        ({"sample_rate": 0.5, "mechanism": "vpdr"}, "mechanism igpp only"),
        ({"sample_rate": 0.5, "accountant": "rdp-classic"}, "pld or rdp"),
    ],
)
def test_bad_sampling_settings_fail_naming_the_key(kwargs: dict[str, Any], match: str) -> None:
    base = {"mechanism": "igpp", "neighbouring": "add_remove"}
    with pytest.raises(ValueError, match=match):
        PrivacyConfig(**{**base, **kwargs})


def test_mechanism_none_ignores_the_rate() -> None:
    assert not PrivacyConfig(mechanism="none", sample_rate=0.5).sampled


# --- the mechanism ---------------------------------------------------------------------------
def _config(**kw: Any) -> PrivacyConfig:
    return PrivacyConfig(
        **{"mechanism": "igpp", "neighbouring": "add_remove", "sample_rate": 0.25, **kw}
    )


def _data(n: int = 400, dim: int = 8, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g) * 0.3 + 1.0
    return x, torch.arange(n) % classes


def test_fixed_denominator_release_is_unbiased_and_states_its_noise() -> None:
    x, y = _data()
    mech = create_mechanism(_config(epsilon=1e4), rounds=2000, dim=8)
    assert isinstance(mech, IGPP)
    gen = torch.Generator().manual_seed(1)
    releases = [mech.release(x, y, num_classes=3, generator=gen, client="c") for _ in range(2000)]
    mean = torch.stack([r.prototypes for r in releases]).mean(0)
    truth = torch.stack([x[y == c].mean(0) for c in range(3)])
    assert torch.allclose(mean, truth, atol=0.02)  # sum / (q n), not the realised count
    first = releases[0]
    n = torch.bincount(y)
    assert torch.equal(first.counts, n)  # the public counts, not the sample sizes
    assert torch.allclose(first.sensitivity, 5.0 / (0.25 * n.double()).float(), rtol=1e-6)
    expected = mech.sigma * 5.0 / (0.25 * n.double())
    assert torch.allclose(first.noise_std[:, 0].double(), expected, rtol=1e-6)
    assert first.events == [
        {"kind": "poisson_gaussian", "noise_multiplier": mech.sigma, "sample_rate": 0.25}
    ]
    assert mech.max_noise_std(int(n.min())) == pytest.approx(float(expected.max()), rel=1e-6)


def test_the_sample_comes_from_the_noise_key() -> None:
    x, y = _data()
    mech = create_mechanism(_config(), rounds=3, dim=8)
    a = mech.release(x, y, num_classes=3, generator=NoiseKey.derived(7, 0), client="a")
    b = mech.release(x, y, num_classes=3, generator=NoiseKey.derived(7, 0), client="b")
    c = mech.release(x, y, num_classes=3, generator=NoiseKey.derived(8, 0), client="c")
    assert torch.equal(a.prototypes, b.prototypes)  # the same key: the same sample and noise
    assert not torch.equal(a.prototypes, c.prototypes)
    # a noiseless view: with noise subtracted the sample differs between keys, so the sample
    # itself (not only the noise) is drawn from the key
    quiet = create_mechanism(_config(epsilon=50.0), rounds=1, dim=8)
    one = quiet.release(x, y, num_classes=3, generator=NoiseKey.derived(7, 0), client="a")
    quiet = create_mechanism(_config(epsilon=50.0), rounds=1, dim=8)
    two = quiet.release(x, y, num_classes=3, generator=NoiseKey.derived(8, 0), client="a")
    assert (one.prototypes - two.prototypes).abs().max() > 0.05


def test_noisy_counts_release_the_sample_and_clusters_are_refused() -> None:
    x, y = _data()
    mech = create_mechanism(_config(addremove_counts="noisy", epsilon=1e4), rounds=1, dim=8)
    rel = mech.release(x, y, num_classes=3, generator=torch.Generator().manual_seed(0))
    assert (rel.counts.double() / torch.bincount(y).double() - 0.25).abs().max() < 0.1
    mech = create_mechanism(_config(), rounds=1, dim=8)
    with pytest.raises(ValueError, match="sample_rate < 1 cannot release per-cluster"):
        mech.release(
            x,
            y,
            num_classes=3,
            generator=torch.Generator(),
            cluster_fn=lambda f: torch.zeros(f.shape[0], dtype=torch.long),
        )


def test_ledger_and_guarantee_state_the_sampling() -> None:
    cfg = _config(epsilon=1.0)
    mech = create_mechanism(cfg, rounds=4, dim=8)
    x, y = _data()
    ledger = PrivacyLedger(delta=cfg.delta)
    for r in range(4):
        ledger.record(r, mech.release(x, y, num_classes=3, generator=NoiseKey.secret()))
    assert 0.99 < ledger.epsilon_spent() <= 1.0  # type: ignore[operator]
    g = describe_guarantee(cfg, noise_key="secret", rounds=4)
    assert g["sample_rate"] == 0.25
    assert "Poisson subsample at rate 0.25" in g["statement"]
    assert "add_remove" in g["statement"]
    assert mech.describe()["sample_rate"] == 0.25


# --- the audit --------------------------------------------------------------------------------
def test_audit_passes_the_sampled_mechanism_and_flags_a_fake_sample() -> None:
    kw: dict[str, Any] = {"neighbouring": "add_remove", "sample_rate": 0.2, "rounds": 5}
    ok = audit_mechanism("igpp", 1.0, trials=16_000, **kw)
    assert not ok["violation"]
    assert ok["accuracy_lower_bound"] <= ok["accuracy_claimed_max"]

    class NoSample(IGPP):  # claims the subsampled guarantee, releases every example
        name = "igpp"

        def _sample(self, n: int, generator: Any, device: torch.device) -> None:
            return None

    bad = audit_mechanism(NoSample, 1.0, trials=16_000, **kw)
    assert bad["violation"]
    with pytest.raises(ValueError, match="audited with mode='release'"):
        audit_mechanism("igpp", 1.0, trials=16_000, mode="fast", **kw)


def test_cli_calibrates_and_compares_the_subsampled_noise(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from protofl.privacy.cli import main

    assert (
        main(
            [
                "privacy",
                "calibrate",
                "--epsilon",
                "1",
                "--rounds",
                "20",
                "--neighbouring",
                "add_remove",
                "--sample-rate",
                "0.1",
                "--json",
            ]
        )
        == 0
    )
    import json

    res = json.loads(capsys.readouterr().out)
    assert res["sample_rate"] == 0.1
    assert res["sigma"] == pytest.approx(calibrate_sampled(1.0, DELTA, 20, 0.1))
    args = ["privacy", "sampling", "--epsilons", "1", "--rounds", "20", "--rates", "0.1", "1"]
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    # the finding of docs/privacy.md: the fixed denominator q*n costs more than subsampling saves
    assert rows[0]["noise_on_mean"] > rows[1]["noise_on_mean"] == rows[1]["full_sample_sigma"]
    assert (
        main(["privacy", "calibrate", "--epsilon", "1", "--rounds", "2", "--sample-rate", "0.5"])
        == 2
    )
    assert "add/remove neighbouring only" in capsys.readouterr().err
