"""Accounting for the distributed discrete Gaussian over secure aggregation (``ddg``).

The mechanism (Kairouz, Liu and Steinke, "The Distributed Discrete Gaussian Mechanism for
Federated Learning with Secure Aggregation", ICML 2021, arXiv 2102.06387): each of n clients
adds independent discrete Gaussian noise N_Z(0, sigma^2) to every coordinate of its integer
vector; the server sees only the (modular) sum.  The sum of n discrete Gaussians is not itself
a discrete Gaussian, but close to N_Z(0, n sigma^2); Proposition 14 of the paper bounds its
Renyi divergence for an integer shift Delta with ||Delta||_2 <= l2 and ||Delta||_1 <= l1 in d
coordinates::

    tau  = 10 * sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k+1))
    a    = l2 / (sqrt(n) sigma),   b = l1 / (sqrt(n) sigma)
    D_alpha <= min( alpha/2 a^2 + tau d,
                    alpha/2 (a^2 + 2 b tau + tau^2 d),
                    alpha/2 (a + sqrt(d) tau)^2 )

RDP composes by addition over releases and converts to (epsilon, delta) with dp-accounting's
conversion (:func:`dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon`).  The bound is
tested against the exact Renyi divergence of the sum (its pmf by convolution) in
``tests/privacy/test_ddg_accounting.py``.

Ledger event (JSON-safe)::

    {"kind": "ddg", "l2": l2, "l1": l1, "sigma": sigma, "clients": n, "dim": d}

with l2, l1 and sigma in the integer (quantised) units and n the number of honest clients
whose noise the sum is guaranteed to hold.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

DDG_ORDERS: tuple[float, ...] = tuple(
    [1.0 + i / 20.0 for i in range(1, 40)]
    + [3.0 + i / 4.0 for i in range(0, 36)]
    + [float(a) for a in range(12, 129)]
    + [160.0, 192.0, 256.0, 384.0, 512.0, 1024.0]
)
"""Renyi orders the conversion searches (fine near 1..12 where the optimum lies for the
budgets of interest)."""

SIGMA_MIN = 0.5
"""Proposition 14 needs sigma >= 1/2 (per client, integer units)."""


def ddg_tau(sigma: float, clients: int) -> float:
    """tau of Proposition 14: 10 * sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k/(k+1))."""
    if clients < 1:
        raise ValueError(f"clients={clients!r} must be >= 1")
    s2 = 2.0 * math.pi**2 * sigma * sigma
    return 10.0 * sum(math.exp(-s2 * k / (k + 1.0)) for k in range(1, clients))


def ddg_rdp(
    alpha: float | np.ndarray, *, l2: float, l1: float, sigma: float, clients: int, dim: int
) -> np.ndarray:
    """Proposition 14's bound on D_alpha(Z || Z + Delta) for the sum Z of ``clients`` discrete
    Gaussians N_Z(0, sigma^2) per coordinate, any integer Delta with ||Delta||_2 <= ``l2`` and
    ||Delta||_1 <= ``l1`` in ``dim`` coordinates."""
    if sigma < SIGMA_MIN:
        raise ValueError(f"sigma={sigma!r}: the bound needs sigma >= {SIGMA_MIN}")
    a = np.asarray(alpha, dtype=np.float64)
    tau = ddg_tau(sigma, clients)
    root = math.sqrt(clients) * sigma
    x, y = l2 / root, l1 / root
    t1 = a / 2.0 * x * x + tau * dim
    t2 = a / 2.0 * (x * x + 2.0 * y * tau + tau * tau * dim)
    t3 = a / 2.0 * (x + math.sqrt(dim) * tau) ** 2
    return np.minimum(np.minimum(t1, t2), t3)


def check_event(ev: Mapping[str, Any]) -> tuple[float, float, float, int, int]:
    """(l2, l1, sigma, clients, dim) of a ``ddg`` event; ValueError naming a bad field."""
    try:
        l2, l1, sigma = float(ev["l2"]), float(ev["l1"]), float(ev["sigma"])
        n, d = int(ev["clients"]), int(ev["dim"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"ddg event {dict(ev)!r} needs l2, l1, sigma, clients, dim") from None
    if not (l2 > 0 and l1 > 0 and sigma >= SIGMA_MIN and n >= 1 and d >= 1):
        raise ValueError(
            f"ddg event {dict(ev)!r}: l2, l1 > 0, sigma >= {SIGMA_MIN}, clients, dim >= 1"
        )
    return l2, l1, sigma, n, d


def ddg_epsilon(
    events: Iterable[Mapping[str, Any]],
    *,
    inv_z2: float = 0.0,
    pure: Mapping[float, int] | None = None,
    delta: float,
) -> float:
    """Epsilon at ``delta`` of ``ddg`` events composed (RDP) with Gaussian releases of
    sum 1/z^2 = ``inv_z2`` (RDP alpha/(2 z^2)) and pure releases (epsilon-DP implies
    epsilon^2/2-zCDP)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta!r} is out of range; allowed: (0, 1)")
    key = tuple(sorted(check_event(ev) for ev in events))
    zcdp = inv_z2 / 2.0 + sum(e * e / 2.0 * n for e, n in (pure or {}).items())
    return _ddg_epsilon(key, float(zcdp), float(delta))


