"""``PrivateClient``: one client's mechanism, noise key, ledger, DCR and release limit."""

from __future__ import annotations

import pickle

import pytest
import torch

from protofl.privacy import PrivacyConfig, PrototypePrivacy
from protofl.privacy.base import create_mechanism
from protofl.privacy.client import PrivateClient, own_entries, release_many
from protofl.privacy.noise import NoiseKey, noise_key

DIM, CLASSES, ROUNDS = 8, 3, 3


def _clients(
    mechanism: str = "vpdr", mode: str = "derived", n: int = 3
) -> tuple[PrivacyConfig, list[PrivateClient]]:
    config = PrivacyConfig(mechanism=mechanism, epsilon=2.0, clip=1.0)
    shared = create_mechanism(config, rounds=ROUNDS, dim=DIM)
    head = torch.nn.Linear(DIM, CLASSES)
    return config, [
        PrivateClient(config, mechanism=shared, key=noise_key(mode, 7, i), name=f"c{i}", head=head)
        for i in range(n)
    ]


def _data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(30, DIM, generator=g), torch.arange(30) % CLASSES


def test_release_many_equals_one_release_each() -> None:
    _, many = _clients()
    _, one = _clients()
    data = [_data(i) for i in range(3)]
    for rnd in range(2):
        batch = release_many(
            many,
            [f for f, _ in data],
            [y for _, y in data],
            num_classes=CLASSES,
            round_index=rnd,
        )
        for c, (f, y), got in zip(one, data, batch):
            mine = c.release(f, y, num_classes=CLASSES, round_index=rnd)
            # the same draws; the vectorised sums may round differently in the last bits
            assert torch.allclose(mine.prototypes, got.prototypes, atol=1e-5)
            assert torch.equal(mine.noise_std, got.noise_std)
            assert mine.events == got.events
    for a, b in zip(many, one):
        assert a.ledger.entries == b.ledger.entries and len(a.ledger.entries) == 2
        assert a.epsilon_spent() == pytest.approx(b.epsilon_spent())
        assert a.key.state_dict() == b.key.state_dict()


def test_release_many_refuses_clients_of_two_mechanisms() -> None:
    _, first = _clients(n=1)
    _, second = _clients(n=1)
    (f, y) = _data(0)
    with pytest.raises(ValueError, match="share one calibrated mechanism"):
        release_many(first + second, [f, f], [y, y], num_classes=CLASSES, round_index=0)


def test_the_release_limit_is_the_calibrated_rounds() -> None:
    _, (c,) = _clients(n=1)
    f, y = _data(0)
    assert c.releases_left() == ROUNDS
    for _ in range(ROUNDS):
        c.release(f, y, num_classes=CLASSES)
    assert c.releases_left() == 0
    with pytest.raises(RuntimeError, match="already made"):
        c.release(f, y, num_classes=CLASSES)
    assert len(c.ledger.entries) == ROUNDS  # the refused release charged nothing
    _, (plain,) = _clients("none", n=1)
    assert plain.releases_left() is None and not plain.is_private


def test_a_secret_key_never_leaves_the_client() -> None:
    _, (c,) = _clients(mode="secret", n=1)
    f, y = _data(0)
    c.release(f, y, num_classes=CLASSES)
    secret = bytes(c.key._key)
    state = c.state_dict(mechanism=True)
    assert secret not in pickle.dumps(state)
    assert state["noise_gen"]["mode"] == "secret"
    _, (restored,) = _clients(mode="derived", n=1)
    restored.load_state_dict(state)
    assert restored.key.mode == "secret" and restored.key._key != secret
    assert restored.ledger.entries == c.ledger.entries and restored.releases_left() == ROUNDS - 1


def test_a_derived_key_continues_where_it_stopped() -> None:
    _, (a,) = _clients(n=1)
    _, (b,) = _clients(n=1)
    f, y = _data(0)
    a.release(f, y, num_classes=CLASSES)
    b.load_state_dict(a.state_dict(mechanism=True))
    # b's own (unused) DCR teacher took a's, and both draw the same next noise
    assert torch.equal(
        a.release(f, y, num_classes=CLASSES).prototypes,
        b.release(f, y, num_classes=CLASSES).prototypes,
    )


def test_mechanism_entries_merge_or_stand_alone() -> None:
    _, clients = _clients()
    for i, c in enumerate(clients):
        f, y = _data(i)
        c.release(f, y, num_classes=CLASSES)
    mine = clients[0].mechanism_state()
    assert mine["released"] == {"c0": 1}
    assert own_entries({"released": {"c1": 2}, "x": 3}, "c0") == {"released": {}, "x": 3}
    clients[0].load_mechanism_state({**mine, "released": {"c0": 2}})
    assert clients[0].mechanism.state_dict()["released"] == {"c0": 2, "c1": 1, "c2": 1}
    clients[0].load_mechanism_state(mine, alone=True)  # a process serving one client at a time
    assert clients[0].mechanism.state_dict()["released"] == {"c0": 1}


def test_dcr_only_where_the_mechanism_uses_it() -> None:
    _, (vpdr,) = _clients("vpdr", n=1)
    _, (igpp,) = _clients("igpp", n=1)
    assert vpdr.dcr is not None and igpp.dcr is None
    assert igpp.state_dict()["dcr"] is None
    with pytest.raises(ValueError, match="has DCR but the state has none"):
        vpdr.load_state_dict(igpp.state_dict())


def test_every_client_side_holds_one() -> None:
    """The facade is a thin constructor over it (the simulator's and the Flower client app's
    clients hold one too: tests/engine/test_simulation.py and the Flower tests run them)."""
    privacy = PrototypePrivacy(epsilon=1.0, rounds=2, dim=DIM, mechanism="igpp", clip=1.0)
    assert isinstance(privacy.private, PrivateClient)
    assert privacy.generator is privacy.private.key and isinstance(privacy.generator, NoiseKey)
    assert privacy.ledger is privacy.private.ledger


def test_release_schedule_once_re_sends_the_first_release() -> None:
    config = PrivacyConfig(mechanism="igpp", epsilon=2.0, clip=1.0, release_schedule="once")
    assert config.releases(5) == 1 and config.releases(0) == 0
    assert PrivacyConfig().releases(5) == 5
    mech = create_mechanism(config, rounds=config.releases(5), dim=DIM)
    c = PrivateClient(config, mechanism=mech, key=noise_key("derived", 7, 0), name="c0")
    f, y = _data(0)
    first = c.release(f, y, num_classes=CLASSES)
    draws = c.key.draws
    again = c.release(f * 2, y, num_classes=CLASSES)  # other features: still the one release
    assert again is first and c.key.draws == draws and len(c.ledger.entries) == 1
    (many,) = release_many([c], [f], [y], num_classes=CLASSES, round_index=2)
    assert many is first and len(c.ledger.entries) == 1
    restored = PrivateClient(config, mechanism=mech, key=noise_key("derived", 7, 0), name="c0")
    restored.load_state_dict(c.state_dict())
    assert restored.sent is not None and torch.equal(restored.sent.prototypes, first.prototypes)
    with pytest.raises(ValueError, match="release_schedule"):
        PrivacyConfig(release_schedule="twice")
