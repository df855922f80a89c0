"""The audit's verdict, valid for any mechanism (:mod:`protofl.attacks.audit` runs the canaries):
the claim (a privacy profile from DP events, or a point (epsilon, delta)), the balanced test
(a betting martingale on right guesses, Waudby-Smith and Ramdas 2023), the tail test
(Clopper-Pearson bounds on epsilon at delta), the GDP estimate (reported, never deciding) and
the power of a given number of trials."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy.stats import beta, norm

from protofl.privacy.accounting import epsilon_spent, gaussian_epsilon, sampled_pld, split_events

BET_CAP = 0.9
"""Bets are capped at BET_CAP / m, so every factor of the capital stays >= 1 - BET_CAP."""
REFITS = 16
"""The balanced test's rule is refitted this many times, each time on the clients before."""
PLD_INTERVAL = 1e-3


@dataclass(frozen=True)
class Claim:
    """The privacy a run claims, as the audit tests it.

    ``tv`` is the claim's delta at epsilon 0, the largest TPR - FPR any test may reach: a guess
    of a fair coin is right with probability at most ``accuracy_max = (1 + tv) / 2``.
    ``mu`` is set when the claim is exactly mu-GDP (Gaussian events only).
    """

    kind: str
    epsilon: float
    delta: float
    tv: float
    mu: float | None = None

    @property
    def accuracy_max(self) -> float:
        return 0.5 * (1.0 + self.tv)


def claim_from_events(
    events: Sequence[Mapping[str, Any]], delta: float, *, kind: str = "events"
) -> Claim:
    """The privacy profile of ``events`` (one whole run's), composed: epsilon at ``delta`` by
    the PLD accountant; ``tv`` exact for Gaussians alone (mu-GDP: ``2 Phi(mu/2) - 1``), else
    from a pessimistic PLD (an upper bound: only ever lenient to the mechanism)."""
    inv_z2, pure, sampled = split_events(events)
    pure = {e: n for e, n in pure.items() if e > 0}
    eps = epsilon_spent(list(events), delta=delta, accountant="pld")
    if sampled:  # Poisson-subsampled releases: their (add/remove) PLD, pessimistic
        tv = float(
            sampled_pld(inv_z2, pure, sampled, interval=PLD_INTERVAL).get_delta_for_epsilon(0)
        )
        return Claim(kind, float(eps), float(delta), min(tv, 1.0))
    if not pure:
        mu = math.sqrt(inv_z2)
        return Claim(kind, float(eps), float(delta), float(2.0 * norm.cdf(mu / 2.0) - 1.0), mu)
    pld: Any = None
    for e, n in sorted(pure.items()):
        p = pld_lib.from_privacy_parameters(
            pld_common.DifferentialPrivacyParameters(e, 0.0),
            value_discretization_interval=PLD_INTERVAL,
        ).self_compose(n)
        pld = p if pld is None else pld.compose(p)
    if inv_z2 > 0:
        pld = pld.compose(
            pld_lib.from_gaussian_mechanism(
                standard_deviation=1.0 / math.sqrt(inv_z2),
                pessimistic_estimate=True,
                value_discretization_interval=PLD_INTERVAL,
            )
        )
    tv = min(float(pld.get_delta_for_epsilon(0.0)), 1.0)
    return Claim(kind, float(eps), float(delta), tv)


def point_claim(epsilon: float, delta: float) -> Claim:
    """(epsilon, delta)-DP alone: a guess is right with probability at most
    ``(e^eps + delta) / (1 + e^eps)``."""
    tv = (math.exp(epsilon) - 1.0 + 2.0 * delta) / (math.exp(epsilon) + 1.0)
    return Claim("point", float(epsilon), float(delta), tv)


def gdp_mu(epsilon: float, delta: float) -> float:
    """The mu of mu-GDP whose epsilon at ``delta`` is ``epsilon`` (for reports)."""
    lo, hi = 1e-6, 1.0
    while gaussian_epsilon(1.0 / hi, delta) < epsilon:
        hi *= 2.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if gaussian_epsilon(1.0 / mid, delta) < epsilon else (lo, mid)
    return hi


