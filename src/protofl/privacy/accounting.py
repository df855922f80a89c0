"""Noise calibration and privacy accounting for prototype releases (on Google dp-accounting).

Conventions
-----------
* A *noise multiplier* ``z`` means Gaussian noise of standard deviation ``z * Delta`` on a query of
  L2 sensitivity ``Delta``; every Gaussian here is therefore a sensitivity-1 Gaussian of std ``z``.
* ``rounds`` releases happen with full participation (no client sampling).  One example of a
  client touches only its own class (or cluster) prototype, so the per-class releases of one round
  compose in parallel: one round is one Gaussian event.
* Accountants: ``pld`` (tight: the exact analytic Gaussian of Balle & Wang 2018 where it applies,
  a pessimistic privacy-loss distribution otherwise), ``rdp`` (dp-accounting's RDP accountant) and
  ``rdp-classic`` (the VPDR reference code's conversion, for reproduction only).
* Every calibration rounds in the safe direction: bisections return the upper end (more noise).

Ledger events (JSON-safe dicts, see :func:`epsilon_spent`)::

    {"kind": "gaussian", "noise_multiplier": z}   # one Gaussian release, sensitivity-normalised
    {"kind": "pure", "epsilon": e0}               # one pure e0-DP release (VPP top-k selection)
    {"kind": "poisson_gaussian", "noise_multiplier": z, "sample_rate": q}
        # one Gaussian release of a Poisson subsample (each example kept with probability q,
        # secretly); add/remove neighbouring only (amplification by subsampling)
    {"kind": "ddg", "l2": l2, "l1": l1, "sigma": s, "clients": n, "dim": d}
        # one secure sum of n honest discrete Gaussian shares (protofl.privacy.ddg_accounting):
        # composed in RDP with everything else in the list

Subsampled events are composed as privacy-loss distributions (dp-accounting's subsampled
Gaussian PLD, pessimistic) or by dp-accounting's RDP accountant; the closed forms above apply
to the others.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import dp_accounting
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import RdpAccountant
from scipy.optimize import brentq
from scipy.special import log_ndtr

from protofl.privacy.config import VPP_VARIANTS
from protofl.privacy.ddg_accounting import check_event as check_ddg_event
from protofl.privacy.ddg_accounting import ddg_epsilon, geometric_bisection

ACCOUNTANTS = ("pld", "rdp", "rdp-classic")
SPLITS = ("joint", "paper")

PLD_DISCRETIZATION = 1e-3
"""Base value-discretisation interval of the PLDs built here (pessimistic: only ever loose).
It is widened for strong Gaussians (speed) and shrunk so that the smallest pure epsilon is an
exact multiple of it (no rounding up of tiny selection budgets), see :func:`pld_interval`."""

_REL_TOL = 1e-4  # relative tolerance of the joint bisection on sigma
_SIGMA_MAX = 1e7
_PURE_PLD_MAX = 50.0  # pure epsilons above this are composed by basic composition

# The reference code's alpha grid: 1.1..10.9 (step 0.1), 11..63, 128, 256, 512.
CLASSIC_ORDERS: tuple[float, ...] = tuple(
    [1.0 + i / 10.0 for i in range(1, 100)]
    + [float(a) for a in range(11, 64)]
    + [128.0, 256.0, 512.0]
)


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------
def _fail(name: str, value: object, allowed: str) -> None:
    raise ValueError(f"{name}={value!r} is out of range; allowed: {allowed}")


def check_budget(epsilon: float, delta: float, rounds: int = 1) -> None:
    """Raise ValueError naming the parameter when (epsilon, delta, rounds) is not a valid budget."""
    if not (isinstance(epsilon, int | float) and epsilon > 0 and math.isfinite(epsilon)):
        _fail("epsilon", epsilon, "(0, inf)")
    if not (isinstance(delta, int | float) and 0 < delta < 1):
        _fail("delta", delta, "(0, 1)")
    if isinstance(rounds, bool) or not isinstance(rounds, numbers.Integral) or rounds < 1:
        _fail("rounds", rounds, "integers >= 1")


def check_accountant(accountant: str) -> None:
    """Raise ValueError unless ``accountant`` is one of :data:`ACCOUNTANTS`."""
    if accountant not in ACCOUNTANTS:
        _fail("accountant", accountant, ", ".join(ACCOUNTANTS))


# --------------------------------------------------------------------------------------------
# the analytic Gaussian mechanism (Balle & Wang 2018, Theorem 8)
# --------------------------------------------------------------------------------------------
def gaussian_log_delta(sigma: float, epsilon: float) -> float:
    """log delta(epsilon) of one Gaussian mechanism with sensitivity 1 and noise std ``sigma``.

    delta(eps) = Phi(1/(2s) - eps*s) - e^eps * Phi(-1/(2s) - eps*s)  (exact, tight).
    """
    a = 0.5 / sigma - epsilon * sigma
    b = -0.5 / sigma - epsilon * sigma
    la = float(log_ndtr(a))
    lb = float(epsilon + log_ndtr(b))
    if lb >= la:
        return -math.inf
    return la + math.log1p(-math.exp(lb - la))


def gaussian_epsilon(sigma: float, delta: float) -> float:
    """Smallest epsilon (rounded up) at which one sensitivity-1 Gaussian of std ``sigma`` is DP."""
    log_delta = math.log(delta)
    if gaussian_log_delta(sigma, 0.0) <= log_delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while gaussian_log_delta(sigma, hi) > log_delta:
        lo, hi = hi, hi * 2.0
    while hi - lo > 1e-13 * hi:
        mid = 0.5 * (lo + hi)
        if gaussian_log_delta(sigma, mid) > log_delta:
            lo = mid
        else:
            hi = mid
    return hi


def gaussian_sigma(epsilon: float, delta: float) -> float:
    """Smallest std (rounded up) making one sensitivity-1 Gaussian (epsilon, delta)-DP."""
    log_delta = math.log(delta)
    lo, hi = 1e-3, 1.0
    while gaussian_log_delta(hi, epsilon) > log_delta:
        lo, hi = hi, hi * 2.0
    while gaussian_log_delta(lo, epsilon) <= log_delta:
        lo = lo / 2.0
    while hi / lo - 1.0 > 1e-12:
        mid = math.sqrt(lo * hi)
        if gaussian_log_delta(mid, epsilon) > log_delta:
            lo = mid
        else:
            hi = mid
    return hi


# --------------------------------------------------------------------------------------------
# composition of a ledger: T Gaussians + pure-DP selections
# --------------------------------------------------------------------------------------------
def _classic_epsilon(inv_z2: float, pure: Mapping[float, int], delta: float) -> float:
    """The reference code's RDP -> DP conversion over its alpha grid (loose; reproduction only).

    RDP(alpha) = alpha * sum_i 1/(2 z_i^2) + sum_j min(e_j, alpha e_j^2 / 2)  (Gaussian; pure DP
    via zCDP, Bun & Steinke 2016), eps = min_alpha RDP(alpha) + ln(1/delta)/(alpha - 1).
    """
    log_inv_delta = math.log(1.0 / delta)
    best = math.inf
    for alpha in CLASSIC_ORDERS:
        rdp = alpha * inv_z2 / 2.0
        rdp += sum(n * min(e, alpha * e * e / 2.0) for e, n in pure.items())
        best = min(best, rdp + log_inv_delta / (alpha - 1.0))
    return best


def _rdp_epsilon(inv_z2: float, pure: Mapping[float, int], delta: float) -> float:
    """dp-accounting RDP: one Gaussian of effective multiplier plus pure DP as zCDP(e^2/2)."""
    acc = RdpAccountant()
    if inv_z2 > 0:
        acc.compose(dp_accounting.GaussianDpEvent(1.0 / math.sqrt(inv_z2)))
    for e, n in pure.items():
        if e > 0:
            acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.ZCDpEvent(e * e / 2.0), n))
    return float(acc.get_epsilon(delta))


def pld_interval(inv_z2: float, items: tuple[tuple[float, int], ...]) -> float:
    """The PLD discretisation for a composition: PLD_DISCRETIZATION, widened for strong
    Gaussians (the loss range grows like sqrt(inv_z2); 2e-3*sqrt(inv_z2) keeps the bin count
    bounded, i.e. fast), then shrunk so that the smallest pure epsilon is an exact multiple (its
    +-epsilon losses are not rounded).  Depends only on the composition, so calibration and the
    ledger agree."""
    v = PLD_DISCRETIZATION
    if inv_z2 > 0:
        v = max(v, 2e-3 * math.sqrt(inv_z2))
    if items:
        e_min = min(e for e, _ in items)
        m = max(1, math.ceil(e_min / v - 1e-9))
        v = e_min / m
        for _ in range(8):  # make e_min / v == m exactly in floating point
            q = e_min / v
            if q > m:
                v = math.nextafter(v, math.inf)
            elif q < m:
                v = math.nextafter(v, 0.0)
            else:
                break
    return v


@functools.lru_cache(maxsize=64)
def _pure_pld(items: tuple[tuple[float, int], ...], interval: float) -> Any:
    """Pessimistic PLD of a sequence of generic pure-DP mechanisms (cached; it is reused)."""
    out = None
    for e, n in items:
        if e <= 0:
            continue
        p = pld_lib.from_privacy_parameters(
            pld_common.DifferentialPrivacyParameters(e, 0.0),
            value_discretization_interval=interval,
        ).self_compose(n)
        out = p if out is None else out.compose(p)
    return out


def _pld_epsilon(inv_z2: float, pure: Mapping[float, int], delta: float) -> float:
    """Tight composition.  Gaussians alone: exact analytic form (T Gaussians of multipliers z_i
    are one Gaussian of multiplier (sum 1/z_i^2)^-1/2).  With pure-DP selections: pessimistic PLD,
    each selection as a generic e-DP mechanism (valid for any e-DP top-k, not only Laplace)."""
    items = tuple(sorted((e, n) for e, n in pure.items() if e > 0))
    if not items:
        return gaussian_epsilon(1.0 / math.sqrt(inv_z2), delta) if inv_z2 > 0 else 0.0
    if max(e for e, _ in items) > _PURE_PLD_MAX:
        return math.inf  # PLD would overflow; compose_epsilon falls back to basic composition
    interval = pld_interval(inv_z2, items)
    p = _pure_pld(items, interval)
    if inv_z2 > 0:
        g = pld_lib.from_gaussian_mechanism(
            standard_deviation=1.0 / math.sqrt(inv_z2),
            pessimistic_estimate=True,
            value_discretization_interval=interval,
        )
        p = p.compose(g)
    return float(p.get_epsilon_for_delta(delta))


def compose_epsilon(
    inv_z2: float, pure: Mapping[float, int], *, delta: float, accountant: str = "pld"
) -> float:
    """Epsilon at ``delta`` of Gaussian releases with sum_i 1/z_i^2 = ``inv_z2`` composed with
    ``pure[e]`` pure e-DP releases.  The result is also capped by basic composition
    (sum of pure epsilons + epsilon of the Gaussians alone), which is always valid."""
    check_accountant(accountant)
    if not 0 < delta < 1:
        _fail("delta", delta, "(0, 1)")
    items = tuple(sorted((float(e), int(n)) for e, n in pure.items() if e > 0 and n > 0))
    return _compose(float(inv_z2), items, float(delta), accountant)


@functools.lru_cache(maxsize=4096)
def _compose(inv_z2: float, items: tuple[tuple[float, int], ...], delta: float, acc: str) -> float:
    """:func:`compose_epsilon` of validated arguments, kept for repeated questions: clients
    whose ledgers hold the same events (every client of a round with full participation, asked
    once each by the Flower engine) compose once."""
    fn = {"pld": _pld_epsilon, "rdp": _rdp_epsilon, "rdp-classic": _classic_epsilon}[acc]
    pure = dict(items)
    eps = fn(inv_z2, pure, delta)
    if pure:
        basic = sum(e * n for e, n in pure.items()) + (fn(inv_z2, {}, delta) if inv_z2 > 0 else 0)
        eps = min(eps, basic)
    return float(eps)


def summarise_events(events: Iterable[Mapping[str, Any]]) -> tuple[float, dict[float, int]]:
    """(sum of 1/z^2 over Gaussian events, {epsilon: count} of pure events); validates events.
    Subsampled events have no such summary: :func:`split_events` gives them too."""
    events = list(events)
    inv_z2, pure, sampled = split_events(events)
    if any(ev.get("kind") == "ddg" for ev in events):
        raise ValueError("ddg events have no Gaussian summary; compose them with epsilon_spent")
    if sampled:
        raise ValueError(
            "poisson_gaussian events (privacy.sample_rate < 1) have no Gaussian summary; "
            "compose them with epsilon_spent"
        )
    return inv_z2, pure


def split_events(
    events: Iterable[Mapping[str, Any]],
) -> tuple[float, dict[float, int], dict[tuple[float, float], int]]:
    """(sum of 1/z^2 over Gaussian events, {epsilon: count} of pure events,
    {(z, q): count} of subsampled Gaussian events); validates every event."""
    inv_z2 = 0.0
    pure: Counter[float] = Counter()
    sampled: Counter[tuple[float, float]] = Counter()
    for ev in events:
        kind = ev.get("kind")
        if kind == "gaussian":
            z = float(ev["noise_multiplier"])
            if not z > 0:
                raise ValueError(f"gaussian event with noise_multiplier={z!r}; must be > 0")
            inv_z2 += 1.0 / (z * z)
        elif kind == "pure":
            e = float(ev["epsilon"])
            if not e >= 0:
                raise ValueError(f"pure event with epsilon={e!r}; must be >= 0")
            pure[e] += 1
        elif kind == "poisson_gaussian":
            z, q = float(ev["noise_multiplier"]), float(ev["sample_rate"])
            if not z > 0:
                raise ValueError(f"poisson_gaussian event with noise_multiplier={z!r}; must be > 0")
            if not 0 < q <= 1:
                raise ValueError(
                    f"poisson_gaussian event with sample_rate={q!r}; must be in (0, 1]"
                )
            if q == 1.0:
                inv_z2 += 1.0 / (z * z)
            else:
                sampled[(z, q)] += 1
        elif kind == "ddg":
            check_ddg_event(ev)  # composed by epsilon_spent (RDP, Proposition 14)
        else:
            raise ValueError(
                f"unknown privacy event kind {kind!r}; expected 'gaussian', 'pure', "
                "'poisson_gaussian' or 'ddg'"
            )
    return inv_z2, dict(pure), dict(sampled)


def epsilon_spent(
    events: Iterable[Mapping[str, Any]], *, delta: float, accountant: str = "pld"
) -> float:
    """Epsilon at ``delta`` of everything in ``events`` (all releases of ONE client), composed.

    ``{"kind": "gaussian", "noise_multiplier": z}`` is a Gaussian release with std z times its
    L2 sensitivity; ``{"kind": "pure", "epsilon": e}`` a pure e-DP release.
    """
    events = list(events)
    inv_z2, pure, sampled = split_events(events)
    ddg = [ev for ev in events if ev.get("kind") == "ddg"]
    if ddg:
        if sampled:
            raise ValueError("ddg events do not compose with subsampled (poisson_gaussian) ones")
        # the distributed discrete Gaussian has an RDP bound only: everything composes in RDP
        return ddg_epsilon(ddg, inv_z2=inv_z2, pure=pure, delta=delta)
    if sampled:
        return sampled_epsilon(inv_z2, pure, sampled, delta=delta, accountant=accountant)
    if inv_z2 == 0 and not pure:
        return 0.0
    return compose_epsilon(inv_z2, pure, delta=delta, accountant=accountant)


# --------------------------------------------------------------------------------------------
# Poisson-subsampled Gaussian releases (add/remove neighbouring)
# --------------------------------------------------------------------------------------------
SAMPLED_PLD_INTERVAL = 1e-3
"""PLD discretisation of compositions holding subsampled releases (pessimistic; one value, so
calibration and every ledger agree)."""


SAMPLED_SIGMA_MIN = 0.25
"""The smallest multiplier a subsampled release is calibrated to: below it the privacy-loss
distribution grows like 1/z^2 bins (gigabytes at 0.01).  A budget that would allow less noise
(epsilon in the tens) gets this multiplier: more noise than needed, never less."""


def sampled_pld(
    inv_z2: float,
    pure: Mapping[float, int],
    sampled: Mapping[tuple[float, float], int],
    *,
    interval: float = SAMPLED_PLD_INTERVAL,
) -> Any:
    """The pessimistic privacy-loss distribution (add/remove) of subsampled Gaussian releases
    ``sampled`` ({(z, q): count}), composed with full-sample Gaussians (sum 1/z^2 = ``inv_z2``)
    and pure-DP releases ``pure``."""
    out: Any = None
    for (z, q), n in sorted(sampled.items()):
        p = pld_lib.from_gaussian_mechanism(
            standard_deviation=z,
            sampling_prob=q,
            pessimistic_estimate=True,
            value_discretization_interval=interval,
        ).self_compose(n)
        out = p if out is None else out.compose(p)
    if inv_z2 > 0:
        g = pld_lib.from_gaussian_mechanism(
            standard_deviation=1.0 / math.sqrt(inv_z2),
            pessimistic_estimate=True,
            value_discretization_interval=interval,
        )
        out = g if out is None else out.compose(g)
    items = tuple(sorted((float(e), int(n)) for e, n in pure.items() if e > 0 and n > 0))
    if items:
        p = _pure_pld(items, interval)
        out = p if out is None else out.compose(p)
    return out


def sampled_epsilon(
    inv_z2: float,
    pure: Mapping[float, int],
    sampled: Mapping[tuple[float, float], int],
    *,
    delta: float,
    accountant: str = "pld",
) -> float:
    """Epsilon at ``delta`` (add/remove) of a composition holding Poisson-subsampled Gaussian
    releases: ``pld`` a pessimistic PLD (:func:`sampled_pld`), ``rdp`` dp-accounting's RDP
    accountant (``PoissonSampledDpEvent``).  ``rdp-classic`` has no subsampled form."""
    check_accountant(accountant)
    if not 0 < delta < 1:
        _fail("delta", delta, "(0, 1)")
    key = (
        float(inv_z2),
        tuple(sorted((float(e), int(n)) for e, n in pure.items() if e > 0 and n > 0)),
        tuple(sorted((float(z), float(q), int(n)) for (z, q), n in sampled.items() if n > 0)),
    )
    return _sampled_epsilon(*key, float(delta), accountant)


@functools.lru_cache(maxsize=1024)
def _sampled_epsilon(
    inv_z2: float,
    items: tuple[tuple[float, int], ...],
    sampled: tuple[tuple[float, float, int], ...],
    delta: float,
    accountant: str,
) -> float:
    groups = {(z, q): n for z, q, n in sampled}
    if accountant == "pld":
        return float(sampled_pld(inv_z2, dict(items), groups).get_epsilon_for_delta(delta))
    if accountant == "rdp":
        absl = logging.getLogger("absl")  # its fractional-order series warns and drops orders
        level = absl.level
        absl.setLevel(logging.ERROR)
        try:
            return _sampled_rdp(inv_z2, items, groups, delta)
        finally:
            absl.setLevel(level)
    raise ValueError(
        "accountant='rdp-classic' cannot compose Poisson-subsampled releases "
        "(privacy.sample_rate < 1); use pld or rdp"
    )


def _sampled_rdp(
    inv_z2: float,
    items: tuple[tuple[float, int], ...],
    groups: Mapping[tuple[float, float], int],
    delta: float,
) -> float:
    """dp-accounting's RDP accountant over subsampled and full Gaussians and pure releases."""
    acc = RdpAccountant()
    for (z, q), n in groups.items():
        event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
        acc.compose(dp_accounting.SelfComposedDpEvent(event, n))
    if inv_z2 > 0:
        acc.compose(dp_accounting.GaussianDpEvent(1.0 / math.sqrt(inv_z2)))
    for e, n in items:
        acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.ZCDpEvent(e * e / 2.0), n))
    return float(acc.get_epsilon(delta))


