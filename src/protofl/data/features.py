"""The frozen-feature cache: computed once per (backbone, input size, data set, domain, split)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import torch

from protofl.data.cache import load_arrays, save_arrays
from protofl.models.backbones import FrozenBackbone

log = logging.getLogger(__name__)


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
    """Cache file for these exact images under this backbone (content-addressed)."""
    digest = input_digest(images)
    return home / "features" / backbone.cache_key / dataset / f"{domain}-{split}-{digest}.npz"


def cached_features(
    home: Path,
    backbone: FrozenBackbone,
    dataset: str,
    domain: str,
    split: str,
    images: np.ndarray,
    *,
    use_cache: bool = True,
) -> torch.Tensor:
    """Frozen representation of ``images``, read from the cache or computed and stored."""
    path = feature_cache_path(home, backbone, dataset, domain, split, images)
    if use_cache:
        hit = load_arrays(path)
        if hit is not None and hit["features"].shape[0] == len(images):
            return torch.from_numpy(hit["features"]).float()
    feats = backbone.encode(images)
    if not torch.isfinite(feats).all():
        raise ValueError(
            f"backbone {backbone.name!r} produced non-finite features for "
            f"{dataset}/{domain}/{split}"
        )
    if use_cache:
        save_arrays(path, features=feats.numpy())
        log.info("cached %d %s features at %s", len(images), backbone.name, path)
    return feats
