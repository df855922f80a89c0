"""Empirical audit of ``privacy.mechanism: ddg`` (the distributed discrete Gaussian over a
secure sum) from the server's view: the decoded sum.

A trial is one canary in a whole run of T secure sums.  In every block, ``clients`` clients
release T times through ONE mechanism bound to that federation, exactly as in a run; client 0
holds ``canaries`` classes of one example each: the canary ``b s R u_k`` (replace-one: b = +-1,
a fresh fair coin; add/remove: the canary or a zero example, which rounds to nothing), ``u_k`` a
flat unit direction and ``s`` (10) far beyond the clip, so per-example clipping puts it on the
boundary; the other clients hold zero examples (their shares are pure noise, released through
the same code).  The server decodes each round's sum (:meth:`secure_sum`); the statistic per
canary is ``S = sum_t u_k . (class sum_t of class k)``, the Neyman-Pearson statistic for the
(nearly Gaussian) noise of the sum.

The claim is the run's: epsilon at delta from the ledger's events (Proposition 14, RDP), and
for the balanced test the total-variation bound ``sqrt(KL/2)`` (Pinsker) with KL the events'
Renyi bound at alpha = 1, capped by the (epsilon, delta) point claim: valid for any test, so
the verdict (:func:`~protofl.attacks.verdict.audit_statistics`) is model-free.  ``noise_scale``
audits a copy whose noise is F times the calibrated one under the same claim (F < 1 must be
flagged: the auditor's own check).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from protofl.attacks.verdict import Claim, audit_statistics, point_claim
from protofl.privacy.accounting import epsilon_spent
from protofl.privacy.config import PrivacyConfig
from protofl.privacy.ddg import DistributedDiscreteGaussian, Federation
from protofl.privacy.ddg_accounting import check_event, ddg_rdp


def sum_claim(events: list[dict[str, Any]], delta: float) -> Claim:
    """The run's claim: epsilon at ``delta`` (the ledger's composition) and a fair-coin guess
    right with probability at most (1 + tv)/2, tv = min(sqrt(KL/2), the point claim's)."""
    eps = epsilon_spent(events, delta=delta)
    kl = 0.0
    for ev in events:
        l2, l1, sigma, n, d = check_event(ev)
        kl += float(ddg_rdp(1.0, l2=l2, l1=l1, sigma=sigma, clients=n, dim=d))
    tv = min(math.sqrt(kl / 2.0), point_claim(eps, delta).tv)
    return Claim("kl", float(eps), float(delta), float(tv))


def _block_stats(
    mech: DistributedDiscreteGaussian,
    names: list[str],
    coins: torch.Tensor,
    u: torch.Tensor,
    rounds: int,
    size: float,
    gen: torch.Generator,
) -> torch.Tensor:
    """One block: client 0 holds the canaries (``coins``: True is D), the others zeros; each of
    ``rounds`` secure sums is decoded and every canary's S accumulated."""
    canaries, dim = u.shape
    coin = coins.double()
    # replace-one: D +canary, D' -canary; add/remove: D the canary, D' a zero example
    sign = 2.0 * coin - 1.0 if mech.config.neighbouring == "replace_one" else coin
    canary = size * sign[:, None] * u.double()
    zeros = torch.zeros(canaries, dim, dtype=torch.float64)
    labels = torch.arange(canaries)
    s = torch.zeros(canaries, dtype=torch.float64)
    for _ in range(rounds):
        shares = [
            mech.release(
                canary if i == 0 else zeros,
                labels,
                num_classes=canaries,
                generator=gen,
                client=name,
            )
            for i, name in enumerate(names)
        ]
        ((_, agg),) = mech.secure_sum(shares)
        sums = agg.prototypes.double() * agg.counts.double()[:, None]
        s += (sums * u.double()).sum(dim=1)
    return s


def _bound_mechanism(
    config: PrivacyConfig, rounds: int, dim: int, names: list[list[str]], canaries: int
) -> DistributedDiscreteGaussian:
    """One mechanism for every block, bound to a federation of one block's clients."""
    mech = DistributedDiscreteGaussian(config, rounds=rounds, dim=dim)
    mech.bind(
        Federation(
            groups={n: 0 for block in names for n in block},
            num_groups=1,
            num_classes=canaries,
            per_round=len(names[0]),
            examples=len(names[0]) * canaries,
        )
    )
    return mech


def audit_secure_sum(
    epsilon: float,
    *,
    delta: float = 1e-5,
    trials: int = 2000,
    rounds: int = 1,
    clients: int = 10,
    dim: int = 16,
    canaries: int = 64,
    confidence: float = 0.99,
    noise_scale: float = 1.0,
    clip: float = 1.0,
    canary_scale: float = 10.0,
    neighbouring: str = "replace_one",
    max_dropped: int = 0,
    seed: int = 0,
) -> dict[str, Any]:
    """Audit ``trials`` canaries, each through a whole run of ``rounds`` secure sums of
    ``clients`` clients (module doc); the same JSON-safe shape as
    :func:`~protofl.attacks.audit.audit_mechanism` (one mode, ``sum``)."""
    if isinstance(clients, bool) or not isinstance(clients, int) or clients < 1:
        raise ValueError(f"clients={clients!r} is out of range; allowed: integers >= 1")
    if not (math.isfinite(noise_scale) and noise_scale > 0):
        raise ValueError(f"noise_scale={noise_scale!r} is out of range; allowed: (0, inf)")
    t0 = time.perf_counter()
    config = PrivacyConfig(
        mechanism="ddg",
        epsilon=float(epsilon),
        delta=float(delta),
        clip=clip,
        neighbouring=neighbouring,
        ddg_max_dropped=max_dropped,
        warn_min_count=0,
    )
    blocks = max(1, math.ceil(trials / canaries))
    names = [[f"{b}/{i}" for i in range(clients)] for b in range(blocks)]
    mech = _bound_mechanism(config, rounds, dim, names, canaries)
    claim = sum_claim(mech.release_events(0) * rounds, delta)
    mech.sigma *= noise_scale  # added and stated; the claim above is the calibrated one's
    gen = torch.Generator().manual_seed(seed)
    signs_all = torch.rand(blocks, canaries, generator=gen) < 0.5
    u = torch.where(torch.rand(canaries, dim, generator=gen) < 0.5, -1.0, 1.0) / math.sqrt(dim)
    stats = [
        _block_stats(mech, names[b], signs_all[b], u, rounds, canary_scale * clip, gen)
        for b in range(blocks)
    ]
    stat = torch.cat(stats).numpy()[:trials]
    signs = signs_all.flatten().numpy()[:trials]
    res = audit_statistics(stat, signs, claim, alpha=1.0 - confidence, block=canaries)
    seconds = time.perf_counter() - t0
    res.update({"trials": len(stat), "canaries_per_client": canaries, "seconds": seconds})
    return {
        "mechanism": "ddg",
        "violation": bool(res["violation"]),
        "epsilon": float(epsilon),
        "delta": float(delta),
        "rounds": rounds,
        "clients": clients,
        "noise_scale": float(noise_scale),
        "confidence": float(confidence),
        "claim": "kl",
        "epsilon_claimed": claim.epsilon,
        "accuracy_claimed_max": claim.accuracy_max,
        "mu_claimed": math.nan,  # the claim is a KL / (epsilon, delta) one, not mu-GDP
        "epsilon_lower_bound": res["epsilon_lower_bound"],
        "accuracy_lower_bound": res["accuracy_lower_bound"],
        "mu_lower_bound": res["mu_lower_bound"],
        "epsilon_gdp_refuted": res["epsilon_gdp_refuted"],
        "modes": {"sum": res},
        "seconds": seconds,
        "wrap_probability": float(mech.wrap),
    }


__all__ = ["audit_secure_sum", "sum_claim"]
