from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from protofl.config import BackboneConfig, ExperimentConfig
from protofl.engine.runner import run_experiment
from protofl.models.backbones import BACKBONE_REGISTRY, create_backbone
from protofl.models.heterogeneous import MEMBERS, HtC4, SliceClientModel

FAST = "pixels,random_cnn,colour_hist,grad_hist"


def _images(n: int = 4, size: int = 16) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def _cfg(name: str) -> BackboneConfig:
    return BackboneConfig(name=name, image_size=16, proto_dim=24)


def _clients(name: str, in_dim: int, n: int = 5) -> list[nn.Module]:
    cls = BACKBONE_REGISTRY.get(name)
    return [
        cls.client_model(in_dim, 3, _cfg(name), torch.Generator().manual_seed(0), client=i)
        for i in range(n)
    ]


@pytest.mark.parametrize("member", sorted(set(MEMBERS) - {"effnet_final", "effnet_mid"}))
def test_cheap_members_give_finite_features_of_their_width(member: str) -> None:
    m = MEMBERS[member](16)
    x = torch.rand(3, 3, 16, 16)
    z = m.encode(x, {})
    assert z.shape == (3, m.dim) and torch.isfinite(z).all()
    assert torch.equal(z, MEMBERS[member](16).encode(x, {}))  # frozen and seeded


def test_htfe4_default_members_concatenate_four_extractors() -> None:
    bb = create_backbone("htfe4", 16)  # EfficientNet-Lite0 (final + mid), random CNN, pixels
    z = bb.encode(_images(2))
    assert z.shape == (2, 1280 + 112 + 256 + 256) and torch.isfinite(z).all()
    assert "effnet_final+effnet_mid+random_cnn+pixels" in bb.cache_key


def test_htfe4_client_i_uses_member_i_mod_4(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROTOFL_HTFE4_MEMBERS", FAST)
    bb = create_backbone("htfe4", 16)
    z = bb.encode(_images()).clone()
    assert bb.feature_dim == 256 + 256 + 72 + 128 == z.shape[1]
    models = _clients("htfe4", bb.feature_dim)
    assert [m.member for m in models] == [
        "pixels",
        "random_cnn",
        "colour_hist",
        "grad_hist",
        "pixels",
    ]  # type: ignore[union-attr]
    for m in models:
        assert isinstance(m, SliceClientModel)
        m.eval()
        f, logits = m(z)
        assert f.shape == (4, 24) and logits.shape == (4, 3)  # one common prototype dimension
        z2 = z.clone()  # other members' slices do not matter
        z2[:, : m.start] += 5.0
        z2[:, m.stop :] -= 5.0
        assert torch.allclose(m.features(z2), f)
    for k, v in models[0].state_dict().items():  # same member, same generator: identical
        assert torch.equal(v, models[4].state_dict()[k])
    assert models[0].adapter.down.weight.shape[1] == 256  # type: ignore[union-attr]
    assert models[2].adapter.down.weight.shape[1] == 72  # type: ignore[union-attr]


def test_htfe4_fast_is_registered_and_wrong_members_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    assert create_backbone("htfe4_fast", 16).feature_dim == 712
    monkeypatch.setenv("PROTOFL_HTFE4_MEMBERS", "pixels,nope")
    with pytest.raises(ValueError, match="nope"):
        create_backbone("htfe4", 16)


def test_htc4_heads_of_increasing_depth_on_one_extractor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROTOFL_HTC4_BASE", "pixels")
    bb = create_backbone("htc4", 16)
    assert bb.cache_key == create_backbone("pixels", 16).cache_key  # shares the base's cache
    z = bb.encode(_images()).clone()
    models = _clients("htc4", bb.feature_dim)
    depths = [sum(isinstance(x, nn.Linear) for x in m.head.modules()) for m in models]  # type: ignore[union-attr]
    assert depths == [1, 2, 3, 4, 1]
    with torch.no_grad():
        feats = [m.features(z) for m in models]  # type: ignore[operator]
    for f in feats[1:]:  # the extractor part starts identical; only the heads differ
        assert torch.allclose(f, feats[0])
    assert models[3](z)[1].shape == (4, 3)
    monkeypatch.setenv("PROTOFL_HTC4_BASE", "htc4")
    with pytest.raises(ValueError, match="base"):
        HtC4.base_name()


@pytest.mark.parametrize("backbone", ["htc4", "htfe4"])
def test_fedproto_runs_on_heterogeneous_families(
    backbone: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROTOFL_HTC4_BASE", "pixels")
    monkeypatch.setenv("PROTOFL_HTFE4_MEMBERS", FAST)
    cfg = ExperimentConfig().with_overrides(
        [
            "data.name=toy",
            "data.train_fraction=1",
            f"backbone.name={backbone}",
            "backbone.image_size=16",
            "backbone.proto_dim=32",
            "federation.rounds=2",
            "method.name=fedproto",
            "run.progress=false",
            "federation.checkpoint=false",
            "run.save_releases=false",
        ]
    )
    result = run_experiment(cfg, out=tmp_path)
    assert result.summary["rounds"] == 2 and len(result.summary["clients"]) == 4
    assert np.isfinite(result.summary["final_train_loss"])
    assert result.summary["avg_acc"] > 0.25  # better than chance on the 4-class toy set