def calibrate_sampled(
    epsilon: float, delta: float, rounds: int, sample_rate: float, accountant: str = "pld"
) -> float:
    """Smallest noise multiplier z (up to a relative 1e-4, rounded up) such that ``rounds``
    Gaussian releases of Poisson subsamples at rate ``sample_rate`` are (epsilon, delta)-DP
    under add/remove.  The full-sample multiplier is a valid upper bound (subsampling never
    costs privacy under add/remove); geometric bisection below it; cached."""
    check_budget(epsilon, delta, rounds)
    check_accountant(accountant)
    if not (isinstance(sample_rate, int | float) and 0 < sample_rate <= 1):
        _fail("sample_rate", sample_rate, "(0, 1]")
    if sample_rate == 1:
        return calibrate_gaussian(epsilon, delta, rounds, accountant)
    return _calibrate_sampled(
        float(epsilon), float(delta), int(rounds), float(sample_rate), accountant
    )


@functools.lru_cache(maxsize=256)
def _calibrate_sampled(
    epsilon: float, delta: float, rounds: int, q: float, accountant: str
) -> float:
    def spent(z: float) -> float:
        return sampled_epsilon(0.0, {}, {(z, q): rounds}, delta=delta, accountant=accountant)

    if spent(SAMPLED_SIGMA_MIN) <= epsilon:
        return SAMPLED_SIGMA_MIN  # more noise than the budget needs: the safe side
    hi = calibrate_gaussian(epsilon, delta, rounds, "rdp" if accountant == "rdp" else "pld")
    hi = max(hi, SAMPLED_SIGMA_MIN)
    while spent(hi) > epsilon:  # a discretisation hair above: step up (never below target)
        hi *= 1.01
        if hi > _SIGMA_MAX:
            raise RuntimeError(f"could not calibrate sigma to epsilon={epsilon}")
    lo = max(hi / 2.0, SAMPLED_SIGMA_MIN)
    while spent(lo) <= epsilon:
        hi, lo = lo, max(lo / 2.0, SAMPLED_SIGMA_MIN)
    return geometric_bisection(spent, epsilon, lo, hi, _REL_TOL)


