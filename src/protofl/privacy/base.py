"""The mechanism contract: features and labels in, a privatised prototype release out."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from protofl.privacy.config import PrivacyConfig
from protofl.registry import Registry

ClusterFn = Callable[[torch.Tensor], torch.Tensor]
"""Maps the (clipped) features of one class, [n, d], to cluster ids [n] (int64, 0..k-1)."""


@dataclass
class Release:
    """What one client uploads in one round, with the privacy facts that back it.

    ``prototypes[i]`` is the (noisy) mean of ``counts[i]`` clipped features of class
    ``classes[i]``; ``sensitivity[i]`` is its L2 sensitivity and ``noise_std[i]`` the
    per-dimension standard deviation of the Gaussian noise actually added.

    ``info`` holds public facts of the calibration (sigma, k): they may travel with the release.
    ``diagnostics`` holds figures computed on the client's private data outside the mechanism
    (VPP's partition overlap): **local-only**, never part of an upload, not covered by the DP
    guarantee.  Engines keep them in the client's local log and run files.
    """

    prototypes: torch.Tensor
    classes: torch.Tensor
    counts: torch.Tensor
    sensitivity: torch.Tensor
    noise_std: torch.Tensor
    mechanism: str
    events: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, float] = field(default_factory=dict)
    diagnostics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        k = self.prototypes.shape[0]
        for name in ("classes", "counts", "sensitivity"):
            if getattr(self, name).shape != (k,):
                raise ValueError(f"Release.{name} must have shape ({k},)")
        if self.noise_std.shape != self.prototypes.shape:
            raise ValueError("Release.noise_std must have the prototypes' shape")

    @property
    def num_prototypes(self) -> int:
        """Number of released prototypes (classes, or clusters over classes)."""
        return int(self.prototypes.shape[0])


class Mechanism(ABC):
    """A local-DP release of class (or cluster) prototypes, calibrated once for a whole run."""

    name: str = "base"

    def __init__(self, config: PrivacyConfig, *, rounds: int, dim: int) -> None:
        self.config = config
        self.rounds = rounds
        self.dim = dim

    @property
    def is_private(self) -> bool:
        """Whether releases carry a DP guarantee."""
        return True

    @abstractmethod
    def release(
        self,
        features: torch.Tensor,
        labels: torch.Tensor,
        *,
        num_classes: int,
        generator: torch.Generator,
        client: str = "client",
        cluster_fn: ClusterFn | None = None,
    ) -> Release:
        """Clip, build prototypes per class (or per cluster within a class) and add noise."""

    def describe(self) -> dict[str, Any]:
        """Calibration facts for the run summary (sigma, accountant, neighbouring relation)."""
        return {"mechanism": self.name}

    def release_events(self, release_index: int) -> list[dict[str, Any]]:
        """The DP events the ``release_index``-th (0-based) release of a client costs under this
        calibration: what a server charges, whatever the client declares.  Default: none."""
        return []

    def max_noise_std(self, count: int) -> float | None:
        """Largest per-dimension noise std this calibration adds to a prototype of ``count``
        samples; None when releases are not clipped (then no norm bound exists)."""
        return None

    def norm_bound(self, count: int, *, false_reject: float = 1e-9) -> float | None:
        """Largest plausible L2 norm of an honest release of ``count`` samples.

        Clipped features give a mean of norm <= R; Gaussian noise of per-dimension std <= s in d
        dimensions exceeds ``s * sqrt(d + 2 sqrt(d t) + 2 t)`` with probability <= e^-t
        (Laurent and Massart, 2000), t = ln(1/false_reject). So an honest upload is rejected
        with probability at most ``false_reject``. None: no bound (no clipping).
        """
        s = self.max_noise_std(count)
        if s is None:
            return None
        t = math.log(1.0 / false_reject)
        d = self.dim
        return float(self.config.clip + s * math.sqrt(d + 2.0 * math.sqrt(d * t) + 2.0 * t))


MECHANISM_REGISTRY: Registry[type[Mechanism]] = Registry("mechanism")


def check_finite(features: torch.Tensor, client: str) -> None:
    """Fail naming the client when features hold NaN or inf."""
    if not torch.isfinite(features).all():
        bad = int((~torch.isfinite(features)).any(dim=-1).sum())
        raise ValueError(f"client {client!r}: {bad} feature vectors are not finite (NaN or inf)")


def group_means(
    features: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_classes: int,
    cluster_fn: ClusterFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-class (or per-cluster within class) means; classes with no samples are skipped."""
    protos: list[torch.Tensor] = []
    classes: list[int] = []
    counts: list[int] = []
    for c in range(num_classes):
        mask = labels == c
        n = int(mask.sum())
        if n == 0:
            continue
        fc = features[mask]
        if cluster_fn is None:
            protos.append(fc.mean(dim=0))
            classes.append(c)
            counts.append(n)
            continue
        assign = cluster_fn(fc)
        for k in torch.unique(assign).tolist():
            members = fc[assign == k]
            protos.append(members.mean(dim=0))
            classes.append(c)
            counts.append(int(members.shape[0]))
    d = features.shape[-1]
    if not protos:
        return (
            torch.zeros(0, d, dtype=features.dtype),
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
        )
    return (
        torch.stack(protos),
        torch.tensor(classes, dtype=torch.long),
        torch.tensor(counts, dtype=torch.long),
    )


@MECHANISM_REGISTRY.register("none")
class NoPrivacy(Mechanism):
    """Class means of the unclipped features; no noise, no guarantee."""

    name = "none"

    @property
    def is_private(self) -> bool:
        """No DP guarantee."""
        return False

    def release(
        self,
        features: torch.Tensor,
        labels: torch.Tensor,
        *,
        num_classes: int,
        generator: torch.Generator,
        client: str = "client",
        cluster_fn: ClusterFn | None = None,
    ) -> Release:
        """Plain class (or cluster) means."""
        check_finite(features, client)
        protos, classes, counts = group_means(
            features, labels, num_classes=num_classes, cluster_fn=cluster_fn
        )
        return Release(
            prototypes=protos,
            classes=classes,
            counts=counts,
            sensitivity=torch.full((len(classes),), math.inf),
            noise_std=torch.zeros_like(protos),
            mechanism=self.name,
        )

    def describe(self) -> dict[str, Any]:
        """No calibration."""
        return {"mechanism": "none", "epsilon": None, "note": "no privacy guarantee"}


def create_mechanism(config: PrivacyConfig, *, rounds: int, dim: int) -> Mechanism:
    """Instantiate the configured release mechanism (``vpdr`` means ``vpp``)."""
    cls = MECHANISM_REGISTRY.get(config.base_mechanism)
    return cls(config, rounds=rounds, dim=dim)
