"""Empirical DP audit of a prototype-release mechanism over a whole run: a lower bound on epsilon.

Neighbouring data sets (replace-one, the mechanisms' relation).  A small class ``c*`` holds
``n`` examples: one canary and ``n - 1`` zero vectors; the other classes hold random features.
D has the canary ``+s R u``, D' the canary ``-s R u``, where ``R`` is the clip, ``s`` (10 by
default) puts it far beyond the clipping boundary, and ``u = (+-1, ..., +-1) / sqrt(d)`` is a
*flat* direction: correct per-example clipping (IGPP) and groupwise clipping (VPP, for every
partition A, because ``||u_A|| = sqrt(d_A/d)``) both map it exactly onto the clipping boundary,
so the class prototype moves by the full sensitivity ``2R/n`` and no partition helps the
mechanism.  A mechanism that skips clipping moves it ``s`` times further.

One trial is a whole run: a canary client makes ``rounds`` releases (T, default 20) of the
same data set, through a mechanism calibrated for T releases, exactly as a client of a run does.
The claimed epsilon is that of the T-fold composition, recomputed from the configuration with
``protofl.privacy.accounting`` (never from the mechanism object, which may be the broken thing).

Statistic.  The optimal (Neyman-Pearson) test between the two T-fold products of Gaussians is
linear: ``S = sum_t sum_j u_j p_tj / sigma_tj^2`` with ``p_t`` the canary class's released
prototype in round t and ``sigma_tj`` its per-dimension noise std as stated in the release (for
VPP it reveals the released partition, which is public).  For every mechanism that adds
data-independent Gaussian noise, ``S`` is Gaussian with one variance under D and D' (for VPP
too: the shift and the variance depend on the partition only through its size), so the pair is
mu-GDP with ``mu = (E_D S - E_D' S) / sd(S)`` and the trade-off curve is known.  Two bounds:

* ``gdp`` (powerful, under that model): a (1 - alpha) lower confidence bound on mu from the
  standardised mean difference (its normal approximation, exact as trials grow), converted to
  the epsilon at ``delta`` of mu-GDP (``gaussian_epsilon(1/mu, delta)``).  Post-processing: a
  mechanism with smaller epsilon at delta cannot give the statistic a larger mu.
* ``clopper_pearson`` (model-free): a threshold chosen on the first half of the trials, FPR and
  FNR on the second half with two-sided Clopper-Pearson intervals, and
  ``eps_lb = max(log((1 - delta - FNR_hi) / FPR_hi), log((1 - delta - FPR_hi) / FNR_hi))``.

Every bound is computed at ``alpha / k`` (k: the number of bounds reported), so their maximum is
a lower bound at the stated confidence ``1 - alpha`` (union bound).

Two modes, both run by default:

* ``fast``: the deterministic part (clipping, means, stated noise std) comes from the
  mechanism's ``noiseless_release`` per data set and round, and Gaussian noise of the stated std
  is drawn for every trial (vectorised).  Catches wrong clipping and wrong calibration.
* ``release``: the real releases end-to-end (``release_many``, the engine's batched path, which
  is the per-client loop for any other mechanism class), T per trial (fewer trials).  Also
  catches a release that adds less noise than it states.

``noise_scale`` audits a copy of the mechanism whose noise (added and stated) is scaled by F: a
check of the auditor itself (F < 1 must be flagged once the bound has the power).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy.stats import beta, norm

from protofl.privacy.accounting import epsilon_spent, gaussian_epsilon
from protofl.privacy.base import MECHANISM_REGISTRY, Mechanism
from protofl.privacy.config import PrivacyConfig
from protofl.privacy.mechanisms import _PrototypeMechanism, release_many
from protofl.seeding import Stream, derive_seed

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


def gdp_lower_bound(
    stat_d: np.ndarray, stat_dprime: np.ndarray, delta: float, *, alpha: float = 0.05
) -> dict[str, float]:
    """(1 - alpha) lower bound on epsilon at ``delta`` for statistics that are Gaussian with one
    variance under D and D' (the mu-GDP model of the module docstring).

    mu_hat = |mean_D - mean_D'| / pooled sd; its standard error
    sqrt(1/n1 + 1/n0 + mu_hat^2 / (2 (n1 + n0))) (Hedges and Olkin, 1985); the two-sided
    (1 - alpha) interval's lower end mu_lo gives epsilon = gaussian_epsilon(1 / mu_lo, delta).
    """
    t1, t0 = np.asarray(stat_d, np.float64), np.asarray(stat_dprime, np.float64)
    n1, n0 = len(t1), len(t0)
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


def gdp_mu(epsilon: float, delta: float) -> float:
    """The mu of mu-GDP whose epsilon at ``delta`` is ``epsilon`` (for reports)."""
    lo, hi = 1e-6, 1.0
    while gaussian_epsilon(1.0 / hi, delta) < epsilon:
        hi *= 2.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if gaussian_epsilon(1.0 / mid, delta) < epsilon else (lo, mid)
    return hi


def min_trials(epsilon: float, delta: float, confidence: float, bounds: int = 2) -> int:
    """The fewest trials (per data set) with which the GDP bound is expected to flag a mechanism
    that adds half the noise it claims (mu twice the claimed mu): n with
    z * se(2 mu, n) < mu, se^2 = 2/n + (2 mu)^2 / (4 n), z at (1 - confidence) / bounds
    (two-sided).  At least 100 (the normal approximation's range)."""
    mu = gdp_mu(epsilon, delta)
    z = float(norm.ppf(1.0 - (1.0 - confidence) / bounds / 2.0))
    return max(100, math.ceil(z**2 * (2.0 + mu**2) / mu**2))


# --------------------------------------------------------------------------------------------
# claimed guarantee of one release
# --------------------------------------------------------------------------------------------
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


def per_release_epsilon(config: PrivacyConfig, *, rounds: int, dim: int) -> float:
    """The epsilon of ONE release of a mechanism calibrated for ``rounds`` releases (the first
    one, which carries any one-off selection), by the tight PLD composition."""
    events = claimed_events(config, rounds=rounds, dim=dim)[0]
    return epsilon_spent(_nonzero(events), delta=config.delta, accountant="pld")


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


def run_epsilon(config: PrivacyConfig, *, rounds: int, dim: int) -> float:
    """The epsilon of a whole run (``rounds`` releases of one client) of a mechanism calibrated
    for ``rounds`` releases, from the registered mechanism's ``release_events`` composed with
    the tight PLD accountant: the guarantee the audit tests."""
    events = [e for ev in claimed_events(config, rounds=rounds, dim=dim) for e in ev]
    return epsilon_spent(_nonzero(events), delta=config.delta, accountant="pld")


def _nonzero(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop pure events of epsilon 0 (a selection that costs nothing)."""
    return [e for e in events if not (e.get("kind") == "pure" and float(e["epsilon"]) == 0)]


def scaled_noise(cls: type[Mechanism], factor: float) -> type[Mechanism]:
    """A copy of mechanism class ``cls`` whose noise, added and stated, is ``factor`` times the
    calibrated one (``--noise-scale``): what an auditor with power must flag for factor < 1."""
    if not issubclass(cls, _PrototypeMechanism):
        raise ValueError(f"noise_scale needs a clipping mechanism (igpp, vpp), not {cls.__name__}")
    if factor == 1.0:
        return cls

    def _unit_std(self: Any, mask_a: torch.Tensor | None) -> torch.Tensor:
        return cls._unit_std(self, mask_a) * factor

    def _max_unit_std(self: Any) -> float:
        return float(cls._max_unit_std(self)) * factor

    return type(
        f"{cls.__name__}NoiseX{factor:g}",
        (cls,),
        {"_unit_std": _unit_std, "_max_unit_std": _max_unit_std},
    )


def _random_partition(mech: Mechanism, gen: torch.Generator) -> torch.Tensor:
    k = int(getattr(mech, "k", 1))
    mask = torch.zeros(mech.dim, dtype=torch.bool)
    mask[torch.randperm(mech.dim, generator=gen)[:k]] = True
    return mask


def _fast_trials(
    mech: Mechanism, data: CanaryData, trials: int, rounds: int, gen: torch.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """S per trial from the noiseless releases (one per data set and round; VPP: a random
    partition per round) plus drawn Gaussian noise of the stated std, in chunks."""
    noiseless = getattr(mech, "noiseless_release", None)
    if noiseless is None:
        raise ValueError(f"mechanism {mech.name!r} has no noiseless_release(); use mode='release'")
    stats = []
    chunk = max(1, 4_000_000 // (mech.dim * rounds))
    for feats in (data.features_d, data.features_dprime):
        rows = []
        for _ in range(rounds):
            kwargs: dict[str, Any] = {"num_classes": data.num_classes}
            if hasattr(mech, "k"):  # VPP: for the flat canary every partition is alike
                kwargs["partition"] = _random_partition(mech, gen)
            rel = noiseless(feats, data.labels, **kwargs)
            row = _canary_row(rel, data.canary_class)
            rows.append((rel.prototypes[row].double(), rel.noise_std[row].double()))
        p = torch.stack([r[0] for r in rows])  # [T, d]
        std = torch.stack([r[1] for r in rows])
        out = np.zeros(trials)
        for a in range(0, trials, chunk):
            b = min(trials, a + chunk)
            noise = torch.randn((b - a, rounds, mech.dim), generator=gen, dtype=torch.float64)
            released = p + noise * std
            out[a:b] = _statistic(released, std.expand_as(released), data.direction).sum(axis=1)
        stats.append(out)
    return stats[0], stats[1]


def _release_trials(
    build: Any, data: CanaryData, trials: int, rounds: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """S per trial from real releases: ``trials`` canary clients, each releasing ``rounds``
    times through one mechanism calibrated for ``rounds`` releases."""
    stats = []
    for tag, feats in ((1, data.features_d), (2, data.features_dprime)):
        mech = build()
        names = [f"audit-{tag}-{t}" for t in range(trials)]
        gens = [
            torch.Generator().manual_seed(derive_seed(seed, Stream.AUDIT, tag, t))
            for t in range(trials)
        ]
        out = np.zeros(trials)
        for _ in range(rounds):
            releases = release_many(
                mech,
                [feats] * trials,
                [data.labels] * trials,
                num_classes=data.num_classes,
                generators=gens,
                clients=names,
            )
            for t, rel in enumerate(releases):
                row = _canary_row(rel, data.canary_class)
                out[t] += float(_statistic(rel.prototypes[row], rel.noise_std[row], data.direction))
        stats.append(out)
    return stats[0], stats[1]


def _bounds(
    s1: np.ndarray, s0: np.ndarray, delta: float, alpha: float
) -> tuple[float, dict[str, Any]]:
    """Both bounds of one mode at ``alpha`` each; the larger and the details."""
    gdp = gdp_lower_bound(s1, s0, delta, alpha=alpha)
    cp = epsilon_lower_bound(s1, s0, delta, alpha=alpha)
    res: dict[str, Any] = {
        "epsilon_lower_bound": max(gdp["epsilon_lower_bound"], cp["epsilon_lower_bound"]),
        "gdp": gdp,
        "clopper_pearson": cp,
        "fpr": cp["fpr"],
        "fnr": cp["fnr"],
        "separation": cp["separation"],
    }
    return float(res["epsilon_lower_bound"]), res


def audit_mechanism(
    mechanism: str | type[Mechanism],
    epsilon: float,
    *,
    delta: float = 1e-5,
    trials: int = 100_000,
    release_trials: int = 2_000,
    mode: str = "both",
    rounds: int = 20,
    confidence: float = 0.99,
    noise_scale: float = 1.0,
    dim: int = 32,
    clip: float = 1.0,
    canary_scale: float = 10.0,
    seed: int = 0,
    **privacy: Any,
) -> dict[str, Any]:
    """Audit a whole run (``rounds`` releases of a canary client) of ``mechanism`` (a
    registered name or a Mechanism subclass, e.g. a deliberately broken one) calibrated for
    (epsilon, delta) over ``rounds`` releases.

    Returns a JSON-safe dict with ``epsilon_claimed`` (the whole run's), ``epsilon_lower_bound``
    (at ``confidence``), ``confidence``, ``trials``, ``violation`` (lower bound > claimed),
    ``seconds`` and the details of each mode.  ``privacy`` holds further ``PrivacyConfig``
    fields.
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
    modes = ("fast", "release") if mode == "both" else (mode,)
    bounds_count = 2 * len(modes)
    need = min_trials(float(epsilon), float(delta), float(confidence), bounds_count)
    counts = {"fast": trials, "release": release_trials if mode == "both" else trials}
    for m in modes:
        n = counts[m]
        key = "trials" if m == "fast" or mode != "both" else "release_trials"
        if isinstance(n, bool) or not isinstance(n, int) or n < need:
            raise ValueError(
                f"{key}={n!r} is too few for confidence {confidence:g} at epsilon {epsilon:g}: "
                f"at least {need} are needed to flag a mechanism that adds half the noise it "
                "claims"
            )
    name = mechanism if isinstance(mechanism, str) else mechanism.name
    if name not in ("igpp", "vpp", "vpdr"):
        _fail("mechanism", name, "igpp, vpp, vpdr (or a subclass of igpp or vpp)")
    privacy.setdefault("warn_min_count", 0)  # the tiny canary class is deliberate
    config = PrivacyConfig(
        mechanism=name, epsilon=float(epsilon), delta=float(delta), clip=clip, **privacy
    )
    if config.neighbouring != "replace_one":
        _fail("neighbouring", config.neighbouring, "replace_one (the audit's relation)")
    cls = MECHANISM_REGISTRY.get(config.base_mechanism) if isinstance(mechanism, str) else mechanism
    cls = scaled_noise(cls, float(noise_scale))

    def build() -> Mechanism:
        return cls(config, rounds=rounds, dim=dim)

    claimed = run_epsilon(config, rounds=rounds, dim=dim)
    data = make_canary_data(dim, clip, canary_scale=canary_scale, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    alpha = (1.0 - float(confidence)) / bounds_count
    mech = build()
    out: dict[str, Any] = {
        "mechanism": name if isinstance(mechanism, str) else mechanism.__name__,
        "epsilon": float(epsilon),
        "delta": float(delta),
        "rounds": rounds,
        "epsilon_claimed": claimed,
        "mu_claimed": gdp_mu(claimed, float(delta)),
        "confidence": float(confidence),
        "noise_scale": float(noise_scale),
        "dim": dim,
        "clip": clip,
        "canary_scale": canary_scale,
        "seed": seed,
        "mode": mode,
        "modes": {},
        "sigma": float(getattr(mech, "sigma", math.nan)),
    }
    started = time.perf_counter()
    bounds = []
    threads = torch.get_num_threads()
    from protofl.report.progress import note

    for m in modes:
        t0 = time.perf_counter()
        note(f"audit, {m} mode: {counts[m]} trials x {rounds} releases per data set ...")
        if m == "fast":
            s1, s0 = _fast_trials(mech, data, counts[m], rounds, gen)
        else:
            torch.set_num_threads(1)  # tiny tensors: threads only add contention
            try:
                s1, s0 = _release_trials(build, data, counts[m], rounds, seed)
            finally:
                torch.set_num_threads(threads)
        bound, res = _bounds(s1, s0, float(delta), alpha)
        res.update(trials=counts[m], seconds=time.perf_counter() - t0)
        out["modes"][m] = res
        bounds.append(bound)
    if mode == "both":
        out["release_trials"] = counts["release"]
    out["epsilon_lower_bound"] = max(bounds)
    out["trials"] = counts[modes[0]]
    out["seconds"] = time.perf_counter() - started
    out["violation"] = bool(out["epsilon_lower_bound"] > claimed)
    return out
