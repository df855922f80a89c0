"""The end-to-end audit: real releases by default, every deliberate bug flagged, no correct
mechanism flagged (Gaussian or Laplace)."""

from __future__ import annotations

import math

import pytest
import torch

from protofl.attacks import cli
from protofl.attacks.audit import (
    CANARIES,
    CLAIMS,
    MODES,
    TRIALS,
    audit_mechanism,
    make_canary_data,
    per_release_epsilon,
    run_epsilon,
    scaled_noise,
)
from protofl.attacks.broken import (
    BUGS,
    AddsHalfTheStatedNoise,
    Eq19Broken,
    HalfNoise,
    LaplaceReference,
    NoiseTimes07,
    StatesMoreThanItAdds,
    laplace_claim,
    states_more_than_it_adds,
    true_run_epsilon,
)
from protofl.privacy import PrivacyConfig
from protofl.privacy.igpp import IGPP
from protofl.privacy.prototype import clip_groups, clip_l2
from protofl.privacy.vpp import VPP


class TenfoldLessNoise(IGPP):
    """Broken on purpose: calibrated for epsilon, but adds a tenth of the noise."""

    def __init__(self, config: PrivacyConfig, *, rounds: int, dim: int) -> None:
        super().__init__(config, rounds=rounds, dim=dim)
        self.sigma /= 10.0


class SkipsClipping(IGPP):
    """Broken on purpose: no per-example clipping."""

    def _clip(self, features: torch.Tensor, mask_a: torch.Tensor | None) -> torch.Tensor:
        return features


def test_noise_x08_is_flagged_by_the_default_audit() -> None:
    """The CLI's defaults (release mode, 20 rounds, 64,000 trials, 99%): noise x0.8 at
    epsilon 1 (true epsilon 1.28) is a violation."""
    low = audit_mechanism("igpp", 1.0, noise_scale=0.8)
    assert low["mode"] == "release" and list(low["modes"]) == ["release"]
    assert low["trials"] == TRIALS and low["rounds"] == 20 and low["confidence"] == 0.99
    assert low["violation"] is True
    assert low["accuracy_lower_bound"] > low["accuracy_claimed_max"]
    assert low["mu_lower_bound"] > low["mu_claimed"] and low["epsilon_gdp_refuted"] > 1.0
    assert low["detectable_noise_scale"] > 0.8


def test_states_more_noise_than_it_adds_only_the_release_mode_sees_it() -> None:
    truth = StatesMoreThanItAdds(PrivacyConfig(mechanism="igpp", epsilon=1.0), rounds=2, dim=32)
    assert truth.added == 0.8 and true_run_epsilon(truth, 2) > 1.25
    out = audit_mechanism(StatesMoreThanItAdds, 1.0, mode="both", rounds=2, seed=0)
    assert out["modes"]["fast"]["violation"] is False  # it states the calibrated noise
    assert out["modes"]["release"]["violation"] is True
    assert out["violation"] is True and out["release_trials"] == TRIALS
    assert states_more_than_it_adds(0.5).added == 0.5
    with pytest.raises(ValueError, match="added"):
        states_more_than_it_adds(1.5)


@pytest.mark.parametrize(
    ("broken", "rounds", "trials", "true_low"),
    [
        (HalfNoise, 5, TRIALS, 2.1),
        (NoiseTimes07, 5, TRIALS, 1.45),
        (Eq19Broken, 5, TRIALS, 1.25),
        (AddsHalfTheStatedNoise, 2, 16_000, 2.1),
    ],
)
def test_the_release_audit_flags_every_deliberate_bug_at_epsilon_1(
    broken: type[IGPP] | type[VPP], rounds: int, trials: int, true_low: float
) -> None:
    assert broken in BUGS  # StatesMoreThanItAdds: test_states_more_noise_than_it_adds_...
    truth = broken(PrivacyConfig(mechanism=broken.name, epsilon=1.0), rounds=rounds, dim=32)
    assert true_run_epsilon(truth, rounds) > true_low
    out = audit_mechanism(broken, 1.0, rounds=rounds, trials=trials)
    assert out["violation"] is True
    assert out["epsilon_claimed"] == pytest.approx(1.0, rel=1e-3)
    assert out["accuracy_lower_bound"] > out["accuracy_claimed_max"]


@pytest.mark.parametrize("mechanism", ["igpp", "vpp"])
@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_the_release_audit_never_flags_a_shipped_mechanism(mechanism: str, epsilon: float) -> None:
    out = audit_mechanism(mechanism, epsilon, rounds=5)
    assert out["violation"] is False
    assert out["epsilon_claimed"] == pytest.approx(epsilon, rel=1e-3)
    assert out["epsilon_lower_bound"] <= out["epsilon_claimed"]
    assert out["accuracy_lower_bound"] <= out["accuracy_claimed_max"]
    if epsilon == 4.0:  # the test has power: a real, non-trivial bound
        assert out["mu_lower_bound"] > 0.8 * out["mu_claimed"]


@pytest.mark.parametrize("mechanism", ["igpp", "vpp"])
def test_the_fast_audit_is_tight_for_a_shipped_mechanism(mechanism: str) -> None:
    out = audit_mechanism(mechanism, 1.0, mode="fast", trials=400_000)
    assert out["violation"] is False
    assert 0.9 * out["mu_claimed"] < out["mu_lower_bound"] <= out["mu_claimed"] * 1.001