# --------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------
def _classic_sigma(epsilon: float, delta: float, rounds: int) -> float:
    """The reference code's bisection: sigma in [1e-3, 1e4], tol 1e-3, upper end returned."""
    lo, hi = 1e-3, 1e4
    while hi - lo > 1e-3:
        mid = 0.5 * (lo + hi)
        if _classic_epsilon(rounds / (mid * mid), {}, delta) > epsilon:
            lo = mid
        else:
            hi = mid
    return hi


def calibrate_gaussian(epsilon: float, delta: float, rounds: int, accountant: str = "pld") -> float:
    """Noise multiplier for ``rounds`` full-participation Gaussian releases of sensitivity 1 that
    together are (epsilon, delta)-DP.

    pld: exact.  T Gaussians of std s compose to one Gaussian of std s/sqrt(T), so
    sigma = sqrt(T) * analytic_sigma(epsilon, delta) (Balle & Wang 2018), rounded up.
    rdp: dp-accounting RdpAccountant through ``calibrate_dp_mechanism`` (never below target).
    rdp-classic: the VPDR reference code (21.92 at epsilon=1, delta=1e-5, T=20).
    """
    check_budget(epsilon, delta, rounds)
    check_accountant(accountant)
    if accountant == "pld":
        return gaussian_sigma(epsilon, delta) * math.sqrt(rounds) * (1.0 + 1e-10)
    if accountant == "rdp":
        sigma = float(
            dp_accounting.calibrate_dp_mechanism(
                make_fresh_accountant=RdpAccountant,
                make_event_from_param=lambda s: dp_accounting.SelfComposedDpEvent(
                    dp_accounting.GaussianDpEvent(s), rounds
                ),
                target_epsilon=epsilon,
                target_delta=delta,
                bracket_interval=dp_accounting.LowerEndpointAndGuess(1e-3, 1.0),
                tol=1e-6,
            )
        )
        events = [{"kind": "gaussian", "noise_multiplier": sigma}]
        return _round_up_until(
            sigma,
            lambda z: epsilon_spent(
                [{**events[0], "noise_multiplier": z}] * rounds, delta=delta, accountant="rdp"
            ),
            epsilon,
        )
    return _classic_sigma(epsilon, delta, rounds)


