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
        assert privacy.epsilon_spent() == pytest.approx(c.privacy.ledger.epsilon_spent())


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
    # the state holds no secret key: the restored facade draws fresh noise, never a replay
    assert "key" not in state["generator"]
    assert not torch.equal(a.prototypes, b.prototypes)
    assert again.epsilon_spent() == pytest.approx(privacy.epsilon_spent())
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
    with pytest.raises(ValueError, match="mechanism=ddg is a share of a secure sum"):
        PrototypePrivacy(rounds=2, mechanism="ddg")
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


def _data(n: int = 60, d: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, d, generator=g) * 3, torch.arange(n) % 3


def test_loading_an_older_state_and_releasing_again_does_not_replay_noise() -> None:
    """Issue 41: the difference of two releases equalled the difference of the clean
    prototypes (the noise cancelled) after restoring an older state_dict."""
    x, y = _data()
    privacy = PrototypePrivacy(epsilon=1.0, rounds=4, dim=16, mechanism="igpp", clip=1.0)
    old = privacy.state_dict()
    first = privacy.release(x, y, num_classes=3)
    restored = PrototypePrivacy(epsilon=1.0, rounds=4, dim=16, mechanism="igpp", clip=1.0)
    restored.load_state_dict(old)
    x2 = x + 0.5
    second = restored.release(x2, y, num_classes=3)
    clean = restored.mechanism.noiseless_release(x, y, num_classes=3).prototypes  # type: ignore[attr-defined]
    clean2 = restored.mechanism.noiseless_release(x2, y, num_classes=3).prototypes  # type: ignore[attr-defined]
    gap = (second.prototypes - first.prototypes) - (clean2 - clean)
    assert float(gap.abs().max()) > 0.5 * float(first.noise_std.min())  # the noise did not cancel
    # rolling a facade back to an earlier state of its own is refused
    with pytest.raises(ValueError, match="roll the ledger back"):
        privacy.load_state_dict(old)


def test_state_dict_is_a_copy_and_restored_states_charge_every_release() -> None:
    x, y = _data()
    privacy = PrototypePrivacy(epsilon=1.0, rounds=4, dim=16, mechanism="igpp", clip=1.0)
    privacy.release(x, y, num_classes=3)
    state = privacy.state_dict()
    privacy.release(x, y, num_classes=3)  # must not change the saved state
    assert len(state["ledger"]["entries"]) == 1 and state["releases_made"] == 1
    restored = PrototypePrivacy(epsilon=1.0, rounds=4, dim=16, mechanism="igpp", clip=1.0)
    restored.load_state_dict(state)
    for _ in range(3):
        restored.release(x, y, num_classes=3)
    assert len(restored.ledger.entries) == 4
    assert restored.epsilon_spent() == pytest.approx(1.0, rel=1e-3)  # 4 releases, budget 1


def test_half_precision_features_are_clipped_and_noised_in_float32() -> None:
    x, y = _data()
    privacy = PrototypePrivacy(epsilon=1e6, rounds=1, dim=16, mechanism="igpp", clip=5.0)
    rel = privacy.release((x * 10).half(), y, num_classes=3)
    assert rel.prototypes.dtype == torch.float32
    assert float(rel.prototypes.norm(dim=1).max()) <= 5.0 + 1e-3


def test_inputs_are_checked_naming_the_argument() -> None:
    x, y = _data()
    privacy = PrototypePrivacy(epsilon=1.0, rounds=2, dim=16, mechanism="igpp", name="site-b")
    rel = privacy.release(x.numpy(), y.numpy(), num_classes=3)  # numpy works
    assert rel.prototypes.shape == (3, 16)
    with pytest.raises(TypeError, match="site-b: features must be floating point"):
        privacy.release(x.long(), y, num_classes=3)
    with pytest.raises(TypeError, match="site-b: labels must be integer"):
        privacy.release(x, y.float(), num_classes=3)
    with pytest.raises(TypeError, match=r"site-b: features must be a torch\.Tensor"):
        privacy.release(x.tolist(), y, num_classes=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="site-b: labels are on meta"):
        privacy.release(x, y.to("meta"), num_classes=3)
    assert privacy.releases_made == 1  # refused inputs cost nothing
