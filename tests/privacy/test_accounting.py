"""Accounting: calibration against dp-accounting, the reference code's numbers, joint vs paper."""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import RdpAccountant
from hypothesis import given, settings
from hypothesis import strategies as st

from protofl.privacy.accounting import (
    ACCOUNTANTS,
    calibrate_gaussian,
    calibrate_joint,
    calibrate_vpp,
    epsilon_spent,
    gaussian_epsilon,
)
from protofl.privacy.cli import main as cli_main
from protofl.privacy.config import PrivacyConfig

DELTA = 1e-5


def gaussians(sigma: float, rounds: int) -> list[dict[str, object]]:
    return [{"kind": "gaussian", "noise_multiplier": sigma}] * rounds


def test_rdp_classic_reproduces_reference_code() -> None:
    assert round(calibrate_gaussian(1.0, DELTA, 20, "rdp-classic"), 2) == 21.92
    assert round(calibrate_gaussian(10.0, DELTA, 20, "rdp-classic"), 2) == 2.54
    # the reference code's VPP sigma (0.9 * epsilon for the release, basic composition)
    b = calibrate_vpp(1.0, DELTA, 20, split="paper", accountant="rdp-classic")
    assert round(b.sigma_ref, 2) == 24.30


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 4.0])
@pytest.mark.parametrize("rounds", [1, 20, 100])
def test_pld_is_the_exact_analytic_gaussian(epsilon: float, rounds: int) -> None:
    sigma = calibrate_gaussian(epsilon, DELTA, rounds, "pld")
    reference = dp_accounting.get_sigma_gaussian(epsilon, DELTA) * math.sqrt(rounds)
    assert sigma == pytest.approx(reference, rel=1e-6)
    # never rounded in the unsafe direction
    assert gaussian_epsilon(sigma / math.sqrt(rounds), DELTA) <= epsilon
    assert epsilon_spent(gaussians(sigma, rounds), delta=DELTA) <= epsilon


@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_pld_matches_independent_dp_accounting_pld(epsilon: float) -> None:
    rounds = 20
    sigma = calibrate_gaussian(epsilon, DELTA, rounds, "pld")
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma), rounds))
    assert acc.get_epsilon(DELTA) == pytest.approx(epsilon, rel=0.01)


def test_rdp_matches_dp_accounting_rdp() -> None:
    sigma = calibrate_gaussian(2.0, DELTA, 20, "rdp")
    acc = RdpAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma), 20))
    eps = acc.get_epsilon(DELTA)
    assert eps <= 2.0
    assert eps == pytest.approx(2.0, rel=1e-3)
    assert epsilon_spent(gaussians(sigma, 20), delta=DELTA, accountant="rdp") <= 2.0


def test_accountants_order() -> None:
    s = {acc: calibrate_gaussian(1.0, DELTA, 20, acc) for acc in ACCOUNTANTS}
    assert s["pld"] < s["rdp"] < s["rdp-classic"]


@settings(max_examples=30, deadline=None)
@given(
    epsilon=st.floats(0.1, 20.0),
    log_delta=st.floats(-12, -3),
    rounds=st.integers(1, 200),
    accountant=st.sampled_from(ACCOUNTANTS),
)
def test_calibrated_sigma_never_exceeds_budget(
    epsilon: float, log_delta: float, rounds: int, accountant: str
) -> None:
    delta = 10.0**log_delta
    sigma = calibrate_gaussian(epsilon, delta, rounds, accountant)
    assert epsilon_spent(gaussians(sigma, rounds), delta=delta, accountant=accountant) <= epsilon


@pytest.mark.parametrize("accountant", ACCOUNTANTS)
@pytest.mark.parametrize("epsilon", [0.5, 1.0, 8.0])
def test_joint_needs_less_noise_than_paper_split(accountant: str, epsilon: float) -> None:
    joint = calibrate_vpp(epsilon, DELTA, 20, split="joint", accountant=accountant)
    paper = calibrate_vpp(epsilon, DELTA, 20, split="paper", accountant=accountant)
    assert joint.sigma_ref < paper.sigma_ref
    assert joint.sigma_ref >= joint.sigma_iso
    assert joint.laplace_scale == paper.laplace_scale
    # VPDR Eq. (19)
    assert 1 / joint.sigma_A**2 + 1 / joint.sigma_B**2 <= 1 / joint.sigma_ref**2


