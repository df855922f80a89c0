"""The distributed discrete Gaussian's accounting against independent references: the exact
Renyi divergence of the sum of n discrete Gaussians (its pmf by convolution, numpy only), and
dp-accounting's RDP accountant for the continuous Gaussian it tends to."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.rdp import RdpAccountant

from protofl.privacy.accounting import epsilon_spent
from protofl.privacy.ddg import conditional_round, discrete_gaussian
from protofl.privacy.ddg_accounting import (
    calibrate_ddg,
    ddg_epsilon,
    ddg_rdp,
    rounding_norm_bound,
    wrap_probability,
)


def _dg_pmf(sigma: float, half: int) -> np.ndarray:
    x = np.arange(-half, half + 1, dtype=np.float64)
    p = np.exp(-(x * x) / (2.0 * sigma * sigma))
    return p / p.sum()


def _sum_pmf(sigma: float, n: int, half: int) -> np.ndarray:
    """pmf of the sum of n N_Z(0, sigma^2) on [-n*half, n*half]."""
    one = _dg_pmf(sigma, half)
    out = one
    for _ in range(n - 1):
        out = np.convolve(out, one)
    return out


def _exact_rdp(sigma: float, n: int, shift: int, alpha: float) -> float:
    """D_alpha(Z || Z + shift) of the sum Z, summed over the support in log space."""
    half = math.ceil(40 * sigma + alpha * abs(shift) + 10)
    p = _sum_pmf(sigma, n, half)
    keep = p > 0
    logp = np.full_like(p, -np.inf)
    logp[keep] = np.log(p[keep])
    logq = np.roll(logp, shift)  # q(x) = p(x - shift)
    if shift > 0:
        logq[:shift] = -np.inf
    both = np.isfinite(logp) & np.isfinite(logq)
    terms = alpha * logp[both] + (1.0 - alpha) * logq[both]
    m = terms.max()
    return float((m + math.log(np.exp(terms - m).sum())) / (alpha - 1.0))


@pytest.mark.parametrize("sigma", [0.5, 0.8, 1.5, 4.0])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_proposition_14_never_under_the_exact_divergence_of_the_sum(sigma: float, n: int) -> None:
    for shift in (1, 2, 5):
        for alpha in (1.5, 2.0, 4.0, 10.0):
            exact = _exact_rdp(sigma, n, shift, alpha)
            bound = float(ddg_rdp(alpha, l2=shift, l1=shift, sigma=sigma, clients=n, dim=1))
            assert bound >= exact - 1e-9, (sigma, n, shift, alpha, bound, exact)


def test_the_bound_is_tight_where_the_sum_is_nearly_gaussian() -> None:
    # sigma 4, n 3: tau ~ 1e-135, so the bound is the continuous alpha Delta^2 / (2 n sigma^2)
    for shift, alpha in ((1, 2.0), (3, 8.0)):
        exact = _exact_rdp(4.0, 3, shift, alpha)
        bound = float(ddg_rdp(alpha, l2=shift, l1=shift, sigma=4.0, clients=3, dim=1))
        assert bound == pytest.approx(exact, rel=1e-3)


def test_a_vector_shift_is_bounded_by_its_l1_and_l2_norms() -> None:
    # independent coordinates: the exact divergence is the sum over coordinates
    sigma, n, shift = 0.6, 2, np.array([1, -2, 0, 3])
    for alpha in (2.0, 5.0):
        exact = sum(_exact_rdp(sigma, n, int(abs(s)), alpha) for s in shift if s)
        bound = float(
            ddg_rdp(
                alpha,
                l2=float(np.linalg.norm(shift)),
                l1=float(np.abs(shift).sum()),
                sigma=sigma,
                clients=n,
                dim=len(shift),
            )
        )
        assert bound >= exact - 1e-9


def test_the_conversion_matches_dp_accountings_rdp_gaussian_when_tau_vanishes() -> None:
    sigma, n, l2, releases = 3000.0, 10, 1000.0, 20
    event = {"kind": "ddg", "l2": l2, "l1": l2 * 20, "sigma": sigma, "clients": n, "dim": 400}
    ours = ddg_epsilon([event] * releases, delta=1e-5)
    acc = RdpAccountant()
    z = math.sqrt(n) * sigma / l2
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), releases))
    assert ours == pytest.approx(acc.get_epsilon(1e-5), rel=0.02)
    # the ledger's composition is the same number
    assert epsilon_spent([event] * releases, delta=1e-5) == ours


def test_calibration_meets_the_budget_and_is_tight() -> None:
    kw = {"l2": 500.0, "l1": 500.0 * 16, "clients": 8, "dim": 256}
    sigma = calibrate_ddg(1.0, 1e-5, 5, **kw)

    def spent(s: float) -> float:
        ev = {"kind": "ddg", "sigma": s, **kw}
        return ddg_epsilon([ev] * 5, delta=1e-5)

    assert spent(sigma) <= 1.0
    assert spent(sigma * (1 - 3e-4)) > 1.0


def test_discrete_gaussian_draws_follow_the_pmf() -> None:
    gen = torch.Generator().manual_seed(0)
    draws = discrete_gaussian(gen, 200_000, 1.5, "t").numpy()
    assert draws.dtype == np.int64
    pmf = _dg_pmf(1.5, 12)
    counts = np.bincount(draws + 12, minlength=25)[:25]
    expected = pmf * len(draws)
    ok = expected > 50
    chi2 = float((((counts - expected) ** 2) / expected)[ok].sum())
    assert chi2 < 60  # ~12 degrees of freedom: 60 is far in the tail
    big = discrete_gaussian(gen, 100_000, 1000.0, "t").double()
    assert float(big.std()) == pytest.approx(1000.0, rel=0.02)
    assert abs(float(big.mean())) < 20


def test_conditional_rounding_is_unbiased_and_always_within_its_bound() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True) * 3.0  # every row at norm 3
    bound = rounding_norm_bound(3.0, 16, math.exp(-0.5))
    rounds = torch.stack([conditional_round(x, bound, gen, f"r{i}") for i in range(400)])
    assert (rounds.double().norm(dim=2) <= bound + 1e-12).all()
    # conditioning on the norm biases a little; plain rounding's bias is 0
    assert float((rounds.double().mean(dim=0) - x).abs().max()) < 0.15


def test_the_wrap_bound_falls_with_headroom() -> None:
    kw = {"examples": 1000, "example_bound": 1000.0, "clients": 10, "coords": 100}
    tight = wrap_probability(bits=22, sigma=1e4, **kw)
    loose = wrap_probability(bits=32, sigma=1e4, **kw)
    assert loose < 1e-300 < tight <= 1.0
    assert wrap_probability(bits=16, sigma=1.0, **kw) == 1.0  # the data alone overflows


def test_the_reference_has_teeth_the_continuous_formula_is_not_enough_at_small_sigma() -> None:
    # the sum of discrete Gaussians is not a discrete Gaussian: at sigma 1/2 its divergence
    # exceeds the continuous alpha Delta^2 / (2 n sigma^2), which Proposition 14's tau covers
    exact = _exact_rdp(0.5, 5, 1, 2.0)
    assert exact > 2.0 / (2 * 5 * 0.25) + 0.03
    assert float(ddg_rdp(2.0, l2=1, l1=1, sigma=0.5, clients=5, dim=1)) >= exact
