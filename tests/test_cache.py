from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from protofl.data.cache import load_arrays, protofl_home, save_arrays, verify_checksum
from protofl.data.features import cached_features, feature_cache_path
from protofl.models.backbones import create_backbone


def test_home_follows_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROTOFL_HOME", str(tmp_path))
    assert protofl_home() == tmp_path


def test_save_load_and_corruption_is_detected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "x.npz"
    save_arrays(path, a=np.arange(5))
    assert verify_checksum(path)
    loaded = load_arrays(path)
    assert loaded is not None and np.array_equal(loaded["a"], np.arange(5))
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert load_arrays(path) is None
    assert "checksum" in caplog.text


def test_feature_cache_hits_and_rebuilds(tmp_path: Path) -> None:
    backbone = create_backbone("pixels", 8)
    images = np.random.default_rng(0).integers(0, 255, (6, 8, 8, 3), dtype=np.uint8)
    first = cached_features(tmp_path, backbone, "toy", "red", "train", images)
    path = feature_cache_path(tmp_path, backbone, "toy", "red", "train", images)
    assert path.exists()
    # a second call reads the file: poison the backbone to prove it is not recomputed
    backbone.matrix = backbone.matrix * 0  # type: ignore[attr-defined]
    again = cached_features(tmp_path, backbone, "toy", "red", "train", images)
    assert torch.equal(first, again)
    # corrupt the file: it is rebuilt (with the poisoned backbone, so values change)
    path.write_bytes(b"garbage")
    rebuilt = cached_features(tmp_path, backbone, "toy", "red", "train", images)
    assert torch.count_nonzero(rebuilt) == 0
    # other images get another file
    other = cached_features(tmp_path, backbone, "toy", "red", "train", images[:3])
    assert other.shape == (3, 256)


def test_efficientnet_lite0_features_are_deterministic() -> None:
    backbone = create_backbone("efficientnet_lite0", 32)
    images = np.random.default_rng(0).integers(0, 255, (4, 28, 28, 3), dtype=np.uint8)
    a, b = backbone.encode(images), backbone.encode(images)
    assert a.shape == (4, 1280)
    assert torch.equal(a, b)
    assert torch.isfinite(a).all()
    assert backbone.cache_key.startswith("efficientnet_lite0-")
