"""``PrototypePrivacy``: the plug-in facade gives protofl's own numbers and keeps its promises."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protofl.engine.federated_data import build_federated_data
from protofl.engine.simulation import Simulation
from protofl.methods.checks import tiny_config
from protofl.privacy import PrivacyConfig, PrototypePrivacy
from protofl.privacy.accounting import calibrate_gaussian


@pytest.mark.parametrize("mechanism", ["igpp", "vpdr"])
def test_the_facade_releases_exactly_what_the_engine_releases(
    mechanism: str, tmp_path: Path
) -> None:
    config = tiny_config("fedproto", mechanism, rounds=2).with_overrides(
        ["privacy.noise_seed=derived"]
    )
    sim = Simulation(config, build_federated_data(config, tmp_path))
    feats = {}
    for c in sim.clients:
        c.model.eval()
        with torch.no_grad():
            feats[c.data.client] = sim.method.upload_features(c.model, c.data.train_z.float())
    sim.run_round()
    for c, engine in zip(sim.clients, sim.releases[0]):
        assert engine is not None
        privacy = PrototypePrivacy(
            config=config.privacy,
            rounds=config.federation.rounds,
            dim=config.backbone.proto_dim,
            seed=config.seed,
            client=c.data.client,
            name=c.data.name,
        )
        mine = privacy.release(feats[c.data.client], c.data.train_y, num_classes=4)
        for key in ("prototypes", "classes", "counts", "sensitivity", "noise_std"):
            assert torch.equal(getattr(mine, key), getattr(engine, key)), key
        assert mine.events == engine.events
        assert privacy.epsilon_spent() == pytest.approx(c.ledger.epsilon_spent())


def test_budget_state_dcr_and_noise_key() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(60, 16, generator=g), torch.arange(60) % 3
    privacy = PrototypePrivacy(epsilon=1.0, rounds=2, dim=16, mechanism="vpdr", clip=1.0)
    assert privacy.noise_key == "secret" and privacy.guarantee()["complete"]
    head = torch.nn.Linear(16, 3)
    dcr = privacy.dcr(head)
    assert dcr is not None and privacy.dcr(head) is dcr
    f = dcr.soft_clip(x)
    loss = torch.nn.functional.cross_entropy(head(f), y) + dcr.kd_loss(x, head(f))
    loss.backward()
    dcr.after_step(head)
    privacy.release(x, y, num_classes=3)
    state = privacy.state_dict()
    again = PrototypePrivacy(epsilon=1.0, rounds=2, dim=16, mechanism="vpdr", clip=1.0)
    again.dcr(torch.nn.Linear(16, 3))
    again.load_state_dict(state)
    a = privacy.release(x, y, num_classes=3)
    b = again.release(x, y, num_classes=3)
    assert torch.equal(a.prototypes, b.prototypes)  # the restored secret stream continues
    assert privacy.epsilon_spent() == pytest.approx(1.0, rel=1e-3)
    with pytest.raises(RuntimeError, match="releases of the budget are spent"):
        privacy.release(x, y, num_classes=3)
    other = PrototypePrivacy(epsilon=2.0, rounds=2, dim=16, mechanism="vpdr", clip=1.0)
    with pytest.raises(ValueError, match=r"epsilon: 1\.0 != 2\.0"):
        other.load_state_dict(state)


def test_construction_errors_and_describe() -> None:
    with pytest.raises(ValueError, match="unknown privacy setting"):
        PrototypePrivacy(rounds=2, epsilom=1.0)
    with pytest.raises(ValueError, match="needs seed"):
        PrototypePrivacy(rounds=2, noise_seed="derived")
    with pytest.raises(ValueError, match="private mechanism"):
        PrototypePrivacy(rounds=2, mechanism="none")
    with pytest.raises(ValueError, match="not both"):
        PrototypePrivacy(rounds=2, config=PrivacyConfig(mechanism="igpp"), epsilon=2.0)
    p = PrototypePrivacy(rounds=20, mechanism="igpp", epsilon=1.0)
    assert p.sigma == calibrate_gaussian(1.0, 1e-5, 20)
    assert p.describe()["noise_key"] == "secret" and p.dcr(torch.nn.Linear(2, 2)) is None


def test_bad_features_name_the_client_and_the_limit() -> None:
    privacy = PrototypePrivacy(rounds=1, dim=16, mechanism="vpp", name="site-a")
    y = torch.arange(10) % 2
    with pytest.raises(ValueError, match=r"client 'site-a': features must have shape \[n, 16\]"):
        privacy.release(torch.randn(10, 8), y, num_classes=2)
    bad = torch.randn(10, 16)
    bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match="client 'site-a': 1 feature vectors are not finite"):
        privacy.release(bad, y, num_classes=2)
    with pytest.raises(ValueError, match=r"privacy\.epsilon=-1"):
        PrototypePrivacy(rounds=1, epsilon=-1.0)
    privacy.release(torch.randn(10, 16), y, num_classes=2)
    with pytest.raises(RuntimeError, match="site-a: all 1 releases of the budget are spent"):
        privacy.release(torch.randn(10, 16), y, num_classes=2)
