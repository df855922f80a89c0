"""The frozen-feature cache: computed once per (backbone, input size, data set, domain, split).

Files are ``<home>/features/<backbone key>/<data set>/<domain>-<split>-<digest>.npy`` (float32),
content-addressed by the exact inputs, checksummed, and memory-mapped when read: the clients of
a run and the worker processes of a sweep share the operating system's one copy of the pages.
``backbone.feature_dtype: float16`` keeps a float16 copy next to it (``...-<digest>.f16.npy``,
derived from the float32 file) and hands out float16 tensors: half the feature memory; the
client models compute in float32 (the engine upcasts each batch).  Caches written by earlier
versions as ``.npz`` are converted on first read.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import numpy as np
import torch

from protofl.data.cache import load_arrays, map_array, save_array
from protofl.models.backbones import FrozenBackbone

log = logging.getLogger(__name__)

FEATURE_DTYPES = {"float32": np.float32, "float16": np.float16}

#: the environment variable that fixes the encoding batch size on a GPU (default: chosen from
#: the free memory, at most ENCODE_BATCH_CAP)
ENV_ENCODE_BATCH = "PROTOFL_ENCODE_BATCH"
ENCODE_BATCH_CAP = 1024
# share of the free GPU memory one encoding batch may take
ENCODE_MEMORY_SHARE = 0.5


def input_digest(inputs: np.ndarray) -> str:
    """Content hash of images (bytes) or texts (the strings themselves, not object pointers)."""
    h = hashlib.sha256()
    if inputs.dtype == object:
        for text in inputs:
            h.update(str(text).encode("utf-8"))
            h.update(b"\x00")
    else:
        h.update(str(inputs.shape).encode())
        h.update(np.ascontiguousarray(inputs).tobytes())
    return h.hexdigest()[:16]


def feature_cache_path(
    home: Path, backbone: FrozenBackbone, dataset: str, domain: str, split: str, images: np.ndarray
) -> Path:
    """Cache file (float32 ``.npy``) for these exact images under this backbone."""
    digest = input_digest(images)
    return home / "features" / backbone.cache_key / dataset / f"{domain}-{split}-{digest}.npy"


def _mapped(path: Path, rows: int, dtype: type) -> np.ndarray | None:
    arr = map_array(path)
    # [N, d] pooled features, or [N, tokens, d] for a ViT's frozen prefix
    if arr is None or arr.ndim < 2 or arr.shape[0] != rows or arr.dtype != dtype:
        return None
    return arr


def cached_features(
    home: Path,
    backbone: FrozenBackbone,
    dataset: str,
    domain: str,
    split: str,
    images: np.ndarray,
    *,
    use_cache: bool = True,
    dtype: str = "float32",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Frozen representation of ``images`` (``[N, ...]`` of ``dtype``: pooled features, or a
    ViT's token prefix), read from the memory-mapped cache or computed and stored.

    ``device`` (a ``run.device`` value or a torch device): where the backbone encodes what is
    not cached.  The cache is the same on every device (float32 on disk, the same path; a GPU's
    features differ from the CPU's by float rounding, and whichever was written first is used);
    the returned tensor is on the CPU."""
    if dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature dtype {dtype!r}; choose one of {sorted(FEATURE_DTYPES)}")
    if not use_cache:
        encoded = _encode(backbone, images, dataset, domain, split, device=device)
        return encoded.to(getattr(torch, dtype))
    path = feature_cache_path(home, backbone, dataset, domain, split, images)
    full = _mapped(path, len(images), np.float32)
    if full is None:
        legacy = load_arrays(path.with_suffix(".npz"))  # the format before memory mapping
        if legacy is not None and legacy["features"].shape[0] == len(images):
            feats = legacy["features"].astype(np.float32, copy=False)
            log.info("converted %s to %s", path.with_suffix(".npz"), path.name)
        else:
            feats = _encode(backbone, images, dataset, domain, split, device=device).numpy()
            log.info("cached %d %s features at %s", len(images), backbone.name, path)
        save_array(path, feats)
        full = _mapped(path, len(images), np.float32)
        if full is None:  # the file system lost it between write and read: use the values
            return torch.from_numpy(np.array(feats, dtype=FEATURE_DTYPES[dtype]))
    if dtype == "float32":
        return torch.from_numpy(full)
    half_path = path.with_name(path.name[: -len(".npy")] + ".f16.npy")
    half = _mapped(half_path, len(images), np.float16)
    if half is None:
        save_array(half_path, full.astype(np.float16))
        half = _mapped(half_path, len(images), np.float16)
        if half is None:
            return torch.from_numpy(full.astype(np.float16))
    return torch.from_numpy(half)


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cpu")
    if isinstance(device, torch.device):
        return device
    from protofl.models.device import prepare_device

    return prepare_device(device)