def _round_up_until(sigma: float, spent: Callable[[float], float], epsilon: float) -> float:
    """Raise ``sigma`` by a growing relative step until ``spent(sigma) <= epsilon``.

    A bisection can land a float-rounding hair above the target (seen: 0.10000000000000002 for
    0.1); a claim is never allowed to exceed the budget, so the result is pushed to the safe side.
    """
    step = 1e-12
    while spent(sigma) > epsilon:
        sigma *= 1.0 + step
        step *= 10.0
        if step > 1.0:
            raise RuntimeError(f"could not calibrate sigma to epsilon={epsilon}")
    return sigma


def calibrate_joint(
    epsilon: float,
    delta: float,
    rounds: int,
    pure: Mapping[float, int],
    accountant: str = "pld",
) -> float:
    """Smallest multiplier sigma (up to a relative 1e-4, rounded up) such that ``rounds`` Gaussian
    releases of multiplier sigma composed with the pure-DP releases ``pure`` ({e: count}) are
    (epsilon, delta)-DP under ``accountant``.  Bisection between the Gaussian-alone sigma (a lower
    bound) and the basic-composition sigma (a valid upper bound); results are cached."""
    check_budget(epsilon, delta, rounds)
    check_accountant(accountant)
    items = tuple(sorted((float(e), int(n)) for e, n in pure.items() if e > 0 and n > 0))
    return _calibrate_joint(float(epsilon), float(delta), int(rounds), items, accountant)