@pytest.mark.parametrize("broken", [TenfoldLessNoise, SkipsClipping])
def test_gross_bugs_are_flagged_in_both_modes(broken: type[IGPP]) -> None:
    out = audit_mechanism(broken, 1.0, mode="both", trials=4000, release_trials=4000, rounds=5)
    assert out["modes"]["release"]["flagged_balanced"] is True
    # fast mode's canaries are independent units: enough of them for the tail test too
    assert out["modes"]["fast"]["flagged_balanced"] and out["modes"]["fast"]["flagged_tail"]
    assert out["epsilon_lower_bound"] > out["epsilon_claimed"]


def test_a_correct_laplace_mechanism_is_never_flagged_end_to_end() -> None:
    """Pure 1-DP Laplace releases (d = 2, one release): the statistic is far from Gaussian and
    its GDP estimate (about 1.9) exceeds the claimed epsilon 1; the model-free verdict passes it
    against its own pure claim and against the point claim (1, 1e-5)."""
    for claim in (laplace_claim(1.0, 1), "point"):
        out = audit_mechanism(LaplaceReference, 1.0, rounds=1, dim=2, trials=20_000, claim=claim)
        assert out["violation"] is False
        assert out["modes"]["release"]["gdp_estimate"]["epsilon_lower_bound"] > 1.5
    # against IGPP's Gaussian profile it is (rightly) flagged: the accountant's events are not
    # its noise
    out = audit_mechanism(LaplaceReference, 1.0, rounds=1, dim=2, trials=20_000)
    assert out["claim"] == "profile" and out["violation"] is True
    # the fast mode's Gaussian simulation is not this mechanism: refused, not misjudged
    with pytest.raises(ValueError, match="Laplace noise"):
        audit_mechanism(LaplaceReference, 1.0, mode="fast", claim=laplace_claim(1.0, 20))


def test_canaries_sit_on_every_clipping_boundary() -> None:
    data = make_canary_data(32, 1.0, canaries=3, canary_scale=10.0)
    x = data.features(torch.tensor([[True, False, True]]))[0]
    canaries = x[:: data.class_size]
    u = data.directions * torch.tensor([[1.0], [-1.0], [1.0]])
    assert torch.allclose(clip_l2(canaries, 1.0), u, atol=1e-12)
    vpp = VPP(PrivacyConfig(mechanism="vpp", clip=1.0), rounds=1, dim=32)
    mask = torch.zeros(32, dtype=torch.bool)
    mask[torch.randperm(32)[: vpp.k]] = True
    assert torch.allclose(clip_groups(canaries, mask, vpp.radius_a, vpp.radius_b), u, atol=1e-12)
    assert x.abs().sum() == canaries.abs().sum()  # everything else is zero
    assert data.labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4


def test_per_release_epsilon_of_a_multi_round_calibration() -> None:
    for name in ("igpp", "vpp"):
        cfg = PrivacyConfig(mechanism=name, epsilon=2.0)
        one = per_release_epsilon(cfg, rounds=1, dim=32)
        many = per_release_epsilon(cfg, rounds=20, dim=32)
        assert one == pytest.approx(2.0, rel=1e-3) and one <= 2.0 + 1e-9
        assert many < 0.5 * one
        run = run_epsilon(cfg, rounds=20, dim=32)
        assert run == pytest.approx(2.0, rel=1e-3) and run <= 2.0 + 1e-9


def test_noise_scale_checks_the_auditor_on_the_batched_path() -> None:
    for base in (IGPP, VPP):
        scaled = scaled_noise(base, 0.5)
        assert scaled.vectorised is True  # the engine's batched release, fast
        mech = scaled(PrivacyConfig(mechanism=base.name, epsilon=1.0), rounds=5, dim=32)
        ref = base(PrivacyConfig(mechanism=base.name, epsilon=1.0), rounds=5, dim=32)
        assert mech._max_unit_std() == pytest.approx(0.5 * ref._max_unit_std())
    high = audit_mechanism("vpp", 1.0, noise_scale=1.5, rounds=5, trials=20_000)
    assert high["violation"] is False and high["noise_scale"] == 1.5
    with pytest.raises(ValueError, match="noise_scale"):
        audit_mechanism("igpp", 1.0, noise_scale=0.0)


def test_too_few_trials_are_refused() -> None:
    with pytest.raises(ValueError, match="trials=99 is too few: at least 100"):
        audit_mechanism("igpp", 1.0, trials=99)
    with pytest.raises(ValueError, match="release_trials"):
        audit_mechanism("igpp", 1.0, mode="both", trials=5000, release_trials=50)


def test_bad_parameters_fail_naming_them() -> None:
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
    with pytest.raises(ValueError, match="claim"):
        audit_mechanism("igpp", 1.0, claim="loose")
    with pytest.raises(ValueError, match="canaries"):
        audit_mechanism("igpp", 1.0, canaries=0)


def test_the_cli_defaults_are_the_audits() -> None:
    assert cli.AUDIT_TRIALS == TRIALS and cli.AUDIT_CANARIES == CANARIES
    assert cli.AUDIT_MODES == MODES and cli.AUDIT_CLAIMS == CLAIMS


def test_audit_cli_reports_a_violation_with_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["audit", "--mechanism", "igpp", "--epsilon", "1", "--rounds", "2"]
    assert cli.main([*argv, "--noise-scale", "0.5", "--trials", "8000"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION (99%, model-free)" in out and "right with probability" in out
    assert cli.main([*argv, "--trials", "8000", "--claim", "point"]) == 0
    assert "no violation" in capsys.readouterr().out
