"""``privacy.mechanism: ddg``: the quantised, noisy, modular shares decode to the class sums only
when summed; the calibration, its refusals and the guarantee's assumptions."""

from __future__ import annotations

import math

import pytest
import torch

from protofl.privacy import PrivacyConfig, create_mechanism
from protofl.privacy.ddg import Federation
from protofl.privacy.guarantee import describe_guarantee
from protofl.privacy.ledger import PrivacyLedger
from protofl.privacy.prototype import clip_l2

DIM, CLASSES = 8, 3


def _bound(epsilon: float = 1.0, *, clients: int = 6, groups: int = 1, rounds: int = 2, **kw):
    cfg = PrivacyConfig(mechanism="ddg", epsilon=epsilon, clip=1.0, **kw)
    mech = create_mechanism(cfg, rounds=rounds, dim=DIM)
    names = [f"c{i}" for i in range(clients)]
    mech.bind(
        Federation(
            groups={n: i % groups for i, n in enumerate(names)},
            num_groups=groups,
            num_classes=CLASSES,
            per_round=clients,
            examples=clients * 30,
        )
    )
    return mech, names


def _data(seed: int, n: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, DIM, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def _true_means(data: list[tuple[torch.Tensor, torch.Tensor]], clip: float = 1.0) -> torch.Tensor:
    x = torch.cat([clip_l2(f.double(), clip) for f, _ in data])
    y = torch.cat([lab for _, lab in data])
    return torch.stack([x[y == c].mean(dim=0) for c in range(CLASSES)])


def test_the_sum_of_the_shares_decodes_to_the_class_means() -> None:
    mech, names = _bound(epsilon=1e5)  # sigma at its floor: quantisation is all that is left
    data = [_data(i) for i in range(len(names))]
    shares = [
        mech.release(
            f, y, num_classes=CLASSES, generator=torch.Generator().manual_seed(i), client=n
        )
        for i, ((f, y), n) in enumerate(zip(data, names))
    ]
    for s in shares:
        assert s.prototypes.dtype == torch.int64
        assert int(s.prototypes.min()) >= 0 and int(s.prototypes.max()) < 2**32
    ((group, agg),) = mech.secure_sum(shares)
    assert group == 0
    assert agg.classes.tolist() == list(range(CLASSES))
    assert agg.counts.sum() == sum(len(y) for _, y in data)
    err = (agg.prototypes.double() - _true_means(data)).abs().max()
    assert float(err) < 1e-3


def test_one_share_carries_only_its_one_over_sqrt_n_part_of_the_noise() -> None:
    # why the server must see only sums: a single share decodes to the client's class sums
    # with noise of std sigma, 1/sqrt(n) of what the sum carries
    mech, names = _bound(epsilon=1.0, clients=9)
    f, y = _data(0, n=3000)
    share = mech.release(f, y, num_classes=CLASSES, generator=torch.Generator(), client=names[0])
    ((_, alone),) = mech.secure_sum([share])
    err = (alone.prototypes.double() - _true_means([(f, y)])) * alone.counts.double()[:, None]
    assert float(err.std()) == pytest.approx(mech.sigma * mech.gamma, rel=0.3)
    total = mech.describe()["equivalent_noise_multiplier"] * mech.l2
    assert math.sqrt(9) * mech.sigma == pytest.approx(total, rel=1e-9)


def test_the_decoded_noise_has_the_calibrated_spread() -> None:
    mech, names = _bound(epsilon=2.0, clients=8)
    data = [_data(i) for i in range(len(names))]
    errors = []
    for trial in range(3):
        shares = [
            mech.release(
                f,
                y,
                num_classes=CLASSES,
                generator=torch.Generator().manual_seed(100 * trial + i),
                client=n,
            )
            for i, ((f, y), n) in enumerate(zip(data, names))
        ]
        mech._released.clear()  # three independent trials of round 1
        ((_, agg),) = mech.secure_sum(shares)
        n_c = agg.counts.double()[:, None]
        errors.append((agg.prototypes.double() - _true_means(data)) * n_c)  # error on the sums
    err = torch.cat(errors).flatten()
    expected = math.sqrt(len(names)) * mech.sigma * mech.gamma
    assert float(err.std()) == pytest.approx(expected, rel=0.25)
    assert abs(float(err.mean())) < 4 * expected / math.sqrt(err.numel())


def test_per_domain_groups_sum_within_their_block() -> None:
    mech, names = _bound(epsilon=1e5, clients=4, groups=2)
    data = [_data(i) for i in range(4)]
    shares = [
        mech.release(
            f, y, num_classes=CLASSES, generator=torch.Generator().manual_seed(i), client=n
        )
        for i, ((f, y), n) in enumerate(zip(data, names))
    ]
    out = dict(mech.secure_sum(shares))
    assert set(out) == {0, 1}
    for g in (0, 1):
        members = [data[i] for i in range(4) if i % 2 == g]
        err = (out[g].prototypes.double() - _true_means(members)).abs().max()
        assert float(err) < 1e-3


def test_each_release_is_charged_and_the_limit_holds() -> None:
    mech, names = _bound(rounds=2)
    ledger = PrivacyLedger(delta=1e-5)
    f, y = _data(0)
    for r in range(2):
        share = mech.release(
            f, y, num_classes=CLASSES, generator=torch.Generator(), client=names[0]
        )
        ledger.record(r, share)
    assert ledger.epsilon_spent() == pytest.approx(1.0, rel=1e-3)
    assert ledger.epsilon_spent() <= 1.0
    with pytest.raises(RuntimeError, match="already made the 2 releases"):
        mech.release(f, y, num_classes=CLASSES, generator=torch.Generator(), client=names[0])


def test_more_honest_clients_need_less_noise_each_but_the_same_on_the_sum() -> None:
    small, _ = _bound(clients=4)
    large, _ = _bound(clients=16)

    def z(m) -> float:  # the sum's noise over its sensitivity
        return float(m.describe()["equivalent_noise_multiplier"])

    assert large.sigma / large.l2 < small.sigma / small.l2 / 1.9
    assert z(large) == pytest.approx(z(small), rel=0.01)
    # tolerating 4 dropouts of 16 calibrates to 12 honest shares (more noise each)
    tolerant, _ = _bound(clients=16, ddg_max_dropped=4)
    assert tolerant.honest == 12
    assert tolerant.sigma / tolerant.l2 == pytest.approx(
        large.sigma / large.l2 * math.sqrt(16 / 12), rel=0.01
    )


def test_bad_settings_fail_in_one_line_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"privacy.ddg_max_dropped=6 leaves no honest client"):
        _bound(clients=6, ddg_max_dropped=6)
    with pytest.raises(ValueError, match=r"privacy.ddg_bits=8 is too small"):
        _bound(ddg_bits=8)
    with pytest.raises(ValueError, match=r"privacy.ddg_bits=4 is out of range"):
        PrivacyConfig(mechanism="ddg", ddg_bits=4)
    with pytest.raises(ValueError, match=r"privacy.ddg_beta"):
        PrivacyConfig(mechanism="ddg", ddg_beta=1.0)
    with pytest.raises(ValueError, match=r"addremove_counts=noisy is not supported"):
        PrivacyConfig(mechanism="ddg", neighbouring="add_remove", addremove_counts="noisy")
    mech = create_mechanism(PrivacyConfig(mechanism="ddg"), rounds=1, dim=DIM)
    with pytest.raises(RuntimeError, match="calibrated for a federation"):
        mech.release_events(0)


def test_the_guarantee_says_distributed_and_what_it_assumes() -> None:
    cfg = PrivacyConfig(mechanism="ddg", ddg_max_dropped=2, noise_seed="secret")
    g = describe_guarantee(cfg, noise_key="secret", rounds=3)
    assert "distributed DP (secure sums)" in g["statement"]
    assert "local DP" not in g["statement"]
    assert "honest-but-curious server" in g["statement"]
    assert any("at most 2 dropped or colluding" in a for a in g["assumes"])
    assert any("no cryptography" in a for a in g["assumes"])
    local = describe_guarantee(PrivacyConfig(mechanism="igpp"), noise_key="secret", rounds=3)
    assert "assumes" not in local and "local DP" in local["statement"]
