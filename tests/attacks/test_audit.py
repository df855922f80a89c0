from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from protofl.attacks.audit import (
    audit_mechanism,
    clopper_pearson,
    epsilon_lower_bound,
    gdp_lower_bound,
    gdp_mu,
    make_canary_data,
    min_trials,
    per_release_epsilon,
    run_epsilon,
)
from protofl.attacks.broken import (
    AddsHalfTheStatedNoise,
    Eq19Broken,
    HalfNoise,
    NoiseTimes07,
    true_run_epsilon,
)
from protofl.privacy import PrivacyConfig
from protofl.privacy.accounting import gaussian_epsilon
from protofl.privacy.mechanisms import IGPP, VPP, clip_groups, clip_l2


class TenfoldLessNoise(IGPP):
    """Broken on purpose: calibrated for epsilon, but adds a tenth of the noise."""

    def __init__(self, config: PrivacyConfig, *, rounds: int, dim: int) -> None:
        super().__init__(config, rounds=rounds, dim=dim)
        self.sigma /= 10.0


class SkipsClipping(IGPP):
    """Broken on purpose: no per-example clipping."""

    def _clip(self, features: torch.Tensor, mask_a: torch.Tensor | None) -> torch.Tensor:
        return features


class UnderstatesNoise(IGPP):
    """Broken on purpose: states the calibrated noise std but adds a tenth of it (only the
    end-to-end mode can see this)."""

    def _noisy(self, built, generator, dtype):  # type: ignore[no-untyped-def]
        built.noise_std = built.noise_std / 10.0
        protos, classes, counts, sens, std = super()._noisy(built, generator, dtype)
        return protos, classes, counts, sens, std * 10.0


FAST = {"trials": 4000, "release_trials": 300, "seed": 0}


@pytest.mark.parametrize("broken", [TenfoldLessNoise, SkipsClipping])
def test_audit_flags_broken_mechanisms_in_both_modes(broken: type[IGPP]) -> None:
    out = audit_mechanism(broken, 1.0, **FAST)
    assert out["violation"] is True
    assert out["modes"]["fast"]["epsilon_lower_bound"] > out["epsilon_claimed"]
    assert out["modes"]["release"]["epsilon_lower_bound"] > out["epsilon_claimed"]


def test_only_the_end_to_end_mode_sees_noise_that_is_understated() -> None:
    out = audit_mechanism(UnderstatesNoise, 1.0, **FAST)
    assert out["modes"]["fast"]["epsilon_lower_bound"] < out["epsilon_claimed"]
    assert out["modes"]["release"]["epsilon_lower_bound"] > out["epsilon_claimed"]
    assert out["violation"] is True


@pytest.mark.parametrize("mechanism", ["igpp", "vpp"])
@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_audit_passes_the_correct_mechanisms(mechanism: str, epsilon: float) -> None:
    out = audit_mechanism(mechanism, epsilon, **FAST)
    assert out["violation"] is False
    assert 0.0 <= out["epsilon_lower_bound"] <= out["epsilon_claimed"]
    assert out["epsilon_claimed"] == pytest.approx(epsilon, rel=1e-3)
    assert out["trials"] == FAST["trials"]
    if epsilon == 4.0:  # the test has power: a real, non-trivial bound
        assert out["modes"]["fast"]["epsilon_lower_bound"] > 1.0


def test_canary_sits_on_every_clipping_boundary() -> None:
    data = make_canary_data(32, 1.0, canary_scale=10.0)
    x = data.features_d[:1]
    assert torch.allclose(clip_l2(x, 1.0), data.direction.unsqueeze(0), atol=1e-12)
    vpp = VPP(PrivacyConfig(mechanism="vpp", clip=1.0), rounds=1, dim=32)
    mask = torch.zeros(32, dtype=torch.bool)
    mask[torch.randperm(32)[: vpp.k]] = True
    clipped = clip_groups(x, mask, vpp.radius_a, vpp.radius_b)
    assert torch.allclose(clipped, data.direction.unsqueeze(0), atol=1e-12)
    assert torch.equal(data.features_d[1:], data.features_dprime[1:])


def test_per_release_epsilon_of_a_multi_round_calibration() -> None:
    for name in ("igpp", "vpp"):
        cfg = PrivacyConfig(mechanism=name, epsilon=2.0)
        one = per_release_epsilon(cfg, rounds=1, dim=32)
        many = per_release_epsilon(cfg, rounds=20, dim=32)
        assert one == pytest.approx(2.0, rel=1e-3) and one <= 2.0 + 1e-9
        assert many < 0.5 * one
        # the audit's claim is the whole run's: T releases compose back to the budget
        run = run_epsilon(cfg, rounds=20, dim=32)
        assert run == pytest.approx(2.0, rel=1e-3) and run <= 2.0 + 1e-9
    out = audit_mechanism("igpp", 1.0, rounds=20, mode="fast", trials=2000)
    assert out["epsilon_claimed"] == pytest.approx(1.0, rel=1e-3) and out["violation"] is False