@functools.lru_cache(maxsize=1024)
def _ddg_epsilon(
    events: tuple[tuple[float, float, float, int, int], ...], zcdp: float, delta: float
) -> float:
    orders = np.asarray(DDG_ORDERS)
    rdp = zcdp * orders
    for l2, l1, sigma, n, d in events:
        rdp = rdp + ddg_rdp(orders, l2=l2, l1=l1, sigma=sigma, clients=n, dim=d)
    eps, _ = compute_epsilon(orders, rdp, delta)
    return float(eps)


def calibrate_ddg(
    epsilon: float, delta: float, releases: int, *, l2: float, l1: float, clients: int, dim: int
) -> float:
    """Smallest per-client sigma (integer units, relative 1e-4, rounded up) such that
    ``releases`` sums of ``clients`` honest shares are (epsilon, delta)-DP for a shift of
    norms (``l2``, ``l1``) in ``dim`` coordinates."""

    def spent(sigma: float) -> float:
        event = {"l2": l2, "l1": l1, "sigma": sigma, "clients": clients, "dim": dim}
        return ddg_epsilon([{"kind": "ddg", **event}] * releases, delta=delta)

    if spent(SIGMA_MIN) <= epsilon:
        return SIGMA_MIN  # the smallest admissible sigma meets the budget (more noise than needed)
    lo, hi = SIGMA_MIN, max(SIGMA_MIN, l2 / math.sqrt(clients))
    while spent(hi) > epsilon:
        lo, hi = hi, hi * 2.0
        if hi > 1e15:
            raise RuntimeError(f"could not calibrate the ddg noise to epsilon={epsilon}")
    return geometric_bisection(spent, epsilon, lo, hi, 1e-4)


def geometric_bisection(
    spent: Callable[[float], float], epsilon: float, lo: float, hi: float, rel_tol: float
) -> float:
    """The smallest noise (up to ``rel_tol`` relative, the upper end: the safe side) in
    [lo, hi] whose ``spent`` is at most ``epsilon``, for ``spent(lo) > epsilon >= spent(hi)``
    and ``spent`` decreasing."""
    while hi / lo - 1.0 > rel_tol:
        mid = math.sqrt(lo * hi)
        if spent(mid) > epsilon:
            lo = mid
        else:
            hi = mid
    return hi


def rounding_norm_bound(scale: float, dim: int, beta: float) -> float:
    """The L2 bound conditional randomized rounding enforces on one example scaled to norm
    <= ``scale`` in ``dim`` coordinates (Kairouz et al. 2021, Sec. 4.1): the smaller of the
    deterministic ``scale + sqrt(d)`` and ``sqrt(scale^2 + d/4 + sqrt(2 ln(1/beta)) (scale +
    sqrt(d)/2))``, which plain rounding exceeds with probability at most ``beta`` (the
    conditional rounding then draws again, so the bound always holds)."""
    det = scale + math.sqrt(dim)
    if not 0 < beta < 1:
        return det
    prob = (
        scale * scale
        + dim / 4.0
        + math.sqrt(2.0 * math.log(1.0 / beta)) * (scale + math.sqrt(dim) / 2.0)
    )
    return min(det, math.sqrt(prob))


def wrap_probability(
    *, bits: int, examples: int, example_bound: float, sigma: float, clients: int, coords: int
) -> float:
    """Upper bound on the probability that any of ``coords`` coordinates of the sum leaves the
    centred range (-2^(bits-1), 2^(bits-1)) and wraps: the data part is at most ``examples``
    times the per-example L2 bound (no wrap by itself), the noise a sum of ``clients``
    sigma-subgaussian draws (the discrete Gaussian is subgaussian, Canonne et al. 2020), so
    P(|noise| >= t) <= 2 exp(-t^2 / (2 n sigma^2)), union over coordinates."""
    slack = 2.0 ** (bits - 1) - 1.0 - examples * example_bound
    if slack <= 0:
        return 1.0
    exponent = -(slack * slack) / (2.0 * clients * sigma * sigma)
    return float(min(1.0, 2.0 * coords * math.exp(max(exponent, -745.0))))


__all__ = [
    "DDG_ORDERS",
    "calibrate_ddg",
    "check_event",
    "ddg_epsilon",
    "ddg_rdp",
    "ddg_tau",
    "geometric_bisection",
    "rounding_norm_bound",
    "wrap_probability",
]
