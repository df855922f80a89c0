"""The mechanism contract: features and labels in, a privatised prototype release out."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from protofl.privacy.config import PrivacyConfig
from protofl.privacy.noise import NoiseSource
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


def release_to_dict(release: Release | None) -> dict[str, Any] | None:
    """A Release as plain containers (safe for ``torch.load(weights_only=True)``)."""
    if release is None:
        return None
    return {
        "prototypes": release.prototypes,
        "classes": release.classes,
        "counts": release.counts,
        "sensitivity": release.sensitivity,
        "noise_std": release.noise_std,
        "mechanism": release.mechanism,
        "events": release.events,
        "info": release.info,
        "diagnostics": release.diagnostics,
    }


def release_from_dict(data: dict[str, Any] | None) -> Release | None:
    """Inverse of :func:`release_to_dict`."""
    return None if data is None else Release(**data)


class Mechanism(ABC):
    """A local-DP release of class (or cluster) prototypes, calibrated once for a whole run."""

    name: str = "base"
    guarantees: ClassVar[bool] = True  # whether releases carry a DP guarantee
    auditable: ClassVar[bool] = True  # whether one client's release alone can be audited

    def __init__(self, config: PrivacyConfig, *, rounds: int, dim: int) -> None:
        self.config = config
        self.rounds = rounds
        self.dim = dim

    @property
    def is_private(self) -> bool:
        """Whether releases carry a DP guarantee."""
        return self.guarantees

    @abstractmethod
    def release(
        self,
        features: torch.Tensor,
        labels: torch.Tensor,
        *,
        num_classes: int,
        generator: NoiseSource,
        client: str = "client",
        cluster_fn: ClusterFn | None = None,
    ) -> Release:
        """Clip, build prototypes per class (or per cluster within a class) and add noise."""

    # release of many clients at once: the default is the per-client loop; a mechanism whose
    # release can run as tensor operations over all clients says so with ``vectorised`` and
    # implements ``_release_vectorised``.  A subclass that overrides any step of the per-client
    # release (``release`` or one of ``RELEASE_STEPS``) without declaring ``vectorised`` itself
    # falls back to the loop, so the vectorised path never skips an overridden step.
    vectorised: ClassVar[bool] = False
    RELEASE_STEPS: ClassVar[tuple[str, ...]] = (
        "release",
        "bounded_scores",
        "scores",
        "_build",
        "_check",
        "_charge",
        "_clip",
        "_finish",
        "_history_mask",
        "_noisy",
        "_remember",
        "_select",
        "_unit_std",
        "_warn_small",
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "vectorised" not in cls.__dict__ and any(h in cls.__dict__ for h in cls.RELEASE_STEPS):
            cls.vectorised = False

    def release_many(
        self,
        features: Sequence[torch.Tensor],
        labels: Sequence[torch.Tensor],
        *,
        num_classes: int,
        generators: Sequence[NoiseSource],
        clients: Sequence[str],
        cluster_fn: ClusterFn | None = None,
        vectorise: bool = True,
    ) -> list[Release]:
        """``[self.release(features[i], labels[i], ...) for i]``: one release per client, each
        drawing from its own generator, in client order.

        Mechanisms with ``vectorised`` true compute the same releases for all clients at once
        (the same draws in the same order, the same charges and warnings; prototypes agree to
        float rounding) whenever :func:`vectorisable` holds, and loop otherwise (or when
        ``vectorise`` is false: bitwise the per-client releases).
        """
        m = len(features)
        if not (len(labels) == len(generators) == len(clients) == m):
            raise ValueError(
                "release_many: features, labels, generators and clients differ in length"
            )
        if m == 0:
            return []
        if (
            vectorise
            and self.vectorised
            and vectorisable(self.config, features, labels, generators, num_classes, cluster_fn)
        ):
            return self._release_vectorised(features, labels, num_classes, generators, clients)
        return [
            self.release(
                features[i],
                labels[i],
                num_classes=num_classes,
                generator=generators[i],
                client=clients[i],
                cluster_fn=cluster_fn,
            )
            for i in range(m)
        ]

    def _release_vectorised(
        self,
        features: Sequence[torch.Tensor],
        labels: Sequence[torch.Tensor],
        num_classes: int,
        generators: Sequence[NoiseSource],
        clients: Sequence[str],
    ) -> list[Release]:
        """The vectorised release (mechanisms with ``vectorised`` true implement it)."""
        raise TypeError(f"mechanism {self.name!r} has no vectorised release")

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe mechanism state for checkpoints (default: none)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (default: nothing to restore)."""
        del state

    def describe(self) -> dict[str, Any]:
        """Calibration facts for the run summary (sigma, accountant, neighbouring relation)."""
        return {"mechanism": self.name}

    def calibration(self) -> dict[str, Any]:
        """The noise this calibration adds, as numbers (``protofl privacy calibrate`` prints
        them): at least ``sigma``, the noise multiplier of one release, for a private
        mechanism.  Default: none."""
        return {}

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