def encode_batch_size(
    backbone: FrozenBackbone, images: np.ndarray, device: torch.device
) -> int | None:
    """The encoding batch size on ``device``: ``PROTOFL_ENCODE_BATCH`` when set; on a GPU one
    from the free memory (a probe batch measures the peak memory per image; half the free
    memory, at most :data:`ENCODE_BATCH_CAP`); None on the CPU (the backbone's default)."""
    fixed = os.environ.get(ENV_ENCODE_BATCH)
    if fixed:
        try:
            value = int(fixed)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{ENV_ENCODE_BATCH}={fixed!r}: write a positive integer")
        return value
    if device.type != "cuda" or len(images) == 0:
        return None
    probe = images[: min(8, len(images))]
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    backbone.encode(probe, batch_size=len(probe), device=device)
    torch.cuda.synchronize(device)
    per_image = max(1, (torch.cuda.max_memory_allocated(device) - before) // len(probe))
    free, _total = torch.cuda.mem_get_info(device)
    return int(max(1, min(ENCODE_BATCH_CAP, ENCODE_MEMORY_SHARE * free // per_image)))


def _is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def encode_on_device(
    backbone: FrozenBackbone,
    images: np.ndarray,
    device: torch.device,
    batch_size: int | None,
) -> torch.Tensor:
    """``backbone.encode`` in chunks of ``batch_size`` on ``device``; out of (GPU) memory, the
    chunk is retried at half the batch size, down to 1, then it fails naming the batch size and
    the setting that controls it."""
    if batch_size is None:
        return backbone.encode(images, device=device)
    outs: list[torch.Tensor] = []
    start, bs = 0, batch_size
    while start < len(images):
        chunk = images[start : start + bs]
        try:
            outs.append(backbone.encode(chunk, batch_size=bs, device=device))
        except (RuntimeError, MemoryError) as exc:
            if not _is_out_of_memory(exc):
                raise
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if bs == 1:
                raise RuntimeError(
                    f"out of memory on {device} encoding with {backbone.name!r} at batch size "
                    f"{bs} (started at {batch_size}); free memory on the device, set "
                    f"{ENV_ENCODE_BATCH} smaller, a smaller backbone.image_size, or "
                    "run.device=cpu"
                ) from None
            log.warning(
                "out of memory on %s at encoding batch size %d; retrying at %d (%s fixes it)",
                device,
                bs,
                bs // 2,
                ENV_ENCODE_BATCH,
            )
            bs //= 2
            continue
        start += len(chunk)
    if not outs:
        return backbone.encode(images[:0], device=device)
    return torch.cat(outs)


def _encode(
    backbone: FrozenBackbone,
    images: np.ndarray,
    dataset: str,
    domain: str,
    split: str,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    from protofl.progress import step

    dev = _device(device)
    items = getattr(backbone, "items", "images")
    with step(
        f"features {dataset}/{domain}/{split}: {len(images)} {items} through {backbone.name}",
        len(images),
        items,
    ):
        if dev.type == "cpu" and os.environ.get(ENV_ENCODE_BATCH) is None:
            feats = backbone.encode(images)  # the CPU path as it always was
        else:
            feats = encode_on_device(
                backbone, images, dev, encode_batch_size(backbone, images, dev)
            )
    if not torch.isfinite(feats).all():
        raise ValueError(
            f"backbone {backbone.name!r} produced non-finite features for "
            f"{dataset}/{domain}/{split}"
        )
    return feats
