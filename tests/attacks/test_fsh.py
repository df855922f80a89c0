from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from protofl.attacks.fsh import (
    diagonal_frechet,
    fsh_metrics,
    hijack,
    hijack_release,
    save_grid,
    total_variation,
)
from protofl.data.toy import make_toy
from protofl.models.backbones import create_backbone


def _toy_feature_map() -> tuple[object, torch.Tensor, torch.Tensor, torch.Tensor]:
    """phi = the fixed ``pixels`` projection of 16 px toy images (the answer is known: each
    target is the feature of a real class-mean image)."""
    dom = make_toy().domains[0]
    bb = create_backbone("pixels", 16)
    x = bb.preprocess(dom.train.images)
    y = torch.from_numpy(dom.train.labels)
    with torch.no_grad():
        f = bb.encode_batch(x)
    return bb, x, f, y


def test_fsh_recovers_the_target_class_on_a_known_feature_map(tmp_path: Path) -> None:
    bb, x, f, y = _toy_feature_map()
    means = torch.stack([f[y == c].mean(dim=0) for c in range(4)])
    release = {"prototypes": means, "classes": torch.arange(4)}
    result, metrics = hijack_release(
        bb.encode_batch,  # type: ignore[attr-defined]
        release,
        (3, 16, 16),
        f,
        y,
        samples_per_target=2,
        max_steps=100,
        generator=torch.Generator().manual_seed(0),
    )
    assert metrics["top1_hit"] == 1.0 and metrics["top1_hit_released"] == 1.0
    assert metrics["cos_sim"] > 0.95
    assert result.images.shape == (4, 2, 3, 16, 16)
    assert float(result.images.min()) >= 0.0 and float(result.images.max()) <= 1.0
    # a random target is far worse in cFFD than the true class means
    junk = torch.randn(4, f.shape[1]) * 5
    rnd = hijack(
        bb.encode_batch,  # type: ignore[attr-defined]
        junk,
        (3, 16, 16),
        target_classes=torch.arange(4),
        samples_per_target=2,
        max_steps=100,
    )
    assert fsh_metrics(rnd, junk, f, y)["cffd"] > 3 * metrics["cffd"]
    real_means = torch.stack([x[y == c].mean(dim=0) for c in range(4)])
    png = save_grid(tmp_path / "grid.png", result, real_means, labels=["a", "b", "c", "d"])
    with Image.open(png) as img:
        assert img.size[1] == 4 * (16 * 4 + 2) + 2


def test_early_stopping_with_patience() -> None:
    def constant(x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=(1, 2, 3)).unsqueeze(1) * 0.0

    out = hijack(constant, torch.zeros(2, 1), (1, 4, 4), lambda_tv=0.0, patience=5, max_steps=100)
    assert out.steps == 6  # one first value, then 5 steps without improvement
    capped = hijack(constant, torch.zeros(1, 1), (1, 4, 4), patience=1000, max_steps=7)
    assert capped.steps == 7


def test_total_variation_and_frechet() -> None:
    flat = torch.zeros(1, 1, 4, 4)
    step = flat.clone()
    step[..., 2:] = 1.0  # one vertical edge of height 4
    assert total_variation(flat).item() == 0.0
    assert total_variation(step).item() == pytest.approx(4.0)
    rng = np.random.default_rng(0)
    a = rng.normal(size=(500, 8))
    assert diagonal_frechet(a, a) == pytest.approx(0.0, abs=1e-9)
    assert diagonal_frechet(a, a + 3.0) == pytest.approx(8 * 9.0, rel=1e-6)
    # one sample per side: just the squared distance plus the other side's variance
    assert diagonal_frechet(a[:1], a) == pytest.approx(
        float(((a[0] - a.mean(0)) ** 2).sum() + a.var(0).sum())
    )


def test_bad_arguments_fail_naming_them() -> None:
    phi = torch.nn.Flatten()
    with pytest.raises(ValueError, match="max_steps"):
        hijack(phi, torch.zeros(1, 4), (1, 2, 2), max_steps=0)
    with pytest.raises(ValueError, match="samples_per_target"):
        hijack(phi, torch.zeros(1, 4), (1, 2, 2), samples_per_target=0)
    with pytest.raises(ValueError, match="targets"):
        hijack(phi, torch.zeros(4), (1, 2, 2))


def _hijack_two_targets(bb: object, f: torch.Tensor, device: str | None = None) -> object:
    """Twenty steps against the features of two real images, from seed 3's draws."""
    return hijack(
        bb.encode_batch,  # type: ignore[attr-defined]
        torch.stack([f[0], f[1]]),
        (3, 16, 16),
        generator=torch.Generator().manual_seed(3),
        device=device,
        samples_per_target=2,
        max_steps=20,
        patience=20,
    )


def test_hijack_on_an_explicit_device_starts_from_the_same_draws() -> None:
    bb, _, f, _ = _toy_feature_map()
    a, b = _hijack_two_targets(bb, f), _hijack_two_targets(bb, f, device="cpu")
    assert torch.equal(a.images, b.images) and torch.equal(a.losses, b.losses)  # type: ignore[attr-defined]
    assert b.images.device.type == "cpu" and b.features.device.type == "cpu"  # type: ignore[attr-defined]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_hijack_on_cuda_matches_the_cpu_to_rounding() -> None:
    from protofl.models.device import move_attributes

    bb, _, f, _ = _toy_feature_map()
    cpu = _hijack_two_targets(bb, f)
    move_attributes(bb, torch.device("cuda"))
    gpu = _hijack_two_targets(bb, f.cuda(), device="cuda")
    assert gpu.images.device.type == "cpu"  # type: ignore[attr-defined]
    torch.testing.assert_close(gpu.images, cpu.images, atol=1e-3, rtol=1e-3)  # type: ignore[attr-defined]
