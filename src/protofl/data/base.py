"""In-memory multi-domain image data sets: what every loader returns."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from protofl.registry import Registry


@dataclass(frozen=True)
class DomainSplit:
    """Inputs and labels (int64, [N]) of one split of one domain.

    ``images`` holds uint8 images [N, H, W, 3], or for text data sets a 1-D object array of str
    (the backbone decides how to encode them).
    """

    images: np.ndarray
    labels: np.ndarray

    def __post_init__(self) -> None:
        is_image = (
            self.images.ndim == 4 and self.images.shape[-1] == 3 and self.images.dtype == np.uint8
        )
        is_text = self.images.ndim == 1 and self.images.dtype == object
        if not (is_image or is_text):
            raise ValueError(
                "inputs must be uint8 images [N, H, W, 3] or a 1-D object array of str, got "
                f"{self.images.dtype} {self.images.shape}"
            )
        if self.labels.shape != (self.images.shape[0],):
            raise ValueError("labels must have one entry per image")

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class DomainData:
    """One domain: its name, a fixed train/test split, and whether its images are real."""

    name: str
    train: DomainSplit
    test: DomainSplit
    real: bool
    source: str = ""


@dataclass(frozen=True)
class MultiDomainDataset:
    """Several domains over one label space."""

    name: str
    classes: tuple[str, ...]
    domains: tuple[DomainData, ...]

    @property
    def num_classes(self) -> int:
        """Size of the shared label space."""
        return len(self.classes)

    def domain(self, name: str) -> DomainData:
        """Look a domain up by name, failing with the valid names."""
        for d in self.domains:
            if d.name == name:
                return d
        raise ValueError(
            f"data set {self.name!r} has no domain {name!r}; domains: "
            + ", ".join(d.name for d in self.domains)
        )


@dataclass(frozen=True)
class DatasetInfo:
    """Registry entry: how to load a data set and how a user gets it."""

    name: str
    loader: Callable[..., MultiDomainDataset]
    description: str
    how_to_get: str
    is_available: Callable[[Path], bool]
    # ``preflight(root, options)``: checks the root, its layout and the options without
    # decoding anything (run before a run folder is made); raises naming what is wrong
    preflight: Callable[[str | None, Mapping[str, Any]], None] | None = None


DATASET_REGISTRY: Registry[DatasetInfo] = Registry("data set")