def charge_release(released: dict[str, int], client: str, limit: int) -> None:
    """Count one release of ``client`` in ``released``; past the ``limit`` the calibration
    covers, refuse before anything is drawn."""
    used = released.get(client, 0)
    if used >= limit:
        raise RuntimeError(
            f"client {client!r} has already made the {limit} releases the mechanism was "
            "calibrated for; another release would exceed its privacy budget"
        )
    released[client] = used + 1


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


def vectorisable(
    config: PrivacyConfig,
    features: Sequence[torch.Tensor],
    labels: Sequence[torch.Tensor],
    generators: Sequence[NoiseSource],
    num_classes: int,
    cluster_fn: ClusterFn | None,
) -> bool:
    """Whether a vectorised release gives the per-client releases: no cluster releases, no
    noisy add/remove counts, one CPU generator per client, CPU features without grad of one
    floating dtype, labels in range."""
    return (
        cluster_fn is None
        and not config.sampled  # a Poisson subsample per client: the per-client release
        and not (config.neighbouring == "add_remove" and config.addremove_counts == "noisy")
        and len({id(g) for g in generators}) == len(generators)
        and all(g.device.type == "cpu" for g in generators)
        and all(f.device.type == "cpu" and not f.requires_grad for f in features)
        and all(f.ndim == 2 for f in features)
        and len({f.dtype for f in features}) == 1
        and features[0].is_floating_point()
        and all(
            lab.numel() == 0 or (int(lab.min()) >= 0 and int(lab.max()) < num_classes)
            for lab in labels
        )
    )


def _segments(
    features: Sequence[torch.Tensor], labels: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    sizes = [int(f.shape[0]) for f in features]
    x = torch.cat(list(features))
    y = torch.cat([lab.to(torch.long) for lab in labels])
    seg = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return x, y, seg, sizes


def _class_sums(
    x: torch.Tensor, y: torch.Tensor, seg: torch.Tensor, m: int, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (client, class) present: float64 sums, counts, client index, class index (ordered by
    client, then class, as :func:`group_means`)."""
    key = seg * num_classes + y
    counts = torch.bincount(key, minlength=m * num_classes)
    sums = torch.zeros(m * num_classes, x.shape[1], dtype=torch.float64)
    sums.index_add_(0, key, x.detach().to(torch.float64))
    present = torch.nonzero(counts > 0).flatten()
    return sums[present], counts[present], present // num_classes, present % num_classes


def _plain_many(
    features: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], num_classes: int
) -> list[Release]:
    x, y, seg, sizes = _segments(features, labels)
    sums, counts, owner, classes = _class_sums(x, y, seg, len(sizes), num_classes)
    protos = (sums / counts[:, None].to(torch.float64)).to(x.dtype)
    per = torch.bincount(owner, minlength=len(sizes)).tolist()
    out = []
    for p, c, n in zip(protos.split(per), classes.split(per), counts.split(per)):
        out.append(
            Release(
                prototypes=p.clone(),
                classes=c.clone(),
                counts=n.clone(),
                sensitivity=torch.full((len(c),), math.inf),
                noise_std=torch.zeros_like(p),
                mechanism=NoPrivacy.name,
            )
        )
    return out


@MECHANISM_REGISTRY.register("none")
class NoPrivacy(Mechanism):
    """Class means of the unclipped features; no noise, no guarantee."""

    name = "none"
    guarantees = False

    def release(
        self,
        features: torch.Tensor,
        labels: torch.Tensor,
        *,
        num_classes: int,
        generator: NoiseSource,
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

    vectorised = True

    def _release_vectorised(
        self,
        features: Sequence[torch.Tensor],
        labels: Sequence[torch.Tensor],
        num_classes: int,
        generators: Sequence[NoiseSource],
        clients: Sequence[str],
    ) -> list[Release]:
        for f, client in zip(features, clients):
            check_finite(f, client)
        return _plain_many(features, labels, num_classes)

    def describe(self) -> dict[str, Any]:
        """No calibration."""
        return {"mechanism": "none", "epsilon": None, "note": "no privacy guarantee"}


def private_mechanisms() -> list[str]:
    """Registered names of the per-client mechanisms that carry a DP guarantee (what the
    release audit tests; ``ddg``'s shares mean nothing alone, its audit is the sum's)."""
    return [
        n
        for n in MECHANISM_REGISTRY.names()
        if MECHANISM_REGISTRY.get(n).guarantees and MECHANISM_REGISTRY.get(n).auditable
    ]


def sum_mechanisms() -> list[str]:
    """Registered names of the mechanisms whose guarantee is on a secure sum (``ddg``): their
    audit is the decoded sum's (:mod:`protofl.attacks.audit_sum`)."""
    return [
        n
        for n in MECHANISM_REGISTRY.names()
        if MECHANISM_REGISTRY.get(n).guarantees
        and getattr(MECHANISM_REGISTRY.get(n), "secure_sum_mechanism", False)
    ]


def create_mechanism(config: PrivacyConfig, *, rounds: int, dim: int) -> Mechanism:
    """Instantiate the configured release mechanism (``vpdr`` is VPP's name with DCR on)."""
    cls = MECHANISM_REGISTRY.get(config.mechanism)
    return cls(config, rounds=rounds, dim=dim)
