"""Empirical DP audit of a prototype-release mechanism over whole runs, with a model-free verdict.

The claim.  A run's guarantee is what its accountant composes: the DP events of the T releases
the mechanism is calibrated for (IGPP: T Gaussians, i.e. mu-GDP; VPP: T Gaussians and T pure
selections), recomputed from the configuration with the REGISTERED mechanism (never read from
the audited object, which may be the broken thing).  The whole privacy profile
``delta(epsilon')`` of those events is the claim (``claim="profile"``, the default): the ledger
composes it and reads the run's (epsilon, delta) off it, so a mechanism that exceeds it
anywhere breaks the accounting.  ``claim="point"`` tests the run's (epsilon, delta) alone, and
a list of events states any other claim (e.g. pure-DP events for a Laplace mechanism).

Trials.  A trial is one canary in a whole run: a canary client releases T times (its data
fixed), through one mechanism calibrated for T releases, exactly as a client of a run does.
Every class of the client's data set is a canary class of ``class_size`` examples: one canary
``b s R u_k`` and zeros, with ``b = +-1`` a fresh fair coin per canary (D or D', replace-one),
``R`` the clip, ``s`` (10) far beyond the clipping boundary and ``u_k`` a flat unit direction
(``(+-1, ..., +-1)/sqrt(d)``): correct per-example clipping (IGPP) and groupwise clipping (VPP,
for every partition A, ``||u_A|| = sqrt(d_A/d)``) both put the canary exactly on the boundary,
so its class prototype moves by the full sensitivity ``2R/n``.  One client carries up to
``canaries`` (64) canaries, one per class, so one release serves many trials.

Statistic.  Per canary ``S = sum_t sum_j u_kj p_tkj / sigma_tkj^2`` with ``p_tk`` its class's
released prototype in round t and ``sigma_tkj`` the per-dimension noise std stated in the
release: the Neyman-Pearson statistic for Gaussian noise, and a valid (if weaker) one for any.

Verdict (valid for any mechanism; ``violation`` is the union of two tests at ``alpha/2`` each,
``alpha = 1 - confidence``):

* balanced test: guess ``b`` from ``S`` by a threshold rule fitted on earlier clients only
  (predictable).  Whatever the mechanism, each guess is right with probability at most
  ``(1 + tv)/2``, with ``tv = delta(0)`` of the claim (for mu-GDP ``Phi(mu/2)``), even given
  everything before it.  The per-client share of right guesses is tested against that bound
  with a betting martingale (Waudby-Smith and Ramdas 2023, predictable plug-in bets, Ville's
  inequality): no distributional model, and valid when a mechanism correlates the classes of a
  release (which is why clients, not canaries, are the units).  Its lower confidence bound on
  the accuracy gives ``mu_lower_bound``: no mu-GDP claim with a smaller mu holds.
* tail test: the classic bound on epsilon at the claimed delta, from the first canary of each
  client (independent): threshold chosen on the first half, FPR and FNR on the second half with
  Clopper-Pearson intervals, ``eps = log((1 - delta - FNR_hi) / FPR_hi)`` (both directions).
  It is the figure ``epsilon_lower_bound``; at delta = 1e-5 it needs millions of trials to
  exceed a claim of 1, so the balanced test carries the power.

The GDP estimate (mu from the standardised mean difference of S, as if S were Gaussian) is
reported as ``gdp_estimate`` beside them and never decides anything: a Laplace mechanism gives
S a non-Gaussian law, and its GDP figure overstates its epsilon.

Modes: ``release`` (default): the real releases end to end through ``release_many`` (the
engine's batched path for the shipped classes, the per-client loop for any subclass that
overrides a release step).  ``fast``: a simulation: the noiseless prototypes and stated noise
std from ``noiseless_release`` (VPP: a random partition per round), then S drawn from its exact
Gaussian law; catches clipping and calibration bugs with many more trials, and cannot see a
release that adds less noise than it states.  ``both`` runs both (the bounds split alpha).

``noise_scale`` audits a copy of the mechanism whose noise, added and stated, is F times the
calibrated one: a check of the auditor itself.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy.stats import beta, norm

from protofl.privacy.accounting import epsilon_spent, gaussian_epsilon, sampled_pld, split_events
from protofl.privacy.base import MECHANISM_REGISTRY, Mechanism, private_mechanisms
from protofl.privacy.config import PrivacyConfig
from protofl.privacy.prototype import _PrototypeMechanism, release_many
from protofl.seeding import Stream, derive_seed

MODES = ("release", "fast", "both")
CLAIMS = ("profile", "point")
TRIALS = 64_000
"""Default trials (canaries) per mode: flags noise x0.8 at epsilon 1 (see docs/attacks.md)."""
CANARIES = 64
"""Default canaries per client (one per class)."""
MIN_CLIENTS = 100
"""Fewer canaries per client when trials are few, so that at least this many clients run."""
MIN_TRIALS = 100
BET_CAP = 0.9
"""Bets are capped at BET_CAP / m, so every factor of the capital stays >= 1 - BET_CAP."""
REFITS = 16
"""The balanced test's rule is refitted this many times, each time on the clients before."""
PLD_INTERVAL = 1e-3


