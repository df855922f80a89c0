from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from protofl.config import BackboneConfig, ExperimentConfig
from protofl.data.allocation import preset_values
from protofl.data.pacs import PACS_CLASSES
from protofl.engine.runner import run_experiment
from protofl.models.backbones import BACKBONE_REGISTRY, backbone_class, create_backbone
from protofl.models.resnet import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ResNetClientModel,
    random_crop_flip,
)
from tests.models.helpers import (
    assert_preset_landed,
    client_states,
    initial_client_state,
    make_pacs,
    paper_config,
)


def _model(name: str, proto_dim: int = 512, seed: int = 0, client: int = 0) -> ResNetClientModel:
    cfg = BackboneConfig(name=name, image_size=16, proto_dim=proto_dim)
    cls = BACKBONE_REGISTRY.get(name)
    model = cls.client_model(3, 5, cfg, torch.Generator().manual_seed(seed), client=client)
    assert isinstance(model, ResNetClientModel)
    return model


def test_cached_prefix_is_the_normalised_image() -> None:
    bb = create_backbone("resnet18", 16)
    x = np.random.default_rng(0).integers(0, 256, (4, 16, 16, 3), dtype=np.uint8)
    z = bb.encode(x)
    assert z.shape == (4, 3, 16, 16) and bb.feature_dim == 3
    expected = (x[0, 3, 5] / 255.0 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    assert np.allclose(z[0, :, 3, 5].numpy(), expected, atol=1e-5)
    assert bb.cache_key == "resnet18-imagenet-norm-16px"


@pytest.mark.parametrize(
    ("name", "blocks", "params"), [("resnet10", 1, 4.90), ("resnet18", 2, 11.17)]
)
def test_cifar_style_architecture(name: str, blocks: int, params: float) -> None:
    m = _model(name)
    net = m.net
    assert net.conv1.kernel_size == (3, 3) and net.conv1.stride == (1, 1)  # 3x3 stem
    assert not any(isinstance(mod, nn.MaxPool2d) for mod in m.modules())  # no max-pool
    assert [len(s) for s in (net.layer1, net.layer2, net.layer3, net.layer4)] == [blocks] * 4
    n = sum(p.numel() for p in net.parameters()) / 1e6
    assert abs(n - params) < 0.05, n  # CIFAR ResNet-10 / ResNet-18 backbone sizes
    assert isinstance(m.proj, nn.Identity) and isinstance(m.head, nn.Linear)  # 512-d f, linear
    m.eval()
    f, logits = m(torch.randn(2, 3, 16, 16))
    assert f.shape == (2, 512) and logits.shape == (2, 5)


def test_projection_when_proto_dim_differs_and_everything_trains() -> None:
    m = _model("resnet10", proto_dim=32)
    assert isinstance(m.proj, nn.Linear) and m.proj.in_features == 512
    assert len(m.trainable_parameters()) == len(list(m.parameters()))
    assert any(k.endswith("running_mean") for k in m.state_dict())  # BN stats are averaged too


def test_same_generator_same_weights_different_augmentation_per_client() -> None:
    a, b, c = _model("resnet10"), _model("resnet10", client=1), _model("resnet10", seed=1)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert not torch.equal(a.net.conv1.weight, c.net.conv1.weight)
    z = torch.randn(4, 3, 16, 16)
    a.eval()
    assert torch.equal(a.features(z), a.features(z))  # no augmentation in eval mode
    ga, gb = a.aug_generator.get_state(), b.aug_generator.get_state()
    assert not torch.equal(ga, gb)


def test_random_crop_flip() -> None:
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).view(2, 3, 4, 5)
    g = torch.Generator().manual_seed(0)
    out = random_crop_flip(x, g, torch.zeros(3), padding=0)  # no padding: identity or h-flip
    for i in range(2):
        assert torch.equal(out[i], x[i]) or torch.equal(out[i], x[i].flip(-1))
    pad = torch.tensor([-1.0, -2.0, -3.0])
    out = random_crop_flip(x, torch.Generator().manual_seed(1), pad, padding=2)
    assert out.shape == x.shape
    for ch in range(3):  # padding shows the channel's pad value, the rest is from the image
        vals = out[:, ch].flatten()
        outside = vals[(vals < 0)]
        assert torch.all(outside == pad[ch])
        assert set(vals[vals >= 0].tolist()) <= set(x[:, ch].flatten().tolist())


