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
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from protofl.attacks.verdict import (
    audit_statistics,
    claim_from_events,
    gdp_mu,
    point_claim,
)
from protofl.privacy.accounting import epsilon_spent
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


def _fail(name: str, value: object, allowed: str) -> None:
    raise ValueError(f"{name}={value!r} is out of range; allowed: {allowed}")


# --------------------------------------------------------------------------------------------
# the claim under test (the registered mechanism's events; the verdict is protofl.attacks.verdict)
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