@pytest.mark.parametrize("variant", ["paper", "once"])
def test_joint_vpp_matches_independent_pld(variant: str) -> None:
    """An independent, finer dp-accounting PLD of the same composition gives epsilon within 1%."""
    epsilon, rounds = 1.0, 20
    b = calibrate_vpp(epsilon, DELTA, rounds, variant=variant)
    vdi = 1e-4
    pure = pld_lib.from_privacy_parameters(
        pld_common.DifferentialPrivacyParameters(b.eps_select, 0.0),
        value_discretization_interval=vdi,
    ).self_compose(b.selections)
    gauss = pld_lib.from_gaussian_mechanism(
        standard_deviation=b.sigma_ref / math.sqrt(rounds), value_discretization_interval=vdi
    )
    eps = pure.compose(gauss).get_epsilon_for_delta(DELTA)
    assert eps == pytest.approx(epsilon, rel=0.01)
    events = [{"kind": "pure", "epsilon": b.eps_select}] * b.selections + gaussians(
        b.sigma_ref, rounds
    )
    assert epsilon_spent(events, delta=DELTA) <= epsilon


def test_paper_split_budget() -> None:
    b = calibrate_vpp(1.0, DELTA, 20, split="paper", ratio=0.1, rho=0.2, dim=512, score_max=0.1)
    assert b.k == math.ceil(0.2 * 512) == 103
    assert b.eps_select_total == pytest.approx(0.1)
    assert b.eps_select == pytest.approx(0.1 / 20)
    assert b.laplace_scale == pytest.approx(2 * 103 * 0.1 * 20 / 0.1)  # Theorem 4.1
    assert b.sigma_ref == pytest.approx(calibrate_gaussian(0.9, DELTA, 20))
    assert b.w_A == pytest.approx(b.kappa_B / (b.kappa_A + b.kappa_B))
    assert b.sigma_A == pytest.approx(b.sigma_ref / math.sqrt(b.w_A))
    assert b.rel_std_A < 1 < b.rel_std_B  # rho <= 0.5: A no noisier than IGPP
    # basic composition holds; the tight ledger shows the slack
    events = [{"kind": "pure", "epsilon": b.eps_select}] * 20 + gaussians(b.sigma_ref, 20)
    assert epsilon_spent(events, delta=DELTA) < 1.0


def test_once_and_history_variants() -> None:
    once = calibrate_vpp(1.0, DELTA, 20, variant="once")
    assert once.selections == 1 and once.eps_select == pytest.approx(0.1)
    assert once.laplace_scale == pytest.approx(2 * 103 * 0.1 / 0.1)
    hist = calibrate_vpp(1.0, DELTA, 20, variant="history")
    assert hist.selections == 0 and hist.sigma_ref == hist.sigma_iso
    assert hist.as_dict()["laplace_scale"] is None


def test_epsilon_spent_composition() -> None:
    # T Gaussians of multiplier z == one Gaussian of z/sqrt(T)
    z = 10.0
    assert epsilon_spent(gaussians(z, 4), delta=DELTA) == pytest.approx(
        gaussian_epsilon(z / 2, DELTA), rel=1e-9
    )
    assert epsilon_spent([], delta=DELTA) == 0.0
    # pure only: never more than basic composition
    assert epsilon_spent([{"kind": "pure", "epsilon": 0.3}] * 3, delta=DELTA) <= 0.9 + 1e-9
    with pytest.raises(ValueError, match="kind"):
        epsilon_spent([{"kind": "laplace", "scale": 1.0}], delta=DELTA)
    with pytest.raises(ValueError, match="noise_multiplier"):
        epsilon_spent([{"kind": "gaussian", "noise_multiplier": 0.0}], delta=DELTA)


