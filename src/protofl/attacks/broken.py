"""Deliberately broken mechanisms, for checking an auditor (tests, experiments/audit_bugs.py).

Each is calibrated for a claimed (epsilon, delta) but releases with more privacy loss; an audit
with power must flag every one.  :func:`true_run_epsilon` is the epsilon each really has.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from protofl.privacy.accounting import compose_epsilon
from protofl.privacy.config import PrivacyConfig
from protofl.privacy.mechanisms import IGPP, VPP


class HalfNoise(IGPP):
    """Half the calibrated noise multiplier, stated consistently (true epsilon 2.16 at 1)."""

    noise_factor = 0.5

    def __init__(self, config: PrivacyConfig, *, rounds: int, dim: int) -> None:
        super().__init__(config, rounds=rounds, dim=dim)
        self.sigma *= self.noise_factor


class NoiseTimes07(HalfNoise):
    """0.7 times the calibrated noise multiplier (true epsilon 1.48 at 1)."""

    noise_factor = 0.7


class AddsHalfTheStatedNoise(IGPP):
    """States the calibrated noise std but adds half of it (only an end-to-end audit sees it)."""

    def _noisy(self, built: Any, generator: torch.Generator, dtype: torch.dtype) -> Any:
        built.noise_std = built.noise_std / 2.0
        protos, classes, counts, sens, std = super()._noisy(built, generator, dtype)
        return protos, classes, counts, sens, std * 2.0


class Eq19Broken(VPP):
    """Group B gets sigma_ref instead of sigma_ref / sqrt(w_B), so 1/sigma_A^2 + 1/sigma_B^2 >
    1/sigma_ref^2: VPDR Eq. (19) fails (true epsilon 1.32 at 1)."""

    def __init__(self, config: PrivacyConfig, *, rounds: int, dim: int) -> None:
        super().__init__(config, rounds=rounds, dim=dim)
        self.budget = dataclasses.replace(self.budget, sigma_B=self.budget.sigma_ref)


BUGS = (HalfNoise, NoiseTimes07, AddsHalfTheStatedNoise, Eq19Broken)


def true_run_epsilon(mech: IGPP | VPP, rounds: int, delta: float = 1e-5) -> float:
    """The epsilon of ``rounds`` releases of ``mech`` with the noise it really adds (PLD)."""
    if isinstance(mech, VPP):
        b = mech.budget
        inv = 1 / b.sigma_A**2 + 1 / b.sigma_B**2
        return compose_epsilon(rounds * inv, {b.eps_select: rounds}, delta=delta)
    scale = 0.5 if isinstance(mech, AddsHalfTheStatedNoise) else 1.0
    return compose_epsilon(rounds / (scale * mech.sigma) ** 2, {}, delta=delta)
