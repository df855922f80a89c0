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
from pathlib import Path

import numpy as np
import torch

from protofl.data.cache import load_arrays, map_array, save_array
from protofl.models.backbones import FrozenBackbone

log = logging.getLogger(__name__)

FEATURE_DTYPES = {"float32": np.float32, "float16": np.float16}


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
) -> torch.Tensor:
    """Frozen representation of ``images`` (``[N, ...]`` of ``dtype``: pooled features, or a
    ViT's token prefix), read from the memory-mapped cache or computed and stored."""
    if dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature dtype {dtype!r}; choose one of {sorted(FEATURE_DTYPES)}")
    if not use_cache:
        return _encode(backbone, images, dataset, domain, split).to(getattr(torch, dtype))
    path = feature_cache_path(home, backbone, dataset, domain, split, images)
    full = _mapped(path, len(images), np.float32)
    if full is None:
        legacy = load_arrays(path.with_suffix(".npz"))  # the format before memory mapping
        if legacy is not None and legacy["features"].shape[0] == len(images):
            feats = legacy["features"].astype(np.float32, copy=False)
            log.info("converted %s to %s", path.with_suffix(".npz"), path.name)
        else:
            feats = _encode(backbone, images, dataset, domain, split).numpy()
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


def _encode(
    backbone: FrozenBackbone, images: np.ndarray, dataset: str, domain: str, split: str
) -> torch.Tensor:
    from protofl.report.progress import step

    with step(
        f"features {dataset}/{domain}/{split}: {len(images)} images through {backbone.name}",
        len(images),
        "images",
    ):
        feats = backbone.encode(images)
    if not torch.isfinite(feats).all():
        raise ValueError(
            f"backbone {backbone.name!r} produced non-finite features for "
            f"{dataset}/{domain}/{split}"
        )
    return feats
