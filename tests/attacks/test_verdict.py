"""The audit's verdict is model-free: statistics in, a verdict that holds for any mechanism out."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm

from protofl.attacks.verdict import (
    audit_statistics,
    betting_test,
    claim_from_events,
    clopper_pearson,
    detectable_noise_scale,
    epsilon_lower_bound,
    gdp_lower_bound,
    gdp_mu,
    point_claim,
    predictable_guesses,
)
from protofl.privacy.accounting import gaussian_epsilon, gaussian_sigma

DELTA = 1e-5


def laplace_statistics(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A correct pure 1-DP mechanism: a count of sensitivity 1 plus Laplace(1) noise; the
    canary moves it by the full sensitivity (+-1/2)."""
    rng = np.random.default_rng(seed)
    signs = rng.random(n) < 0.5
    return np.where(signs, 0.5, -0.5) + rng.laplace(size=n), signs


@pytest.mark.parametrize(
    "claim", [point_claim(1.0, DELTA), claim_from_events([{"kind": "pure", "epsilon": 1.0}], DELTA)]
)
def test_a_correct_laplace_mechanism_is_not_flagged_where_the_gdp_bound_was(claim) -> None:  # type: ignore[no-untyped-def]
    stats, signs = laplace_statistics(100_000, seed=0)
    out = audit_statistics(stats, signs, claim, alpha=0.01)
    assert out["violation"] is False
    assert out["epsilon_lower_bound"] <= 1.0  # model-free: it can never exceed the truth
    assert out["accuracy_lower_bound"] <= claim.accuracy_max
    # the GDP figure (as if S were Gaussian) overstates the epsilon of this 1-DP mechanism:
    # the old audit's verdict rested on it and reported a violation
    assert out["gdp_estimate"]["epsilon_lower_bound"] > 1.9
    old = gdp_lower_bound(stats[signs], stats[~signs], DELTA, alpha=0.0025)
    assert old["epsilon_lower_bound"] > 1.9


def test_laplace_statistics_are_never_flagged_over_seeds() -> None:
    claim = point_claim(1.0, DELTA)
    flagged = [
        audit_statistics(*laplace_statistics(20_000, seed), claim, alpha=0.01)["violation"]
        for seed in range(20)
    ]
    assert not any(flagged)


def test_gaussian_statistics_of_a_stronger_mechanism_are_flagged() -> None:
    """mu-GDP claimed, the statistic is 1.25 mu apart (0.8 times the noise): flagged."""
    mu = gdp_mu(1.0, DELTA)
    claim = claim_from_events([{"kind": "gaussian", "noise_multiplier": 1.0 / mu}], DELTA)
    assert claim.mu == pytest.approx(mu) and claim.accuracy_max == pytest.approx(norm.cdf(mu / 2))
    rng = np.random.default_rng(1)
    signs = rng.random(64_000) < 0.5
    right = rng.normal(size=64_000) + np.where(signs, 1.25 * mu / 2, -1.25 * mu / 2)
    out = audit_statistics(right, signs, claim, alpha=0.01)
    assert out["violation"] is True and out["flagged_balanced"] is True
    assert out["mu_lower_bound"] > mu and out["epsilon_gdp_refuted"] > 1.0
    # the exact mu-GDP mechanism itself, at the claim's boundary, is not
    exact = rng.normal(size=64_000) + np.where(signs, mu / 2, -mu / 2)
    assert audit_statistics(exact, signs, claim, alpha=0.01)["violation"] is False


def test_the_claims_largest_accuracy() -> None:
    sigma = gaussian_sigma(1.0, DELTA)
    gauss = claim_from_events([{"kind": "gaussian", "noise_multiplier": sigma}], DELTA)
    assert gauss.epsilon == pytest.approx(1.0, rel=1e-3)
    assert gauss.tv == pytest.approx(2 * norm.cdf(1 / (2 * sigma)) - 1)
    pure = claim_from_events([{"kind": "pure", "epsilon": 1.0}], DELTA)
    assert pure.tv == pytest.approx(math.tanh(0.5), rel=1e-6) and pure.mu is None
    point = point_claim(1.0, DELTA)
    assert point.accuracy_max == pytest.approx((math.e + DELTA) / (1 + math.e))
    # twenty pure 0.05 releases compose to far less than pure 1 at epsilon 0 (PLD)
    many = claim_from_events([{"kind": "pure", "epsilon": 0.05}] * 20, DELTA)
    assert many.tv < 0.6 * pure.tv and many.epsilon < 1.0