def test_joint_calibration_meets_target_under_every_accountant() -> None:
    for acc in ACCOUNTANTS:
        s = calibrate_joint(2.0, DELTA, 20, {0.01: 20}, acc)
        events = [{"kind": "pure", "epsilon": 0.01}] * 20 + gaussians(s, 20)
        assert epsilon_spent(events, delta=DELTA, accountant=acc) <= 2.0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"epsilon": 0.0}, "epsilon"),
        ({"epsilon": -1.0}, "epsilon"),
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"rho": 0.0}, "rho"),
        ({"rho": 0.6}, "rho"),
        ({"ratio": 0.0}, "ratio"),
        ({"ratio": 1.0}, "ratio"),
        ({"rounds": 0}, "rounds"),
        ({"accountant": "moments"}, "accountant"),
        ({"split": "half"}, "split"),
    ],
)
def test_bad_input_names_parameter(kwargs: dict[str, object], name: str) -> None:
    args: dict[str, object] = {"epsilon": 1.0, "delta": DELTA, "rounds": 20}
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"^{name}=.*allowed"):
        calibrate_vpp(**args)  # type: ignore[arg-type]
    if name in ("epsilon", "delta", "rounds", "accountant"):
        with pytest.raises(ValueError, match=rf"^{name}=.*allowed"):
            calibrate_gaussian(
                args["epsilon"],  # type: ignore[arg-type]
                args["delta"],  # type: ignore[arg-type]
                args["rounds"],  # type: ignore[arg-type]
                str(args.get("accountant", "pld")),
            )


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"epsilon": 0.0}, "epsilon"),
        ({"delta": 1.5}, "delta"),
        ({"clip": 0.0}, "clip"),
        ({"vpp_rho": 0.51}, "vpp_rho"),
        ({"vpp_ratio": 1.0}, "vpp_ratio"),
        ({"vpp_variant": "best"}, "vpp_variant"),
        ({"addremove_counts": "exact"}, "addremove_counts"),
    ],
)
def test_config_bad_input_names_parameter(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=rf"privacy\.{name}=.*allowed"):
        PrivacyConfig(**kwargs)  # type: ignore[arg-type]


def test_cli_calibrate_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["privacy", "calibrate", "--mechanism", "vpp", "--epsilon", "1", "--delta", "1e-5"]
    assert cli_main([*argv, "--rounds", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("sigma", "accountant", "epsilon", "delta", "rounds", "sigma_A", "sigma_B"):
        assert key in out
    assert out["laplace_scale"] == pytest.approx(4120.0)
    argv = ["privacy", "calibrate", "--mechanism", "igpp", "--epsilon", "1", "--rounds", "20"]
    assert cli_main([*argv, "--accountant", "rdp-classic", "--json"]) == 0
    assert round(json.loads(capsys.readouterr().out)["sigma"], 2) == 21.92
    assert cli_main([*argv]) == 0
    assert "sigma" in capsys.readouterr().out
    assert cli_main(["privacy", "calibrate", "--epsilon", "-1", "--rounds", "20"]) == 2
    assert "epsilon" in capsys.readouterr().err


def test_rdp_calibration_is_pushed_to_the_safe_side_of_float_rounding() -> None:
    # found by the property test above: the bisection returned a sigma spending 0.1 + 2e-17
    delta = 10.0**-5.853515625
    sigma = calibrate_gaussian(0.1, delta, 14, "rdp")
    assert epsilon_spent(gaussians(sigma, 14), delta=delta, accountant="rdp") <= 0.1


def test_equal_compositions_are_composed_once() -> None:
    """Clients with the same events (a round with full participation) ask the same question:
    the PLD composition is made once, whatever order the pure events came in."""
    from protofl.privacy.accounting import _compose, compose_epsilon

    _compose.cache_clear()
    first = compose_epsilon(0.37, {0.1: 3, 0.2: 2}, delta=1e-5)
    again = compose_epsilon(0.37, {0.2: 2, 0.1: 3, 0.5: 0}, delta=1e-5)
    info = _compose.cache_info()
    assert again == first and info.misses == 1 and info.hits == 1
    assert compose_epsilon(0.38, {0.1: 3, 0.2: 2}, delta=1e-5) > first