def _fail(name: str, value: object, allowed: str) -> None:
    raise ValueError(f"{name}={value!r} is out of range; allowed: {allowed}")


# --------------------------------------------------------------------------------------------
# the claim
# --------------------------------------------------------------------------------------------
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


def claimed_events(config: PrivacyConfig, *, rounds: int, dim: int) -> list[list[dict[str, Any]]]:
    """The DP events of each of ``rounds`` releases as the REGISTERED mechanism of
    ``config.privacy.mechanism`` calibrates them (``release_events``): the claim under test,
    never taken from the audited object (a mechanism class that miscalibrates itself must not
    lower its own claim)."""
    cls = MECHANISM_REGISTRY.get(config.base_mechanism)
    mech = cls(config, rounds=rounds, dim=dim)
    if not mech.is_private:
        raise ValueError(f"mechanism {config.mechanism!r} has no DP guarantee to audit")
    return [mech.release_events(i) for i in range(rounds)]


def _nonzero(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop pure events of epsilon 0 (a selection that costs nothing)."""
    return [e for e in events if not (e.get("kind") == "pure" and float(e["epsilon"]) == 0)]


def per_release_epsilon(config: PrivacyConfig, *, rounds: int, dim: int) -> float:
    """The epsilon of ONE release of a mechanism calibrated for ``rounds`` releases (the first
    one, which carries any one-off selection), by the tight PLD composition."""
    events = claimed_events(config, rounds=rounds, dim=dim)[0]
    return epsilon_spent(_nonzero(events), delta=config.delta, accountant="pld")


def run_events(config: PrivacyConfig, *, rounds: int, dim: int) -> list[dict[str, Any]]:
    """All DP events of a whole run (``rounds`` releases of one client)."""
    return _nonzero([e for ev in claimed_events(config, rounds=rounds, dim=dim) for e in ev])


def run_epsilon(config: PrivacyConfig, *, rounds: int, dim: int) -> float:
    """The epsilon of a whole run (``rounds`` releases of one client) of a mechanism calibrated
    for ``rounds`` releases, from the registered mechanism's ``release_events`` composed with
    the tight PLD accountant: the run's stated guarantee."""
    return epsilon_spent(run_events(config, rounds=rounds, dim=dim), delta=config.delta)


def gdp_mu(epsilon: float, delta: float) -> float:
    """The mu of mu-GDP whose epsilon at ``delta`` is ``epsilon`` (for reports)."""
    lo, hi = 1e-6, 1.0
    while gaussian_epsilon(1.0 / hi, delta) < epsilon:
        hi *= 2.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if gaussian_epsilon(1.0 / mid, delta) < epsilon else (lo, mid)
    return hi


# --------------------------------------------------------------------------------------------
# the tail test: Clopper-Pearson on FPR and FNR
# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# the GDP estimate (reported, never the verdict)
# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# the balanced test: predictable guesses, a betting martingale
# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# canary data
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CanaryData:
    """One client's canary classes: class k has ``class_size`` examples, the canary
    ``+-scale * directions[k]`` first, then zeros."""

    directions: torch.Tensor  # [K, d], flat unit vectors
    labels: torch.Tensor  # [K * class_size]
    class_size: int
    scale: float  # s * R
    # replace_one: the canary is +-s R u (D or D'); add_remove: s R u present or a zero example
    # in its place (absent: the special-element form of add/remove, counts fixed as public)
    relation: str = "replace_one"

    @property
    def num_classes(self) -> int:
        return int(self.directions.shape[0])

    def features(self, signs: torch.Tensor) -> torch.Tensor:
        """Data sets [N, K * class_size, d] for coins ``signs`` [N, K] (True: +)."""
        k, d = self.directions.shape
        sgn = signs.to(torch.float64)
        if self.relation == "replace_one":
            sgn = sgn * 2.0 - 1.0
        x = torch.zeros(signs.shape[0], k, self.class_size, d, dtype=torch.float64)
        x[:, :, 0] = sgn[..., None] * self.scale * self.directions
        return x.reshape(signs.shape[0], k * self.class_size, d)


def make_canary_data(
    dim: int,
    clip: float,
    *,
    canaries: int = CANARIES,
    class_size: int = 4,
    canary_scale: float = 10.0,
    seed: int = 0,
    relation: str = "replace_one",
) -> CanaryData:
    """``canaries`` canary classes of ``class_size`` examples with their own flat directions."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (canaries, dim), generator=g, dtype=torch.float64) * 2 - 1
    labels = torch.arange(canaries).repeat_interleave(class_size)
    return CanaryData(signs / math.sqrt(dim), labels, class_size, canary_scale * clip, relation)


def _class_rows(release: Any, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    classes = release.classes.cpu()
    if classes.shape != (num_classes,) or not torch.equal(classes, torch.arange(num_classes)):
        raise RuntimeError(
            f"expected one released prototype per canary class (0..{num_classes - 1}), got "
            f"classes {classes.tolist()}"
        )
    return release.prototypes.detach().cpu().double(), release.noise_std.detach().cpu().double()


def _statistic(protos: torch.Tensor, std: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """sum_j u_j p_j / sigma_j^2 per row (sigma from the release; 1 where zero)."""
    var = std**2
    var = torch.where(var > 0, var, torch.ones_like(var))
    return ((protos * u) / var).sum(dim=-1)


# --------------------------------------------------------------------------------------------
# the mechanism under audit
# --------------------------------------------------------------------------------------------
def scaled_noise(cls: type[Mechanism], factor: float) -> type[Mechanism]:
    """A copy of mechanism class ``cls`` whose noise, added and stated, is ``factor`` times the
    calibrated one (``--noise-scale``): what an auditor with power must flag for factor < 1.
    It scales the multipliers the noise is drawn with (IGPP ``sigma``, VPP ``sigma_A`` and
    ``sigma_B``) and overrides no release step, so it runs the engine's batched path."""
    if not issubclass(cls, _PrototypeMechanism):
        raise ValueError(f"noise_scale needs a clipping mechanism (igpp, vpp), not {cls.__name__}")
    if factor == 1.0:
        return cls
    base = cls

    def __init__(self: Any, config: PrivacyConfig, *, rounds: int, dim: int) -> None:
        base.__init__(self, config, rounds=rounds, dim=dim)
        before = float(self._max_unit_std())
        self.sigma *= factor
        budget = getattr(self, "budget", None)
        if budget is not None:  # VPP: the group multipliers
            self.budget = dataclasses.replace(
                budget, sigma_A=budget.sigma_A * factor, sigma_B=budget.sigma_B * factor
            )
        if not math.isclose(float(self._max_unit_std()), factor * before, rel_tol=1e-9):
            raise ValueError(f"cannot scale the noise of {base.__name__}")

    return type(f"{cls.__name__}NoiseX{factor:g}", (cls,), {"__init__": __init__})


def _random_partition(mech: Mechanism, gen: torch.Generator) -> torch.Tensor:
    k = int(getattr(mech, "k", 1))
    mask = torch.zeros(mech.dim, dtype=torch.bool)
    mask[torch.randperm(mech.dim, generator=gen)[:k]] = True
    return mask


def _fast_stats(
    mech: Mechanism, data: CanaryData, signs: np.ndarray, rounds: int, gen: torch.Generator
) -> np.ndarray:
    """S per canary [N, K], simulated: the noiseless prototypes and stated std of the all-D and
    all-D' data sets per round (VPP: one random partition per round), and S drawn from its
    exact law, centre + N(0, sum_j u_j^2 std_j^2 / sigma_j^4) summed over rounds."""
    noiseless = getattr(mech, "noiseless_release", None)
    if noiseless is None:
        raise ValueError(f"mechanism {mech.name!r} has no noiseless_release(); use mode='release'")
    k = data.num_classes
    sets = data.features(torch.tensor([[False] * k, [True] * k]))
    centre = torch.zeros(2, k, dtype=torch.float64)
    var = torch.zeros(2, k, dtype=torch.float64)
    u = data.directions
    for _ in range(rounds):
        kwargs: dict[str, Any] = {"num_classes": k}
        if hasattr(mech, "k"):  # VPP: for flat canaries every partition is alike
            kwargs["partition"] = _random_partition(mech, gen)
        for side in (0, 1):
            p, std = _class_rows(noiseless(sets[side], data.labels, **kwargs), k)
            centre[side] += _statistic(p, std, u)
            v = std**2
            v = torch.where(v > 0, v, torch.ones_like(v))
            var[side] += (u**2 * std**2 / v**2).sum(dim=-1)
    z = torch.randn(signs.shape, generator=gen, dtype=torch.float64).numpy()
    idx = signs.astype(np.int64)
    cols = np.arange(k)[None, :]
    return centre.numpy()[idx, cols] + np.sqrt(var.numpy()[idx, cols]) * z


def _release_stats(
    build: Any, data: CanaryData, signs: np.ndarray, rounds: int, seed: int, chunk: int = 256
) -> np.ndarray:
    """S per canary [N, K] from real releases: N canary clients (one generator each), each
    releasing ``rounds`` times through one mechanism calibrated for ``rounds`` releases."""
    mech = build()
    n, k = signs.shape
    out = np.zeros((n, k))
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        feats = list(data.features(torch.from_numpy(signs[a:b])).unbind(0))
        labels = [data.labels] * (b - a)
        gens = [
            torch.Generator().manual_seed(derive_seed(seed, Stream.AUDIT, 1, i))
            for i in range(a, b)
        ]
        names = [f"audit-{i}" for i in range(a, b)]
        for _ in range(rounds):
            releases = release_many(
                mech, feats, labels, num_classes=k, generators=gens, clients=names
            )
            rows = [_class_rows(r, k) for r in releases]
            protos = torch.stack([r[0] for r in rows])
            std = torch.stack([r[1] for r in rows])
            out[a:b] += _statistic(protos, std, data.directions).numpy()
    return out


def block_size(trials: int, canaries: int) -> int:
    """Canaries per client: ``canaries``, fewer when trials are few (at least MIN_CLIENTS)."""
    return max(1, min(canaries, trials // MIN_CLIENTS))


def audit_mechanism(
    mechanism: str | type[Mechanism],
    epsilon: float,
    *,
    delta: float = 1e-5,
    trials: int = TRIALS,
    release_trials: int = TRIALS,
    mode: str = "release",
    rounds: int = 20,
    confidence: float = 0.99,
    noise_scale: float = 1.0,
    dim: int = 32,
    clip: float = 1.0,
    canary_scale: float = 10.0,
    canaries: int = CANARIES,
    claim: str | Sequence[Mapping[str, Any]] = "profile",
    seed: int = 0,
    **privacy: Any,
) -> dict[str, Any]:
    """Audit whole runs (``rounds`` releases of a canary client) of ``mechanism`` (a registered
    name or a Mechanism subclass, e.g. a deliberately broken one) calibrated for
    (epsilon, delta) over ``rounds`` releases.

    ``trials`` canaries (whole runs) per mode; with ``mode="both"`` the release mode runs
    ``release_trials``.  ``claim``: ``"profile"`` (the registered mechanism's whole privacy
    profile), ``"point"`` (the run's (epsilon, delta) alone) or a list of DP events (one
    whole run's).  Returns a JSON-safe dict: ``violation`` (the model-free verdict at
    ``confidence``), ``epsilon_claimed``, ``epsilon_lower_bound`` (tail test),
    ``accuracy_lower_bound`` / ``accuracy_claimed_max`` and ``mu_lower_bound`` (balanced
    test), per mode the details and the GDP estimate, ``seconds``.  ``privacy`` holds further
    ``PrivacyConfig`` fields.
    """
    if not (isinstance(epsilon, int | float) and epsilon > 0 and math.isfinite(epsilon)):
        _fail("epsilon", epsilon, "(0, inf)")
    if not 0 < delta < 1:
        _fail("delta", delta, "(0, 1)")
    if mode not in MODES:
        _fail("mode", mode, ", ".join(MODES))
    if not (isinstance(confidence, float | int) and 0.5 <= confidence < 1):
        _fail("confidence", confidence, "[0.5, 1)")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        _fail("rounds", rounds, "integers >= 1")
    if not (math.isfinite(noise_scale) and noise_scale > 0):
        _fail("noise_scale", noise_scale, "(0, inf)")
    if not canary_scale >= 1:
        _fail("canary_scale", canary_scale, "[1, inf)")
    if isinstance(canaries, bool) or not isinstance(canaries, int) or canaries < 1:
        _fail("canaries", canaries, "integers >= 1")
    if isinstance(claim, str) and claim not in CLAIMS:
        _fail("claim", claim, "profile, point or a list of DP events")
    modes = ("fast", "release") if mode == "both" else (mode,)
    counts = {"fast": trials, "release": release_trials if mode == "both" else trials}
    for m in modes:
        n = counts[m]
        key = "release_trials" if m == "release" and mode == "both" else "trials"
        if isinstance(n, bool) or not isinstance(n, int) or n < MIN_TRIALS:
            raise ValueError(
                f"{key}={n!r} is too few: at least {MIN_TRIALS} are needed (the power of a "
                "given number is reported as detectable_noise_scale)"
            )
    name = mechanism if isinstance(mechanism, str) else mechanism.name
    audited = private_mechanisms()  # the registry says which mechanisms carry a guarantee
    if name not in audited:
        _fail("mechanism", name, ", ".join(audited) + " (or a subclass of one)")
    privacy.setdefault("warn_min_count", 0)  # the tiny canary classes are deliberate
    config = PrivacyConfig(
        mechanism=name, epsilon=float(epsilon), delta=float(delta), clip=clip, **privacy
    )
    if config.neighbouring == "add_remove" and config.addremove_counts != "public":
        _fail("addremove_counts", config.addremove_counts, "public (the audit's add/remove form)")
    if config.sampled and "fast" in modes:
        raise ValueError(
            f"mode={mode!r}: fast mode simulates unsampled releases; a subsampled mechanism "
            "(sample_rate < 1) is audited with mode='release'"
        )
    cls = MECHANISM_REGISTRY.get(config.base_mechanism) if isinstance(mechanism, str) else mechanism
    cls = scaled_noise(cls, float(noise_scale))

    def build() -> Mechanism:
        return cls(config, rounds=rounds, dim=dim)

    if not isinstance(claim, str):
        stated = claim_from_events(_nonzero([dict(e) for e in claim]), delta)
    elif claim == "point":
        stated = point_claim(run_epsilon(config, rounds=rounds, dim=dim), delta)
    else:
        stated = claim_from_events(
            run_events(config, rounds=rounds, dim=dim), delta, kind="profile"
        )
    alpha = (1.0 - float(confidence)) / len(modes)
    mech = build()
    out: dict[str, Any] = {
        "mechanism": name if isinstance(mechanism, str) else mechanism.__name__,
        "epsilon": float(epsilon),
        "delta": float(delta),
        "rounds": rounds,
        "claim": stated.kind,
        "epsilon_claimed": stated.epsilon,
        "mu_claimed": stated.mu if stated.mu is not None else gdp_mu(stated.epsilon, delta),
        "accuracy_claimed_max": stated.accuracy_max,
        "confidence": float(confidence),
        "noise_scale": float(noise_scale),
        "dim": dim,
        "clip": clip,
        "canary_scale": canary_scale,
        "canaries": canaries,
        "seed": seed,
        "mode": mode,
        "modes": {},
        "sigma": float(getattr(mech, "sigma", math.nan)),
    }
    started = time.perf_counter()
    threads = torch.get_num_threads()
    from protofl.progress import note

    for m in modes:
        t0 = time.perf_counter()
        n = counts[m]
        block = block_size(n, canaries)
        clients = math.ceil(n / block)
        note(
            f"audit, {m} mode: {n} trials x {rounds} releases ({clients} clients of "
            f"{block} canaries) ..."
        )
        rng = np.random.default_rng(derive_seed(seed, Stream.AUDIT, 0, MODES.index(m)))
        signs = rng.random((clients, block)) < 0.5
        data = make_canary_data(
            dim,
            clip,
            canaries=block,
            canary_scale=canary_scale,
            seed=derive_seed(seed, 2),
            relation=config.neighbouring,
        )
        if m == "fast":
            gen = torch.Generator().manual_seed(derive_seed(seed, Stream.AUDIT, 2))
            stats = _fast_stats(mech, data, signs, rounds, gen)
        else:
            torch.set_num_threads(1)  # tiny tensors: threads only add contention
            try:
                stats = _release_stats(build, data, signs, rounds, seed)
            finally:
                torch.set_num_threads(threads)
        # fast mode draws every canary's noise independently: each canary is a unit there
        unit = 1 if m == "fast" else block
        res = audit_statistics(
            stats.ravel()[:n], signs.ravel()[:n], stated, alpha=alpha, block=unit
        )
        res.update(trials=n, canaries_per_client=block, seconds=time.perf_counter() - t0)
        out["modes"][m] = res
    if mode == "both":
        out["release_trials"] = counts["release"]
    results = list(out["modes"].values())
    for key in (
        "epsilon_lower_bound",
        "accuracy_lower_bound",
        "mu_lower_bound",
        "epsilon_gdp_refuted",
        "detectable_noise_scale",
    ):
        out[key] = max(r[key] for r in results)
    out["trials"] = counts[modes[0]]
    out["seconds"] = time.perf_counter() - started
    out["violation"] = any(r["violation"] for r in results)
    return out
