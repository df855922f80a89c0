"""The feature cache on run.device: batch size, out-of-memory retries, the same file on disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from protofl.data.features import (
    ENV_ENCODE_BATCH,
    cached_features,
    encode_batch_size,
    encode_on_device,
)
from protofl.models.backbones import PixelProjection


class _Tight(PixelProjection):
    """Runs out of memory on any batch larger than ``limit`` (as a GPU would)."""

    limit = 3

    def __init__(self, image_size: int) -> None:
        super().__init__(image_size)
        self.batches: list[int] = []

    def encode_batch(self, images: torch.Tensor) -> torch.Tensor:
        self.batches.append(len(images))
        if len(images) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().encode_batch(images)


def _images(n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)


def test_out_of_memory_halves_the_batch_and_gives_the_same_features() -> None:
    images = _images(10)
    tight = _Tight(8)
    out = encode_on_device(tight, images, torch.device("cpu"), 8)
    # the same features to float rounding: a matrix product over fewer rows may take another
    # BLAS kernel (bitwise equal on some processors, not on others)
    torch.testing.assert_close(out, PixelProjection(8).encode(images), atol=1e-6, rtol=1e-5)
    assert tight.batches[:3] == [8, 4, 2]  # 8 fails, 4 fails, 2 fits, then stays at 2
    assert max(b for b in tight.batches[2:]) <= 3


def test_out_of_memory_at_batch_one_names_the_batch_size_and_the_setting() -> None:
    tight = _Tight(8)
    tight.limit = 0
    with pytest.raises(RuntimeError) as info:
        encode_on_device(tight, _images(4), torch.device("cpu"), 4)
    message = str(info.value)
    assert "batch size 1 (started at 4)" in message and ENV_ENCODE_BATCH in message
    assert "run.device=cpu" in message


def test_other_errors_are_not_retried() -> None:
    class Broken(PixelProjection):
        def encode_batch(self, images: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        encode_on_device(Broken(8), _images(4), torch.device("cpu"), 4)


def test_batch_size_from_the_environment_or_the_backbone_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bb = PixelProjection(8)
    assert encode_batch_size(bb, _images(3), torch.device("cpu")) is None
    monkeypatch.setenv(ENV_ENCODE_BATCH, "5")
    assert encode_batch_size(bb, _images(3), torch.device("cpu")) == 5
    monkeypatch.setenv(ENV_ENCODE_BATCH, "zero")
    with pytest.raises(ValueError, match=ENV_ENCODE_BATCH):
        encode_batch_size(bb, _images(3), torch.device("cpu"))


def test_the_cache_file_does_not_depend_on_the_device_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    images = _images(6)
    bb = PixelProjection(8)
    first = cached_features(tmp_path, bb, "toy", "red", "train", images, device="cpu")
    files = sorted(tmp_path.rglob("*.npy"))
    assert len(files) == 1
    monkeypatch.setenv(ENV_ENCODE_BATCH, "2")  # the chunked device path, here on the CPU
    again = cached_features(
        tmp_path, bb, "toy", "red", "train", images, device="auto", use_cache=False
    )
    torch.testing.assert_close(again, first, atol=1e-6, rtol=1e-5)  # chunks: float rounding
    read = cached_features(tmp_path, bb, "toy", "red", "train", images, device="auto")
    assert sorted(tmp_path.rglob("*.npy")) == files  # the same file, read back
    torch.testing.assert_close(read, first, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU")
def test_batch_size_from_free_gpu_memory() -> None:
    size = encode_batch_size(PixelProjection(8), _images(16), torch.device("cuda"))
    assert size is not None and 1 <= size <= 1024
