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


def _mapped_files(ptr: int) -> list[str]:
    """The files whose memory mapping holds address ``ptr`` (from /proc/self/maps)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= ptr < hi and len(parts) >= 6:
            out.append(parts[5])
    return out


needs_proc = pytest.mark.skipif(
    not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps"
)


@needs_proc
def test_cached_features_are_memory_mapped_and_clients_share_them(tmp_path: Path) -> None:
    from protofl.config import ExperimentConfig
    from protofl.engine.federated_data import build_federated_data

    def build(*extra: str) -> object:
        over = ["data.name=toy", "backbone.name=pixels", "backbone.image_size=8", *extra]
        return build_federated_data(ExperimentConfig().with_overrides(over), tmp_path)

    data = build()
    for c in data.clients:  # type: ignore[attr-defined]
        for z in (c.train_z, c.test_z):
            files = _mapped_files(z.data_ptr())
            assert files and files[0].endswith(".npy"), files
            assert "/features/" in files[0]
    # the same data again (a second run or sweep worker) maps the same files, computes nothing
    again = build()
    first, second = data.clients[0], again.clients[0]  # type: ignore[attr-defined]
    assert torch.equal(first.train_z, second.train_z)
    assert _mapped_files(first.train_z.data_ptr()) == _mapped_files(second.train_z.data_ptr())
    # several clients per domain: contiguous shards stay views of the mapped file
    shared = build("data.clients_per_domain=3", "data.partition=domain")
    assert all(
        _mapped_files(c.test_z.data_ptr())
        for c in shared.clients  # type: ignore[attr-defined]
    )


def test_float16_features_halve_memory_and_train(tmp_path: Path) -> None:
    from protofl.config import ConfigError, ExperimentConfig
    from protofl.engine.runner import run_experiment

    base = [
        "data.name=toy",
        "backbone.name=pixels",
        "backbone.image_size=8",
        "federation.rounds=3",
        "run.progress=false",
    ]
    backbone = create_backbone("pixels", 8)
    images = np.random.default_rng(0).integers(0, 255, (6, 8, 8, 3), dtype=np.uint8)
    full = cached_features(tmp_path, backbone, "toy", "red", "train", images)
    half = cached_features(tmp_path, backbone, "toy", "red", "train", images, dtype="float16")
    assert full.dtype == torch.float32 and half.dtype == torch.float16
    assert half.element_size() * half.numel() * 2 == full.element_size() * full.numel()
    assert torch.allclose(half.float(), full, rtol=1e-3, atol=1e-3)
    path = feature_cache_path(tmp_path, backbone, "toy", "red", "train", images)
    assert path.with_name(path.name.replace(".npy", ".f16.npy")).exists()
    with pytest.raises(ValueError, match="feature dtype 'int8'"):
        cached_features(tmp_path, backbone, "toy", "red", "train", images, dtype="int8")
    with pytest.raises(ConfigError, match=r"backbone\.feature_dtype"):
        ExperimentConfig().with_overrides(["backbone.feature_dtype=float64"])
    # a whole run (sequential and batched) on float16 features lands near the float32 one
    runs = {}
    for name, extra in {
        "f32": [],
        "f16": ["backbone.feature_dtype=float16"],
        "f16b": ["backbone.feature_dtype=float16", "federation.execution=batched"],
    }.items():
        cfg = ExperimentConfig().with_overrides(base + extra)
        res = run_experiment(cfg, out=tmp_path / name, home=tmp_path, progress=False)
        runs[name] = res.summary["avg_acc"]
    assert abs(runs["f16"] - runs["f32"]) < 0.05
    assert abs(runs["f16b"] - runs["f16"]) < 0.02


def test_npz_feature_caches_of_earlier_versions_are_converted(tmp_path: Path) -> None:
    backbone = create_backbone("pixels", 8)
    images = np.random.default_rng(1).integers(0, 255, (5, 8, 8, 3), dtype=np.uint8)
    path = feature_cache_path(tmp_path, backbone, "toy", "red", "train", images)
    path.parent.mkdir(parents=True)
    old = np.full((5, 256), 7.0, dtype=np.float32)  # not what the backbone computes
    save_arrays(path.with_suffix(".npz"), features=old)
    got = cached_features(tmp_path, backbone, "toy", "red", "train", images)
    assert torch.equal(got, torch.from_numpy(old))  # read, not recomputed
    assert path.exists() and verify_checksum(path)


def test_a_settled_files_digest_is_computed_once_per_process_and_any_write_is_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every run of a fused group re-verified the same data set files (0.37 s a run on
    digits4); a settled file's sha256 is now remembered, and a write (same size, mtime set
    back) or a freshly written file is hashed again."""
    import builtins
    import hashlib
    import os
    import time

    from protofl.data import cache

    reads: list[str] = []
    real_open = builtins.open

    def counting_open(file: object, mode: str = "r", *args: object, **kw: object) -> object:
        if str(file).endswith(".bin") and "b" in mode:
            reads.append(str(file))
        return real_open(file, mode, *args, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr(builtins, "open", counting_open)
    old = tmp_path / "old.bin"
    old.write_bytes(b"a" * 1000)
    past = 1_600_000_000_000_000_000
    os.utime(old, ns=(past, past))
    # its ctime is now; wait until the ctime is settled too (by making the window small)
    monkeypatch.setattr(cache, "SETTLED_NS", 0)
    first = cache.sha256_file(old)
    assert first == hashlib.sha256(b"a" * 1000).hexdigest()
    assert cache.sha256_file(old) == first
    assert len(reads) == 1  # the second call read nothing
    time.sleep(0.05)  # past the file system's timestamp granularity (a jiffy at most)
    old.write_bytes(b"b" * 1000)  # same size; the mtime set back; the ctime moves
    os.utime(old, ns=(past, past))
    assert cache.sha256_file(old) == hashlib.sha256(b"b" * 1000).hexdigest()
    assert len(reads) == 2
    # a file touched within the window is never remembered
    monkeypatch.setattr(cache, "SETTLED_NS", 10**18)
    fresh = tmp_path / "fresh.bin"
    fresh.write_bytes(b"c" * 10)
    cache.sha256_file(fresh)
    cache.sha256_file(fresh)
    assert len(reads) == 4