@functools.lru_cache(maxsize=256)
def _calibrate_joint(
    epsilon: float, delta: float, rounds: int, items: tuple[tuple[float, int], ...], accountant: str
) -> float:
    pure = dict(items)
    pure_total = sum(e * n for e, n in items)
    if not pure_total < epsilon:
        raise ValueError(
            f"the pure-DP releases alone spend epsilon={pure_total:.4g} >= epsilon={epsilon:.4g}"
        )
    if pure_total == 0:
        return calibrate_gaussian(epsilon, delta, rounds, accountant)

    def spent(s: float) -> float:
        return compose_epsilon(rounds / (s * s), pure, delta=delta, accountant=accountant)

    lo = calibrate_gaussian(epsilon, delta, rounds, accountant) * (1.0 - 1e-9)
    hi = calibrate_gaussian(epsilon - pure_total, delta, rounds, accountant)
    while spent(hi) > epsilon:  # cannot happen (basic composition caps spent), kept as a guard
        lo, hi = hi, hi * 1.05
        if hi > _SIGMA_MAX:
            raise RuntimeError("joint calibration failed to bracket sigma")
    # Brent on the (monotone, slightly stepped) gap, then step up until the gap is <= 0.
    xtol = _REL_TOL * lo
    root = float(brentq(lambda s: spent(s) - epsilon, lo, hi, xtol=xtol))
    while spent(root) > epsilon:
        root = min(root + xtol, hi)
        if root == hi:
            break
    return root