def clopper_pearson(k: np.ndarray, n: int, alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Two-sided (1 - alpha) Clopper-Pearson interval for k successes out of n (vectorised)."""
    k = np.asarray(k, dtype=np.float64)
    lo = np.where(k > 0, beta.ppf(alpha / 2, k, n - k + 1), 0.0)
    hi = np.where(k < n, beta.ppf(1 - alpha / 2, k + 1, n - k), 1.0)
    return np.nan_to_num(lo, nan=0.0), np.nan_to_num(hi, nan=1.0)


def _eps_bounds(
    fp: np.ndarray, fn: np.ndarray, n0: int, n1: int, delta: float, alpha: float = 0.05
) -> np.ndarray:
    """Per threshold: the larger of the two one-sided epsilon lower bounds (>= 0)."""
    _, fpr_hi = clopper_pearson(fp, n0, alpha)
    _, fnr_hi = clopper_pearson(fn, n1, alpha)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.log(np.maximum(1.0 - delta - fnr_hi, 0.0) / fpr_hi)
        b = np.log(np.maximum(1.0 - delta - fpr_hi, 0.0) / fnr_hi)
    best = np.fmax(np.nan_to_num(a, nan=-np.inf), np.nan_to_num(b, nan=-np.inf))
    return np.maximum(best, 0.0)


def _counts(t0: np.ndarray, t1: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, ...]:
    """Test "guess D when T > t": false positives (D' above t), false negatives (D at or
    below t)."""
    s0, s1 = np.sort(t0), np.sort(t1)
    fp = len(s0) - np.searchsorted(s0, thresholds, side="right")
    fn = np.searchsorted(s1, thresholds, side="right")
    return fp, fn


def _candidates(values: np.ndarray, most: int = 4000) -> np.ndarray:
    """Candidate thresholds: every observed value, or when there are more than ``most``, the
    values at ranks spaced geometrically from both ends (dense in the tails, where the tail
    test's thresholds lie)."""
    v = np.unique(values)
    if len(v) <= most:
        return v
    half = np.unique(np.geomspace(1, len(v), most // 2).astype(np.int64)) - 1
    return v[np.unique(np.concatenate([half, len(v) - 1 - half]))]


def epsilon_lower_bound(
    stat_d: np.ndarray,
    stat_dprime: np.ndarray,
    delta: float,
    *,
    alpha: float = 0.05,
    selection_alpha: float = 1e-3,
) -> dict[str, float]:
    """Model-free (1 - alpha) lower bound on epsilon at ``delta`` from independent statistics
    under D (``stat_d``) and D' (``stat_dprime``).

    First halves pick the threshold (candidates: the observed values, at most about 4,000 of
    them, see :func:`_candidates`): the one whose
    bound is largest with the stricter ``selection_alpha`` intervals, which keeps the choice away
    from far-tail thresholds that look good only by luck (winner's curse).  Second halves bound
    FPR and FNR at that threshold with Clopper-Pearson (two-sided, level 1 - alpha).
    """
    t1, t0 = np.asarray(stat_d, np.float64), np.asarray(stat_dprime, np.float64)
    if min(len(t1), len(t0)) < 4:
        return {
            "epsilon_lower_bound": 0.0,
            "threshold": 0.0,
            "fpr": math.nan,
            "fnr": math.nan,
            "selection_bound": 0.0,
            "separation": math.nan,
        }
    h1, h0 = len(t1) // 2, len(t0) // 2
    sel1, ev1 = t1[:h1], t1[h1:]
    sel0, ev0 = t0[:h0], t0[h0:]
    cands = _candidates(np.concatenate([sel0, sel1]))
    fp, fn = _counts(sel0, sel1, cands)
    bounds = _eps_bounds(fp, fn, len(sel0), len(sel1), delta, selection_alpha)
    i = int(np.argmax(bounds))
    thr = float(cands[i])
    fp_e, fn_e = _counts(ev0, ev1, np.array([thr]))
    eps = float(_eps_bounds(fp_e, fn_e, len(ev0), len(ev1), delta, alpha)[0])
    pooled = math.sqrt(0.5 * (t1.var() + t0.var()))
    return {
        "epsilon_lower_bound": eps,
        "threshold": thr,
        "fpr": float(fp_e[0]) / len(ev0),
        "fnr": float(fn_e[0]) / len(ev1),
        "selection_bound": float(bounds[i]),
        "separation": float((t1.mean() - t0.mean()) / pooled) if pooled > 0 else math.inf,
    }


def gdp_lower_bound(
    stat_d: np.ndarray, stat_dprime: np.ndarray, delta: float, *, alpha: float = 0.05
) -> dict[str, float]:
    """An ESTIMATE of epsilon at ``delta`` that is a lower bound only if the statistics are
    Gaussian with one variance under D and D' (mu-GDP) and independent; not model-free (a
    Laplace mechanism's statistics make it overstate epsilon).

    mu_hat = |mean_D - mean_D'| / pooled sd; its standard error
    sqrt(1/n1 + 1/n0 + mu_hat^2 / (2 (n1 + n0))) (Hedges and Olkin, 1985); the two-sided
    (1 - alpha) interval's lower end mu_lo gives epsilon = gaussian_epsilon(1 / mu_lo, delta).
    """
    t1, t0 = np.asarray(stat_d, np.float64), np.asarray(stat_dprime, np.float64)
    n1, n0 = len(t1), len(t0)
    if min(n1, n0) < 2:
        return {"epsilon_lower_bound": 0.0, "mu_hat": 0.0, "mu_lower": 0.0, "variance_ratio": 1.0}
    v1, v0 = float(t1.var(ddof=1)), float(t0.var(ddof=1))
    pooled = math.sqrt(((n1 - 1) * v1 + (n0 - 1) * v0) / (n1 + n0 - 2))
    mu_hat = abs(float(t1.mean() - t0.mean())) / pooled if pooled > 0 else math.inf
    se = math.sqrt(1.0 / n1 + 1.0 / n0 + mu_hat**2 / (2.0 * (n1 + n0)))
    mu_lo = max(mu_hat - float(norm.ppf(1.0 - alpha / 2.0)) * se, 0.0)
    if math.isinf(mu_lo):
        eps = math.inf
    else:
        eps = gaussian_epsilon(1.0 / mu_lo, delta) if mu_lo > 0 else 0.0
    return {
        "epsilon_lower_bound": float(eps),
        "mu_hat": mu_hat,
        "mu_lower": mu_lo,
        "variance_ratio": v1 / v0 if v0 > 0 else math.inf,
    }


def _bets(y: np.ndarray, alpha: float) -> np.ndarray:
    """Predictable plug-in bets for a sample of ``len(y)`` (Waudby-Smith and Ramdas 2023):
    lambda_i = sqrt(2 log(1/alpha) / (n sigma_{i-1}^2)), with the running variance estimate
    ``(1/4 + sum_{j<i} (y_j - mu_j)^2) / i`` (its prior 1/4 keeps the first bets small)."""
    n = len(y)
    i = np.arange(1, n + 1)
    mu = (0.5 + np.cumsum(y)) / (i + 1)
    var = (0.25 + np.cumsum((y - mu) ** 2)) / (i + 1)
    prev = np.concatenate([[0.25], var[:-1]])
    return np.sqrt(2.0 * math.log(1.0 / alpha) / (n * prev))


def _log_capital(y: np.ndarray, bets: np.ndarray, m: float) -> float:
    """max_t log prod_{i<=t} (1 + lambda_i (y_i - m)), lambda_i capped at BET_CAP / m: a
    nonnegative supermartingale whenever E[y_i | past] <= m, so by Ville's inequality it
    reaches log(1/alpha) with probability at most alpha.  Nonincreasing in m."""
    lam = np.minimum(bets, BET_CAP / m)
    return float(np.max(np.cumsum(np.log1p(lam * (y - m)))))


def betting_test(y: np.ndarray, m0: float, alpha: float) -> dict[str, float | bool]:
    """Test E[y_i | past] <= ``m0`` for values in [0, 1] (level alpha, any dependence on the
    past); ``lower``: the (1 - alpha) lower confidence bound on the mean (the largest m the
    test rejects)."""
    y = np.asarray(y, np.float64)
    if len(y) == 0:
        return {"rejected": False, "log_capital": 0.0, "p_value": 1.0, "lower": 0.0}
    bets = _bets(y, alpha)
    need = math.log(1.0 / alpha)
    cap = _log_capital(y, bets, m0)
    lo, hi = 0.0, 1.0
    if _log_capital(y, bets, 1e-9) < need:
        hi = 0.0
    for _ in range(60):
        if hi - lo < 1e-9:
            break
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _log_capital(y, bets, mid) >= need else (lo, mid)
    return {
        "rejected": bool(cap >= need),
        "log_capital": cap,
        "p_value": float(min(1.0, math.exp(-cap))),
        "lower": lo,
    }


def _block_starts(n: int, block: int) -> np.ndarray:
    return np.arange(0, n, max(1, block))


def predictable_guesses(stats: np.ndarray, signs: np.ndarray, block: int) -> np.ndarray:
    """Per client (consecutive blocks of ``block`` canaries, the last may be shorter): the share
    of its canaries whose coin the rule ``direction * (S - t) > 0`` guesses right.  The rule is
    refitted REFITS times, each time from the earlier clients only (t: the midpoint of the two
    medians; direction: their order), and starts as ``S > 0`` (the design is symmetric)."""
    n = len(stats)
    starts = _block_starts(n, block)
    nb = len(starts)
    edges = sorted({0, nb, *np.linspace(0, nb, REFITS + 1).astype(int).tolist()})
    y = np.empty(nb)
    t, direction = 0.0, 1.0
    for e0, e1 in itertools.pairwise(edges):
        a = int(starts[e0])
        if a > 0:
            past_s, past_b = stats[:a], signs[:a]
            if past_b.any() and (~past_b).any():
                hi, lo = float(np.median(past_s[past_b])), float(np.median(past_s[~past_b]))
                t, direction = 0.5 * (hi + lo), (1.0 if hi >= lo else -1.0)
        b = int(starts[e1]) if e1 < nb else n
        right = ((direction * (stats[a:b] - t) > 0) == signs[a:b]).astype(np.float64)
        local = starts[e0:e1] - a
        y[e0:e1] = np.add.reduceat(right, local) / np.diff(np.append(local, b - a))
    return y


def _accuracy_power(acc: float, m0: float, block: int, blocks: int, alpha: float) -> float:
    """Expected final log capital (approx.) when each guess is right with probability acc."""
    sd2 = acc * (1.0 - acc) / block
    lam = min(math.sqrt(2.0 * math.log(1.0 / alpha) / (blocks * max(sd2, 1e-12))), BET_CAP / m0)
    gap = acc - m0
    return blocks * (lam * gap - 0.5 * lam**2 * (sd2 + gap**2))


def detectable_noise_scale(claim: Claim, trials: int, block: int, alpha: float) -> float:
    """The largest F for which a Gaussian mechanism adding F times the noise of the claim's
    mu-GDP part is flagged by the balanced test in expectation (about half the time): what an
    audit of ``trials`` canaries can see.  0 when it can see nothing."""
    mu0 = 2.0 * float(norm.ppf(claim.accuracy_max))
    blocks = math.ceil(trials / block)
    need = math.log(1.0 / alpha)

    def flagged(f: float) -> bool:
        acc = float(norm.cdf(mu0 / (2.0 * f)))
        return _accuracy_power(acc, claim.accuracy_max, block, blocks, alpha) >= need

    if mu0 <= 0 or not flagged(1e-3):
        return 0.0
    lo, hi = 1e-3, 1.0
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if flagged(mid) else (lo, mid)
    return lo


def audit_statistics(
    stats: np.ndarray,
    signs: np.ndarray,
    claim: Claim,
    *,
    alpha: float = 0.01,
    block: int = 1,
) -> dict[str, Any]:
    """The verdict from canary statistics ``stats`` (in trial order) and their coins ``signs``
    (True: D, the canary +sRu), consecutive ``block`` canaries per client.  Two tests at
    ``alpha/2`` each (module docstring), both valid for any mechanism; ``violation`` if either
    rejects the claim.  The GDP estimate is reported, never used."""
    s = np.asarray(stats, np.float64).ravel()
    b = np.asarray(signs, bool).ravel()
    if s.shape != b.shape:
        raise ValueError("stats and signs differ in shape")
    half = alpha / 2.0
    y = predictable_guesses(s, b, block)
    bal = betting_test(y, claim.accuracy_max, half)
    acc_lb = float(bal["lower"])
    mu_lb = 2.0 * float(norm.ppf(acc_lb)) if acc_lb > 0.5 else 0.0
    first = _block_starts(len(s), block)
    tail = epsilon_lower_bound(s[first][b[first]], s[first][~b[first]], claim.delta, alpha=half)
    gdp = gdp_lower_bound(s[b], s[~b], claim.delta, alpha=alpha)
    flagged_tail = tail["epsilon_lower_bound"] > claim.epsilon
    return {
        "violation": bool(bal["rejected"]) or flagged_tail,
        "accuracy": float(np.mean(y)) if len(y) else math.nan,
        "accuracy_lower_bound": acc_lb,
        "accuracy_claimed_max": claim.accuracy_max,
        "tv_lower_bound": max(0.0, 2.0 * acc_lb - 1.0),
        "mu_lower_bound": mu_lb,
        "epsilon_gdp_refuted": gaussian_epsilon(1.0 / mu_lb, claim.delta) if mu_lb > 0 else 0.0,
        "log_capital": float(bal["log_capital"]),
        "p_value": float(bal["p_value"]),
        "flagged_balanced": bool(bal["rejected"]),
        "epsilon_lower_bound": float(tail["epsilon_lower_bound"]),
        "flagged_tail": bool(flagged_tail),
        "tail": tail,
        "gdp_estimate": gdp,
        "clients": len(y),
        "detectable_noise_scale": detectable_noise_scale(claim, len(s), block, half),
    }
