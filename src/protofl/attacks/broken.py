"""Deliberately broken mechanisms, for checking an auditor (tests, experiments/audit_bugs.py),
and one correct non-Gaussian reference.

Each bug is calibrated for a claimed (epsilon, delta) but releases with more privacy loss; an
audit with power must flag every one.  :func:`true_run_epsilon` is the epsilon each really has.
:class:`LaplaceReference` is correct (pure DP, its claim is :func:`laplace_claim`): an audit
must never flag it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from protofl.privacy.accounting import compose_epsilon
from protofl.privacy.config import PrivacyConfig
from protofl.privacy.igpp import IGPP
from protofl.privacy.noise import NoiseSource
from protofl.privacy.vpp import VPP, laplace_noise


class HalfNoise(IGPP):
    """Half the calibrated noise multiplier, stated consistently (true epsilon 2.15 at 1)."""

    noise_factor = 0.5

    def __init__(self, config: PrivacyConfig, *, rounds: int, dim: int) -> None:
        super().__init__(config, rounds=rounds, dim=dim)
        self.sigma *= self.noise_factor


class NoiseTimes07(HalfNoise):
    """0.7 times the calibrated noise multiplier (true epsilon 1.48 at 1)."""

    noise_factor = 0.7


class StatesMoreThanItAdds(IGPP):
    """States the calibrated noise std but adds ``added`` (0.8) times it (true epsilon 1.28 at
    1): only an end-to-end audit sees it.  :func:`states_more_than_it_adds` makes other
    fractions."""

    added = 0.8

    def _noisy(self, built: Any, generator: NoiseSource, dtype: torch.dtype) -> Any:
        built.noise_std = built.noise_std * self.added
        protos, classes, counts, sens, std = super()._noisy(built, generator, dtype)
        return protos, classes, counts, sens, std / self.added


class AddsHalfTheStatedNoise(StatesMoreThanItAdds):
    """States the calibrated noise std but adds half of it (true epsilon 2.15 at 1)."""

    added = 0.5


def states_more_than_it_adds(added: float) -> type[StatesMoreThanItAdds]:
    """A :class:`StatesMoreThanItAdds` that adds ``added`` times the noise it states."""
    if not 0 < added <= 1:
        raise ValueError(f"added={added!r} is out of range; allowed: (0, 1]")
    return type(f"StatesMoreThanItAddsX{added:g}", (StatesMoreThanItAdds,), {"added": added})


class Eq19Broken(VPP):
    """Group B gets sigma_ref instead of sigma_ref / sqrt(w_B), so 1/sigma_A^2 + 1/sigma_B^2 >
    1/sigma_ref^2: VPDR Eq. (19) fails (true epsilon 1.32 at 1)."""

    def __init__(self, config: PrivacyConfig, *, rounds: int, dim: int) -> None:
        super().__init__(config, rounds=rounds, dim=dim)
        self.budget = dataclasses.replace(self.budget, sigma_B=self.budget.sigma_ref)


BUGS = (HalfNoise, NoiseTimes07, AddsHalfTheStatedNoise, StatesMoreThanItAdds, Eq19Broken)


class LaplaceReference(IGPP):
    """CORRECT pure epsilon-DP for a whole run (replace-one): IGPP's clipping and class means,
    then Laplace noise per dimension of scale ``sqrt(d) * (2R/n) / (epsilon / rounds)`` (the L1
    sensitivity of a class mean of L2-clipped examples over the per-release budget); it states
    the Laplace std ``sqrt(2) * scale``.  Its claim is :func:`laplace_claim` (its ledger events
    are IGPP's: a reference for the audit only, not a mechanism to run).  It has no
    ``noiseless_release``: the audit's fast mode simulates Gaussian noise, which is not its
    noise."""

    def noiseless_release(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            "LaplaceReference adds Laplace noise: a Gaussian simulation (the audit's fast mode) "
            "is not this mechanism; audit it with mode='release'"
        )

    def _noisy(self, built: Any, generator: NoiseSource, dtype: torch.dtype) -> Any:
        if self.config.neighbouring != "replace_one":
            raise ValueError("LaplaceReference is calibrated for neighbouring=replace_one")
        per_release = self.config.epsilon / self.rounds
        sens = built.sensitivity.to(device=built.protos.device, dtype=torch.float64)
        scale = (math.sqrt(self.dim) * sens / per_release).unsqueeze(1)
        noise = laplace_noise(tuple(built.protos.shape), 1.0, generator).to(built.protos.device)
        protos = built.protos + (noise * scale).to(dtype)
        std = (math.sqrt(2.0) * scale).expand(built.protos.shape).to(dtype)
        return protos, built.classes, built.counts, built.sensitivity, std


def laplace_claim(epsilon: float, rounds: int) -> list[dict[str, Any]]:
    """The DP events of a whole run of :class:`LaplaceReference`: ``rounds`` pure releases."""
    return [{"kind": "pure", "epsilon": epsilon / rounds} for _ in range(rounds)]


def true_run_epsilon(mech: IGPP | VPP, rounds: int, delta: float = 1e-5) -> float:
    """The epsilon of ``rounds`` releases of ``mech`` with the noise it really adds (PLD)."""
    if isinstance(mech, VPP):
        b = mech.budget
        inv = 1 / b.sigma_A**2 + 1 / b.sigma_B**2
        return compose_epsilon(rounds * inv, {b.eps_select: rounds}, delta=delta)
    scale = mech.added if isinstance(mech, StatesMoreThanItAdds) else 1.0
    return compose_epsilon(rounds / (scale * mech.sigma) ** 2, {}, delta=delta)
