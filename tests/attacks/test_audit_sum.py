"""The secure-sum audit: the calibrated ddg passes from the server's view, a copy with half the
noise under the same claim is flagged, and the claim is never looser than the point claim."""

from __future__ import annotations

import pytest

from protofl.attacks.audit_sum import audit_secure_sum, sum_claim
from protofl.attacks.cli import main
from protofl.attacks.verdict import point_claim


def test_the_calibrated_mechanism_passes_and_half_the_noise_is_flagged() -> None:
    ok = audit_secure_sum(1.0, rounds=1, trials=20_000, seed=3)
    assert not ok["violation"]
    assert ok["accuracy_lower_bound"] <= ok["accuracy_claimed_max"]
    assert ok["epsilon_lower_bound"] <= ok["epsilon_claimed"] <= 1.0
    broken = audit_secure_sum(1.0, rounds=1, trials=20_000, seed=3, noise_scale=0.5)
    assert broken["violation"]


def test_add_remove_is_audited_with_the_canary_present_or_absent() -> None:
    res = audit_secure_sum(1.0, rounds=2, trials=4_000, neighbouring="add_remove", seed=1)
    assert not res["violation"]


def test_the_claim_is_the_ledgers_epsilon_with_a_kl_bound_below_the_point_claim() -> None:
    ev = {"kind": "ddg", "l2": 100.0, "l1": 400.0, "sigma": 200.0, "clients": 10, "dim": 16}
    claim = sum_claim([ev] * 3, 1e-5)
    assert claim.tv < point_claim(claim.epsilon, 1e-5).tv
    # Gaussian limit: KL = T * l2^2 / (2 n sigma^2)
    assert claim.tv == pytest.approx((3 * 100.0**2 / (2 * 10 * 200.0**2) / 2) ** 0.5, rel=1e-6)


def test_the_cli_audits_ddg_from_the_sum_and_refuses_per_release_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["audit", "--mechanism", "ddg", "--epsilon", "1", "--rounds", "1", "--trials", "640"]
    assert main([*args, "--json"]) == 0
    assert '"mechanism": "ddg"' in capsys.readouterr().out
    assert main([*args, "--mode", "fast"]) == 2
    assert "audited from the decoded sum only" in capsys.readouterr().err