def test_the_betting_test_holds_its_level_and_covers_the_mean() -> None:
    rng = np.random.default_rng(2)
    m0, alpha = 0.55, 0.05
    rejected, covered = 0, 0
    for _ in range(200):
        y = (rng.random(500) < m0).astype(float)
        out = betting_test(y, m0, alpha)
        rejected += bool(out["rejected"])
        covered += float(out["lower"]) <= m0
    assert rejected <= 0.05 * 200 + 5 and covered >= 0.95 * 200 - 5
    strong = betting_test((rng.random(2000) < 0.65).astype(float), m0, alpha)
    assert strong["rejected"] and 0.6 < float(strong["lower"]) < 0.65


def test_canaries_of_one_client_may_be_dependent() -> None:
    """A mechanism that correlates the classes of a release (here: all 64 canaries of a client
    guessed right or wrong together, each right with the claimed probability) is not flagged by
    the client-level test; treating the canaries as independent would flag it."""
    claim = point_claim(0.2, DELTA)
    m0 = claim.accuracy_max
    rng = np.random.default_rng(3)
    naive, flagged = 0, 0
    for _ in range(20):
        clients, block = 400, 64
        signs = rng.random((clients, block)) < 0.5
        right = np.repeat(rng.random((clients, 1)) < m0, block, axis=1)
        stats = np.where(right == signs, 1.0, -1.0)  # guess "+" when S > 0
        flagged += audit_statistics(stats, signs, claim, alpha=0.01, block=block)["violation"]
        k = int(right.sum())
        lo, _ = clopper_pearson(np.array([k]), right.size, 0.02)
        naive += float(lo[0]) > m0
    assert flagged == 0 and naive >= 5


def test_the_guessing_rule_uses_earlier_clients_only() -> None:
    stats = np.array([5.0, 6.0, -5.0, -6.0] * 8 + [100.0] * 4)
    signs = np.array([True, True, False, False] * 8 + [True] * 4)
    y = predictable_guesses(stats, signs, block=4)
    assert len(y) == 9 and y[0] == 1.0 and y.min() == 1.0
    # a reversed statistic: the rule learns the direction from the past
    y = predictable_guesses(-stats, signs, block=4)
    assert y[0] == 0.0 and y[-1] == 1.0


def test_detectable_noise_scale_grows_with_the_trials() -> None:
    claim = claim_from_events(
        [{"kind": "gaussian", "noise_multiplier": 1 / gdp_mu(1.0, DELTA)}], DELTA
    )
    small = detectable_noise_scale(claim, 2_000, 20, 0.005)
    big = detectable_noise_scale(claim, 64_000, 64, 0.005)
    assert 0 < small < big < 1 and big > 0.8


def test_gdp_estimate_recovers_mu() -> None:
    rng = np.random.default_rng(0)
    mu = 0.5
    out = gdp_lower_bound(rng.normal(mu, 1, 200_000), rng.normal(0, 1, 200_000), DELTA)
    assert out["mu_hat"] == pytest.approx(mu, abs=0.02) and out["mu_lower"] < mu
    assert out["epsilon_lower_bound"] < gaussian_epsilon(1 / mu, DELTA)
    assert gdp_mu(gaussian_epsilon(1 / mu, DELTA), DELTA) == pytest.approx(mu, rel=1e-6)


def test_clopper_pearson_and_the_tail_bound() -> None:
    lo, hi = clopper_pearson(np.array([0, 50, 100]), 100)
    assert lo[0] == 0.0 and hi[0] == pytest.approx(1 - 0.025 ** (1 / 100))
    assert lo[1] < 0.5 < hi[1] and hi[2] == 1.0
    rng = np.random.default_rng(0)
    same = epsilon_lower_bound(rng.normal(size=5000), rng.normal(size=5000), DELTA)
    assert same["epsilon_lower_bound"] < 0.1
    far = epsilon_lower_bound(rng.normal(size=5000) + 6, rng.normal(size=5000), DELTA)
    assert far["epsilon_lower_bound"] > 5.0  # ~log(2500/ln(40)): limited by the trial count
    assert epsilon_lower_bound(np.ones(2), np.zeros(2), DELTA)["epsilon_lower_bound"] == 0.0