# ----- deliberate bugs whose true epsilon is 1.3-2.2 at a claimed 1 (the old audit passed them)
STRONG = {"trials": 100_000, "seed": 0}


@pytest.mark.parametrize(
    ("broken", "mode", "true_low"),
    [
        (HalfNoise, "fast", 2.1),
        (NoiseTimes07, "fast", 1.45),
        (Eq19Broken, "fast", 1.25),
        (AddsHalfTheStatedNoise, "release", 2.1),
    ],
)
def test_the_audit_flags_every_deliberate_bug_at_epsilon_1(
    broken: type[IGPP] | type[VPP], mode: str, true_low: float
) -> None:
    rounds = 20 if mode == "fast" else 5
    truth = broken(
        PrivacyConfig(mechanism=broken.name, epsilon=1.0, clip=1.0), rounds=rounds, dim=32
    )
    assert true_run_epsilon(truth, rounds) > true_low
    kwargs = STRONG if mode == "fast" else {"trials": 1500, "seed": 0}
    out = audit_mechanism(broken, 1.0, mode=mode, rounds=rounds, **kwargs)
    assert out["violation"] is True
    assert out["epsilon_lower_bound"] > out["epsilon_claimed"] == pytest.approx(1.0, rel=1e-3)
    assert out["confidence"] == 0.99 and out["rounds"] == rounds


@pytest.mark.parametrize("mechanism", ["igpp", "vpp"])
@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_the_strong_audit_never_flags_a_shipped_mechanism(mechanism: str, epsilon: float) -> None:
    out = audit_mechanism(mechanism, epsilon, mode="fast", **STRONG)
    assert out["violation"] is False
    # and it is tight: the bound is within 10% of the claim
    assert 0.9 * out["epsilon_claimed"] < out["epsilon_lower_bound"] <= out["epsilon_claimed"]


def test_noise_scale_checks_the_auditor() -> None:
    low = audit_mechanism("igpp", 1.0, mode="fast", noise_scale=0.7, **STRONG)
    assert low["violation"] is True and low["noise_scale"] == 0.7
    high = audit_mechanism("vpp", 1.0, mode="fast", noise_scale=1.5, trials=20_000)
    assert high["violation"] is False
    with pytest.raises(ValueError, match="noise_scale"):
        audit_mechanism("igpp", 1.0, noise_scale=0.0)


def test_too_few_trials_for_the_confidence_names_the_minimum() -> None:
    need = min_trials(1.0, 1e-5, 0.999, 2)
    assert need > min_trials(1.0, 1e-5, 0.99, 2) > 100
    with pytest.raises(ValueError, match=f"at least {need}"):
        audit_mechanism("igpp", 1.0, mode="fast", trials=need - 1, confidence=0.999)
    with pytest.raises(ValueError, match="release_trials"):
        audit_mechanism("igpp", 1.0, trials=5000, release_trials=150)


def test_gdp_bound_recovers_mu_and_is_conservative() -> None:
    rng = np.random.default_rng(0)
    mu = 0.5
    out = gdp_lower_bound(rng.normal(mu, 1, 200_000), rng.normal(0, 1, 200_000), 1e-5)
    assert out["mu_hat"] == pytest.approx(mu, abs=0.02) and out["mu_lower"] < mu
    assert out["epsilon_lower_bound"] < gaussian_epsilon(1 / mu, 1e-5)
    assert gdp_mu(gaussian_epsilon(1 / mu, 1e-5), 1e-5) == pytest.approx(mu, rel=1e-6)
    same = gdp_lower_bound(rng.normal(size=5000), rng.normal(size=5000), 1e-5)
    assert same["epsilon_lower_bound"] < 0.1


def test_clopper_pearson_and_the_bound_on_identical_distributions() -> None:
    lo, hi = clopper_pearson(np.array([0, 50, 100]), 100)
    assert lo[0] == 0.0 and hi[0] == pytest.approx(1 - 0.025 ** (1 / 100))
    assert lo[1] < 0.5 < hi[1] and hi[2] == 1.0
    rng = np.random.default_rng(0)
    same = epsilon_lower_bound(rng.normal(size=5000), rng.normal(size=5000), 1e-5)
    assert same["epsilon_lower_bound"] < 0.1
    far = epsilon_lower_bound(rng.normal(size=5000) + 6, rng.normal(size=5000), 1e-5)
    assert far["epsilon_lower_bound"] > 5.0  # ~log(2500/ln(40)): limited by the trial count


def test_bad_parameters_fail_naming_them() -> None:
    with pytest.raises(ValueError, match="trials"):
        audit_mechanism("igpp", 1.0, trials=99)
    with pytest.raises(ValueError, match="epsilon"):
        audit_mechanism("igpp", 0.0)
    with pytest.raises(ValueError, match="epsilon"):
        audit_mechanism("igpp", -1.0)
    with pytest.raises(ValueError, match="epsilon"):
        audit_mechanism("igpp", math.inf)
    with pytest.raises(ValueError, match="mechanism"):
        audit_mechanism("none", 1.0)
    with pytest.raises(ValueError, match="mode"):
        audit_mechanism("igpp", 1.0, mode="slow")