def test_engine_trains_a_resnet_from_scratch(tmp_path: Path) -> None:
    cfg = ExperimentConfig().with_overrides(
        [
            "data.name=toy",
            "data.train_fraction=1",
            "backbone.name=resnet10",
            "backbone.image_size=16",
            "backbone.proto_dim=512",
            "federation.rounds=1",
            "run.progress=false",
            "federation.checkpoint=false",
            "run.save_releases=false",
            "data.max_train_per_domain=16",
            "data.max_test_per_domain=8",
            "federation.batch_size=16",
        ]
    )
    result = run_experiment(cfg, out=tmp_path)
    assert np.isfinite(result.summary["final_train_loss"]) and result.summary["rounds"] == 1


# ----------------------------------------------------- the papers' settings end to end (FedDAP)


def test_feddap_preset_trains_resnet10_from_scratch_at_32_px_end_to_end(tmp_path: Path) -> None:
    """FedDAP's setting through the preset: a ResNet-10 at 32 px, every weight trained."""
    size = preset_values("feddap", "pacs")["image_size"]  # the preset leaves it to the backbone
    assert size == 32
    root = make_pacs(tmp_path / "PACS", per_class=3)
    config = paper_config(
        "feddap", root, {"name": "resnet10", "image_size": size}, rounds=2, local_epochs=1
    )
    assert config.method.name == "feddap"  # the preset's method
    assert_preset_landed(config, overridden={"federation.rounds", "federation.local_epochs"})
    assert config.federation.optimizer == "sgd" and config.backbone.train_projection

    result = run_experiment(config, out=tmp_path / "runs")
    assert result.summary["rounds"] == 2 and result.summary["preset"] == "feddap"
    assert len(result.summary["clients"]) == 10  # FedDAP's uneven PACS allocation: 3+2+1+4
    assert np.isfinite(result.summary["final_train_loss"])

    model = backbone_class(config.backbone).client_model(
        3, len(PACS_CLASSES), config.backbone, torch.Generator()
    )
    assert isinstance(model, ResNetClientModel)
    assert len(model.trainable_parameters()) == len(list(model.parameters()))  # nothing frozen
    init = initial_client_state(config, 3)
    params = {name for name, _ in model.named_parameters()}
    for client, after in enumerate(client_states(result.run_dir, 1)):
        assert after.keys() == init.keys()
        for key in params:  # every weight of the ResNet (and the head) moved in round 1
            assert not torch.equal(after[key], init[key]), (client, key)
        assert not torch.equal(after["net.bn1.running_mean"], init["net.bn1.running_mean"])


def test_resnet18_at_32_px_keeps_a_4x4_map_before_pooling() -> None:
    """FedDAP's PACS backbone at its input size: 32 -> 32 -> 16 -> 8 -> 4 px over the stages."""
    cfg = BackboneConfig(name="resnet18", image_size=32, proto_dim=512)
    model = BACKBONE_REGISTRY.get("resnet18").client_model(
        3, len(PACS_CLASSES), cfg, torch.Generator().manual_seed(0)
    )
    assert isinstance(model, ResNetClientModel)
    z = create_backbone("resnet18", 32).encode(
        np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    )
    assert z.shape == (2, 3, 32, 32)
    net = model.net
    model.eval()
    with torch.no_grad():
        h = torch.relu(net.bn1(net.conv1(z)))
        sizes = []
        for stage in (net.layer1, net.layer2, net.layer3, net.layer4):
            h = stage(h)
            sizes.append(tuple(h.shape[1:]))
        f, logits = model(z)
    assert sizes == [(64, 32, 32), (128, 16, 16), (256, 8, 8), (512, 4, 4)]
    assert f.shape == (2, 512) and logits.shape == (2, len(PACS_CLASSES))
