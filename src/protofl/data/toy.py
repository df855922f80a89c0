"""``toy``: a tiny generated multi-domain image set (class patterns under domain colour shifts).

It exists for fast tests and examples; it is not a benchmark.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from protofl.data.base import (
    DATASET_REGISTRY,
    DatasetInfo,
    DomainData,
    DomainSplit,
    MultiDomainDataset,
)

TOY_DOMAINS = ("red", "green", "blue", "grey")


def make_toy(
    *, num_classes: int = 4, per_class: int = 40, size: int = 16, seed: int = 0
) -> MultiDomainDataset:
    """Four domains; class c is a bar at a class-specific position, domain sets colour and noise."""
    rng = np.random.default_rng(seed)
    domains = []
    for d, name in enumerate(TOY_DOMAINS):
        splits = []
        for n in (per_class, max(per_class // 2, 2)):
            imgs = np.zeros((num_classes * n, size, size, 3), dtype=np.float64)
            labels = np.repeat(np.arange(num_classes), n)
            for i, c in enumerate(labels):
                pos = int((c + 0.5) * size / num_classes)
                img = rng.normal(0.1 + 0.05 * d, 0.08, (size, size))
                img[max(pos - 1, 0) : pos + 2, :] += 0.8
                colour = np.full(3, 0.3)
                if d < 3:
                    colour[d] = 1.0
                imgs[i] = img[..., None] * colour
            arr = (np.clip(imgs, 0, 1) * 255).astype(np.uint8)
            splits.append(DomainSplit(arr, labels.astype(np.int64)))
        domains.append(DomainData(name, splits[0], splits[1], real=False, source="generated"))
    classes = tuple(f"class{c}" for c in range(num_classes))
    return MultiDomainDataset("toy", classes, tuple(domains))


def _load(home: Path, root: str | None) -> MultiDomainDataset:
    return make_toy()


DATASET_REGISTRY.add(
    "toy",
    DatasetInfo(
        name="toy",
        loader=_load,
        description="tiny generated 4-domain, 4-class set for tests (not a benchmark)",
        how_to_get="generated in memory; always available",
        is_available=lambda home: True,
    ),
)
