"""Empirical DP audit of a prototype-release mechanism: a statistical lower bound on epsilon.

Neighbouring data sets (replace-one, the mechanisms' relation).  A small class ``c*`` holds
``n`` examples: one canary and ``n - 1`` zero vectors; the other classes hold random features.
D has the canary ``+s R u``, D' the canary ``-s R u``, where ``R`` is the clip, ``s`` (10 by
default) puts it far beyond the clipping boundary, and ``u = (+-1, ..., +-1) / sqrt(d)`` is a
*flat* direction: correct per-example clipping (IGPP) and groupwise clipping (VPP, for every
partition A, because ``||u_A|| = sqrt(d_A/d)``) both map it exactly onto the clipping boundary,
so the class prototype moves by the full sensitivity ``2R/n`` and no partition helps the
mechanism.  A mechanism that skips clipping moves it ``s`` times further.

Statistic.  The optimal (Neyman-Pearson) test between the two Gaussians is linear:
``T = sum_j u_j p_j / sigma_j^2`` with ``p`` the released prototype of ``c*`` and ``sigma_j`` its
per-dimension noise std as stated in the release (for VPP it reveals the released partition,
which is public).  The threshold and the direction of the test are chosen on the first half of
the trials (with stricter 99.9% intervals, against the winner's curse in the tails); the second
half gives the false-positive and false-negative rates with two-sided 95%
Clopper-Pearson intervals, and::

    eps_lb = max( log((1 - delta - FNR_hi) / FPR_hi),  log((1 - delta - FPR_hi) / FNR_hi) )

(a valid 95% lower bound: the threshold is not chosen on the data that bound it).

Two modes, both run by default:

* ``fast``: the deterministic part (clipping, means, stated noise std) comes from one call of the
  mechanism's ``noiseless_release`` per data set, and Gaussian noise of the stated std is drawn
  for all trials at once (vectorised).  Catches wrong clipping and wrong calibration.
* ``release``: the real ``release`` end-to-end for every trial (fewer trials).  Also catches a
  release that adds less noise than it states.

Claimed epsilon.  One release of a mechanism calibrated for ``rounds`` releases is audited
against the *per-release* guarantee implied by the calibration, recomputed from the configuration
with ``protofl.privacy.accounting`` (not from the mechanism object, which may be the broken
thing): IGPP, one Gaussian of multiplier ``calibrate_gaussian(eps, delta, T)`` (analytic
epsilon); VPP, one Gaussian of the effective multiplier ``(sigma_A^-2 + sigma_B^-2)^-1/2``
composed with one pure ``eps_select``-DP selection.  With ``rounds=1`` (the default) this is the
configured epsilon (up to the calibration's rounding in the safe direction).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy.stats import beta

from protofl.privacy.accounting import (
    calibrate_gaussian,
    calibrate_vpp,
    compose_epsilon,
    gaussian_epsilon,
)
from protofl.privacy.base import Mechanism, create_mechanism
from protofl.privacy.config import PrivacyConfig

MODES = ("fast", "release", "both")


def _fail(name: str, value: object, allowed: str) -> None:
    raise ValueError(f"{name}={value!r} is out of range; allowed: {allowed}")


# --------------------------------------------------------------------------------------------
# statistics
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


def epsilon_lower_bound(
    stat_d: np.ndarray,
    stat_dprime: np.ndarray,
    delta: float,
    *,
    alpha: float = 0.05,
    selection_alpha: float = 1e-3,
) -> dict[str, float]:
    """Lower bound on epsilon from statistics under D (``stat_d``) and D' (``stat_dprime``).

    First halves pick the threshold (candidate thresholds: every observed value): the one whose
    bound is largest with the stricter ``selection_alpha`` intervals, which keeps the choice away
    from far-tail thresholds that look good only by luck (winner's curse).  Second halves bound
    FPR and FNR at that threshold with Clopper-Pearson (two-sided, level 1 - alpha).
    """
    t1, t0 = np.asarray(stat_d, np.float64), np.asarray(stat_dprime, np.float64)
    h1, h0 = len(t1) // 2, len(t0) // 2
    sel1, ev1 = t1[:h1], t1[h1:]
    sel0, ev0 = t0[:h0], t0[h0:]
    cands = np.unique(np.concatenate([sel0, sel1]))
    fp, fn = _counts(sel0, sel1, cands)
    bounds = _eps_bounds(fp, fn, len(sel0), len(sel1), delta, selection_alpha)
    i = int(np.argmax(bounds))
    thr = float(cands[i])
    fp_e, fn_e = _counts(ev0, ev1, np.array([thr]))
    eps = float(_eps_bounds(fp_e, fn_e, len(ev0), len(ev1), delta, alpha)[0])
    return {
        "epsilon_lower_bound": eps,
        "threshold": thr,
        "fpr": float(fp_e[0]) / len(ev0),
        "fnr": float(fn_e[0]) / len(ev1),
        "selection_bound": float(bounds[i]),
        "separation": float((t1.mean() - t0.mean()) / math.sqrt(0.5 * (t1.var() + t0.var()))),
    }


# --------------------------------------------------------------------------------------------
# claimed guarantee of one release
# --------------------------------------------------------------------------------------------
def per_release_epsilon(config: PrivacyConfig, *, rounds: int, dim: int) -> float:
    """The epsilon of ONE release of a mechanism calibrated for ``rounds`` releases, recomputed
    from the configuration (never from a mechanism object)."""
    base = config.base_mechanism
    if base == "igpp":
        sigma = calibrate_gaussian(config.epsilon, config.delta, rounds, config.accountant)
        return gaussian_epsilon(sigma, config.delta)
    if base == "vpp":
        b = calibrate_vpp(
            config.epsilon,
            config.delta,
            rounds,
            ratio=config.vpp_ratio,
            rho=config.vpp_rho,
            dim=dim,
            score_max=config.vpp_score_max,
            split=config.vpp_split,
            accountant=config.accountant,
            variant=config.vpp_variant,
        )
        inv = 1.0 / b.sigma_A**2 + 1.0 / b.sigma_B**2
        pure = {b.eps_select: 1} if b.eps_select > 0 else {}
        return compose_epsilon(inv, pure, delta=config.delta, accountant="pld")
    raise ValueError(f"mechanism {config.mechanism!r} has no DP guarantee to audit")


# --------------------------------------------------------------------------------------------
# the audit
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CanaryData:
    """D and D' (features [N, d], labels [N]), the canary class and the flat direction u."""

    features_d: torch.Tensor
    features_dprime: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    canary_class: int
    direction: torch.Tensor


def make_canary_data(
    dim: int,
    clip: float,
    *,
    num_classes: int = 4,
    per_class: int = 20,
    canary_class_size: int = 4,
    canary_scale: float = 10.0,
    seed: int = 0,
) -> CanaryData:
    """The neighbouring pair described in the module docstring (float64)."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (dim,), generator=g, dtype=torch.float64) * 2 - 1
    u = signs / math.sqrt(dim)
    feats = []
    labels = []
    for c in range(1, num_classes):  # ordinary classes: class-shifted random points in the ball
        x = torch.randn(per_class, dim, generator=g, dtype=torch.float64) * 0.3
        x[:, c % dim] += 1.0
        x = x * (0.8 * clip / x.norm(dim=1, keepdim=True).clamp_min(1e-12)).clamp(max=1.0)
        feats.append(x)
        labels.append(torch.full((per_class,), c, dtype=torch.long))
    small = torch.zeros(canary_class_size, dim, dtype=torch.float64)
    base = torch.cat([small, *feats])
    y = torch.cat([torch.zeros(canary_class_size, dtype=torch.long), *labels])
    d = base.clone()
    dp = base.clone()
    d[0] = canary_scale * clip * u
    dp[0] = -canary_scale * clip * u
    return CanaryData(d, dp, y, num_classes, 0, u)


def _statistic(protos: torch.Tensor, std: torch.Tensor, u: torch.Tensor) -> np.ndarray:
    """T = sum_j u_j p_j / sigma_j^2 per row (sigma from the release; 1 where zero)."""
    var = std.double() ** 2
    var = torch.where(var > 0, var, torch.ones_like(var))
    return ((protos.double() * u) / var).sum(dim=-1).cpu().numpy()


def _canary_row(release: Any, canary_class: int) -> int:
    rows = (release.classes == canary_class).nonzero().flatten()
    if len(rows) != 1:
        raise RuntimeError(f"expected one released prototype of the canary class, got {len(rows)}")
    return int(rows[0])


def _fast_trials(
    mech: Mechanism, data: CanaryData, trials: int, gen: torch.Generator
) -> tuple[np.ndarray, np.ndarray]:
    noiseless = getattr(mech, "noiseless_release", None)
    if noiseless is None:
        raise ValueError(f"mechanism {mech.name!r} has no noiseless_release(); use mode='release'")
    stats = []
    for feats in (data.features_d, data.features_dprime):
        kwargs: dict[str, Any] = {"num_classes": data.num_classes}
        if mech.name == "vpp":  # a random partition (for the flat canary any partition is alike)
            k = int(getattr(mech, "k", 1))
            mask = torch.zeros(mech.dim, dtype=torch.bool)
            mask[torch.randperm(mech.dim, generator=gen)[:k]] = True
            kwargs["partition"] = mask
        rel = noiseless(feats, data.labels, **kwargs)
        row = _canary_row(rel, data.canary_class)
        p = rel.prototypes[row].double()
        std = rel.noise_std[row].double()
        noise = torch.randn((trials, p.shape[0]), generator=gen, dtype=torch.float64)
        stats.append(_statistic(p + noise * std, std.expand(trials, -1), data.direction))
    return stats[0], stats[1]


def _release_trials(
    mech: Mechanism, data: CanaryData, trials: int, gen: torch.Generator
) -> tuple[np.ndarray, np.ndarray]:
    stats = []
    for tag, feats in (("d", data.features_d), ("dp", data.features_dprime)):
        out = np.empty(trials)
        for t in range(trials):
            rel = mech.release(
                feats,
                data.labels,
                num_classes=data.num_classes,
                generator=gen,
                client=f"audit-{tag}-{t}",
            )
            row = _canary_row(rel, data.canary_class)
            out[t] = _statistic(rel.prototypes[row], rel.noise_std[row], data.direction)
        stats.append(out)
    return stats[0], stats[1]


def audit_mechanism(
    mechanism: str | type[Mechanism],
    epsilon: float,
    *,
    delta: float = 1e-5,
    trials: int = 20_000,
    release_trials: int = 1_000,
    mode: str = "both",
    rounds: int = 1,
    dim: int = 32,
    clip: float = 1.0,
    canary_scale: float = 10.0,
    seed: int = 0,
    **privacy: Any,
) -> dict[str, Any]:
    """Audit one release of ``mechanism`` (a registered name or a Mechanism subclass, e.g. a
    deliberately broken one) calibrated for (epsilon, delta) over ``rounds`` releases.

    Returns a JSON-safe dict with ``epsilon_claimed`` (per release), ``epsilon_lower_bound``
    (the larger of the modes run), ``trials``, ``violation`` (lower bound > claimed) and the
    details of each mode.  ``privacy`` holds further ``PrivacyConfig`` fields.
    """
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 100:
        _fail("trials", trials, "integers >= 100")
    if not (isinstance(epsilon, int | float) and epsilon > 0 and math.isfinite(epsilon)):
        _fail("epsilon", epsilon, "(0, inf)")
    if not 0 < delta < 1:
        _fail("delta", delta, "(0, 1)")
    if mode not in MODES:
        _fail("mode", mode, ", ".join(MODES))
    if mode != "fast" and (
        isinstance(release_trials, bool)
        or not isinstance(release_trials, int)
        or release_trials < 100
    ):
        _fail("release_trials", release_trials, "integers >= 100")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        _fail("rounds", rounds, "integers >= 1")
    if not canary_scale >= 1:
        _fail("canary_scale", canary_scale, "[1, inf)")
    name = mechanism if isinstance(mechanism, str) else mechanism.name
    if name not in ("igpp", "vpp", "vpdr"):
        _fail("mechanism", name, "igpp, vpp (or a subclass of either)")
    privacy.setdefault("warn_min_count", 0)  # the tiny canary class is deliberate
    config = PrivacyConfig(
        mechanism=name, epsilon=float(epsilon), delta=float(delta), clip=clip, **privacy
    )
    if config.neighbouring != "replace_one":
        _fail("neighbouring", config.neighbouring, "replace_one (the audit's relation)")

    def build() -> Mechanism:
        if isinstance(mechanism, str):
            return create_mechanism(config, rounds=rounds, dim=dim)
        return mechanism(config, rounds=rounds, dim=dim)

    claimed = per_release_epsilon(config, rounds=rounds, dim=dim)
    data = make_canary_data(dim, clip, canary_scale=canary_scale, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    mech = build()
    out: dict[str, Any] = {
        "mechanism": name if isinstance(mechanism, str) else mechanism.__name__,
        "epsilon": float(epsilon),
        "delta": float(delta),
        "rounds": rounds,
        "epsilon_claimed": claimed,
        "dim": dim,
        "clip": clip,
        "canary_scale": canary_scale,
        "seed": seed,
        "mode": mode,
        "modes": {},
        "sigma": float(getattr(mech, "sigma", math.nan)),
    }
    bounds = []
    if mode in ("fast", "both"):
        t0 = time.perf_counter()
        s1, s0 = _fast_trials(mech, data, trials, gen)
        res = epsilon_lower_bound(s1, s0, delta)
        res.update(trials=trials, seconds=time.perf_counter() - t0)
        out["modes"]["fast"] = res
        bounds.append(res["epsilon_lower_bound"])
    if mode in ("release", "both"):
        t0 = time.perf_counter()
        n = release_trials if mode == "both" else trials
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny tensors: threads only add contention
        try:
            s1, s0 = _release_trials(build(), data, n, gen)
        finally:
            torch.set_num_threads(threads)
        res = epsilon_lower_bound(s1, s0, delta)
        res.update(trials=n, seconds=time.perf_counter() - t0)
        out["modes"]["release"] = res
        bounds.append(res["epsilon_lower_bound"])
        if mode == "both":
            out["release_trials"] = n
    out["epsilon_lower_bound"] = max(bounds)
    out["trials"] = trials
    out["violation"] = bool(out["epsilon_lower_bound"] > claimed)
    return out
