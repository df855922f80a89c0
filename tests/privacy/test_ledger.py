"""The per-client ledger composes what a client released."""

from __future__ import annotations

import json

import pytest
import torch

from protofl.privacy import PrivacyConfig, Release, create_mechanism
from protofl.privacy.accounting import calibrate_gaussian, epsilon_spent
from protofl.privacy.ledger import PrivacyLedger


def release(events: list[dict[str, object]], mechanism: str = "igpp") -> Release:
    return Release(
        prototypes=torch.zeros(1, 4),
        classes=torch.zeros(1, dtype=torch.long),
        counts=torch.ones(1, dtype=torch.long),
        sensitivity=torch.ones(1),
        noise_std=torch.ones(1, 4),
        mechanism=mechanism,
        events=events,
    )


def test_ledger_composes_events() -> None:
    sigma = calibrate_gaussian(1.0, 1e-5, 10)
    ledger = PrivacyLedger(delta=1e-5)
    assert ledger.epsilon_spent() == 0.0
    for r in range(10):
        ledger.record(r, release([{"kind": "gaussian", "noise_multiplier": sigma}]))
    assert ledger.epsilon_spent() == pytest.approx(1.0, rel=1e-6)
    ledger.record(10, release([{"kind": "pure", "epsilon": 0.1}]))
    both = ledger.epsilon_spent()
    assert both is not None and 1.0 < both <= 1.1
    assert both == epsilon_spent(ledger.events(), delta=1e-5)


@pytest.mark.parametrize("accountant", ["pld", "rdp", "rdp-classic"])
def test_state_roundtrip_is_json(accountant: str) -> None:
    ledger = PrivacyLedger(delta=1e-6, accountant=accountant)
    ledger.record(0, release([{"kind": "gaussian", "noise_multiplier": 5.0}]))
    ledger.record(
        1,
        release([{"kind": "pure", "epsilon": 0.01}, {"kind": "gaussian", "noise_multiplier": 5.0}]),
    )
    state = json.loads(json.dumps(ledger.state_dict()))
    other = PrivacyLedger(delta=0.5)
    other.load_state_dict(state)
    assert other.epsilon_spent() == ledger.epsilon_spent()
    assert other.accountant == accountant


def test_none_mechanism_and_bad_events() -> None:
    ledger = PrivacyLedger(delta=1e-5)
    ledger.record(0, release([], mechanism="none"))
    assert ledger.epsilon_spent() is None
    with pytest.raises(ValueError, match="kind"):
        PrivacyLedger(delta=1e-5).record(0, release([{"kind": "magic"}]))
    with pytest.raises(ValueError, match="delta"):
        PrivacyLedger(delta=0.0)
    with pytest.raises(ValueError, match="accountant"):
        PrivacyLedger(delta=1e-5, accountant="moments")


def test_ledger_with_real_mechanism_never_exceeds_budget() -> None:
    cfg = PrivacyConfig(mechanism="vpp", epsilon=4.0, vpp_split="paper")
    m = create_mechanism(cfg, rounds=5, dim=16)
    ledger = PrivacyLedger(delta=cfg.delta, accountant=cfg.accountant)
    x, y = torch.randn(40, 16), torch.arange(40) % 4
    gen = torch.Generator().manual_seed(0)
    for r in range(5):
        ledger.record(r, m.release(x, y, num_classes=4, generator=gen))
    spent = ledger.epsilon_spent()
    assert spent is not None and spent < 4.0  # the paper split leaves slack