@dataclass(frozen=True)
class VppBudget:
    """VPP's calibration: selection budget, Laplace scale, partition sizes and group noise.

    ``rel_std_A``/``rel_std_B``: per-dimension noise std in group A/B relative to IGPP's at the
    same (epsilon, delta, T): sigma_A*kappa_A/sigma_iso and sigma_B*kappa_B/sigma_iso.
    """

    epsilon: float
    delta: float
    rounds: int
    accountant: str
    split: str
    variant: str
    ratio: float
    rho: float
    dim: int
    score_max: float
    k: int
    d_B: int
    kappa_A: float
    kappa_B: float
    w_A: float
    w_B: float
    eps_select_total: float
    selections: int
    eps_select: float
    laplace_scale: float
    eps_release: float | None
    sigma_ref: float
    sigma_A: float
    sigma_B: float
    sigma_iso: float
    rel_std_A: float
    rel_std_B: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe dict (an infinite Laplace scale becomes None)."""
        out = asdict(self)
        if not math.isfinite(out["laplace_scale"]):
            out["laplace_scale"] = None
        return out


def check_vpp(ratio: float, rho: float, dim: int, score_max: float) -> None:
    """Raise ValueError naming the parameter for out-of-range VPP parameters."""
    if not 0 < ratio < 1:
        _fail("ratio", ratio, "(0, 1)")
    if not 0 < rho <= 0.5:
        _fail("rho", rho, "(0, 0.5]")
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 2:
        _fail("dim", dim, "integers >= 2")
    if not (score_max > 0 and math.isfinite(score_max)):
        _fail("score_max", score_max, "(0, inf)")


def vpp_weights(rho: float, dim: int) -> tuple[int, float, float, float, float]:
    """(k = d_A, kappa_A, kappa_B, w_A, w_B).  VPDR Eq. (10) and Eq. (13)."""
    k = min(max(math.ceil(rho * dim - 1e-9), 1), dim - 1)
    kappa_a = math.sqrt(k / dim)
    kappa_b = math.sqrt((dim - k) / dim)
    w_a = kappa_b / (kappa_a + kappa_b)  # VPDR Eq. (13)
    return k, kappa_a, kappa_b, w_a, 1.0 - w_a


def group_multipliers(sigma_ref: float, w_a: float) -> tuple[float, float]:
    """sigma_A = sigma_ref/sqrt(w_A), sigma_B = sigma_ref/sqrt(w_B) (VPDR Eq. (12)), nudged up so
    that 1/sigma_A^2 + 1/sigma_B^2 <= 1/sigma_ref^2 (Eq. (19)) holds in floating point."""
    s_a = sigma_ref / math.sqrt(w_a)
    s_b = sigma_ref / math.sqrt(1.0 - w_a)
    while 1.0 / s_a**2 + 1.0 / s_b**2 > 1.0 / sigma_ref**2:
        s_a *= 1.0 + 1e-12
        s_b *= 1.0 + 1e-12
    return s_a, s_b


def calibrate_vpp(
    epsilon: float,
    delta: float,
    rounds: int,
    *,
    ratio: float = 0.1,
    rho: float = 0.2,
    dim: int = 512,
    score_max: float = 0.1,
    split: str = "joint",
    accountant: str = "pld",
    variant: str = "paper",
) -> VppBudget:
    """VPP's budget for ``rounds`` releases meeting (epsilon, delta) in total.

    split="paper": epsilon1 = r*epsilon pure DP for the selections (Theorem 4.1, Laplace scale
    lambda = 2*d_A*H*T/epsilon1, Eq. (9)); sigma_ref calibrated to (epsilon2=(1-r)*epsilon, delta)
    (Theorem 4.2); total by basic composition.
    split="joint": the same Laplace scale, but the T pure (epsilon1/T)-DP selections and the T
    Gaussian releases (effective multiplier sigma_ref, Eq. (19)) are composed in one PLD (or RDP)
    and sigma_ref is the smallest meeting the total (epsilon, delta).
    variant "once"/"normalized_once": one selection per run charged epsilon1
    (lambda = 2*d_A*H/epsilon1); "history": no private selection, the whole budget is Gaussian.
    """
    check_budget(epsilon, delta, rounds)
    check_accountant(accountant)
    check_vpp(ratio, rho, dim, score_max)
    if split not in SPLITS:
        _fail("split", split, ", ".join(SPLITS))
    if variant not in VPP_VARIANTS:
        _fail("variant", variant, ", ".join(VPP_VARIANTS))
    k, kappa_a, kappa_b, w_a, w_b = vpp_weights(rho, dim)
    sigma_iso = calibrate_gaussian(epsilon, delta, rounds, accountant)
    if variant == "history":
        eps1, selections, eps0, lam = 0.0, 0, 0.0, math.inf
    else:
        eps1 = ratio * epsilon
        selections = 1 if variant in ("once", "normalized_once") else rounds
        eps0 = eps1 / selections
        lam = 2.0 * k * score_max / eps0  # VPDR Eq. (9) / Theorem 4.1: 2 d_A H T / eps1
    eps_release: float | None
    if selections == 0:
        sigma_ref, eps_release = sigma_iso, epsilon
    elif split == "paper":
        eps_release = (1.0 - ratio) * epsilon
        sigma_ref = calibrate_gaussian(eps_release, delta, rounds, accountant)
    else:
        eps_release = None
        sigma_ref = calibrate_joint(epsilon, delta, rounds, {eps0: selections}, accountant)
    sigma_a, sigma_b = group_multipliers(sigma_ref, w_a)
    return VppBudget(
        epsilon=float(epsilon),
        delta=float(delta),
        rounds=rounds,
        accountant=accountant,
        split=split,
        variant=variant,
        ratio=float(ratio),
        rho=float(rho),
        dim=dim,
        score_max=float(score_max),
        k=k,
        d_B=dim - k,
        kappa_A=kappa_a,
        kappa_B=kappa_b,
        w_A=w_a,
        w_B=w_b,
        eps_select_total=eps1,
        selections=selections,
        eps_select=eps0,
        laplace_scale=lam,
        eps_release=eps_release,
        sigma_ref=sigma_ref,
        sigma_A=sigma_a,
        sigma_B=sigma_b,
        sigma_iso=sigma_iso,
        rel_std_A=sigma_a * kappa_a / sigma_iso,
        rel_std_B=sigma_b * kappa_b / sigma_iso,
    )
