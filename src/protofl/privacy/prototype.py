"""The common release pipeline of IGPP and VPP (VPDR Sec. 4.1): per-example clipping, class
(or cluster) means, Gaussian noise, the neighbouring relations, the per-client budget guard, the
small-class warning, Poisson subsampling (``privacy.sample_rate``) and the vectorised release of
many clients.  The mechanisms themselves live one per file (:mod:`protofl.privacy.igpp`,
:mod:`protofl.privacy.vpp`) and are calibrated once for a whole run (``rounds`` releases per
client) in ``__init__``; each keeps a little per-client state (how often a client has released,
VPP's cached partition or release history), so one instance can serve every client of a
simulation.

Neighbouring relations (``PrivacyConfig.neighbouring``):

* ``replace_one`` (the papers'): D' replaces one example of D by another with the same label;
  class counts are public.  A prototype is the mean of n clipped features, Delta = 2R/n.
* ``add_remove``: D' adds or removes one example.  The released quantity is the class SUM of
  clipped features (Delta = R), divided by the count.  Counts are either public by assumption
  (``addremove_counts: public``) or released with Gaussian noise and charged
  (``addremove_counts: noisy``; then every class is released, empty or not).
"""

from __future__ import annotations

import logging
import math
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from protofl.privacy.base import (
    ClusterFn,
    Mechanism,
    Release,
    _class_sums,
    _segments,
    charge_release,
    check_finite,
    group_means,
)
from protofl.privacy.config import PrivacyConfig
from protofl.privacy.noise import NoiseSource, draw_normal, draw_permutation, draw_uniform

logger = logging.getLogger(__name__)

logger = logging.getLogger(__name__)

NEIGHBOURING_NOTES = {
    "replace_one": (
        "replace-one-example, label unchanged, class counts public; protects the feature "
        "content of any one example, not its presence or its label"
    ),
    "add_remove": (
        "add/remove-one-example; protects the presence of any one example (its features and, "
        "with noisy counts, its label); with public counts, the counts themselves are assumed "
        "public"
    ),
}


# --------------------------------------------------------------------------------------------
# building blocks (vectorised over examples and dimensions)
# --------------------------------------------------------------------------------------------
def clip_l2(features: torch.Tensor, radius: float) -> torch.Tensor:
    """Per-example L2 clipping z <- z * min(1, R/||z||).  VPDR Eq. (4)."""
    norms = features.norm(dim=-1, keepdim=True)
    return features * torch.clamp(radius / norms.clamp_min(1e-30), max=1.0)


def clip_groups(
    features: torch.Tensor, mask_a: torch.Tensor, radius_a: float, radius_b: float
) -> torch.Tensor:
    """Groupwise clipping z_A <- z_A min(1, R_A/||z_A||), z_B likewise.  VPDR Eq. (11)."""
    m = mask_a.to(features.dtype)
    sq = features * features
    norm_a = (sq * m).sum(dim=-1, keepdim=True).sqrt()
    norm_b = (sq * (1 - m)).sum(dim=-1, keepdim=True).sqrt()
    s_a = torch.clamp(radius_a / norm_a.clamp_min(1e-30), max=1.0)
    s_b = torch.clamp(radius_b / norm_b.clamp_min(1e-30), max=1.0)
    return features * torch.where(mask_a, s_a, s_b)


def random_mask(dim: int, k: int, generator: NoiseSource) -> torch.Tensor:
    """A uniformly random k-subset of the dimensions (data-independent)."""
    mask = torch.zeros(dim, dtype=torch.bool)
    mask[draw_permutation(generator, dim, "random-partition")[:k]] = True
    return mask


@dataclass
class _Built:
    """Noiseless prototypes with per-row sensitivity and per-dimension noise std to apply."""

    protos: torch.Tensor
    classes: torch.Tensor
    counts: torch.Tensor
    sensitivity: torch.Tensor
    noise_std: torch.Tensor


# --------------------------------------------------------------------------------------------
# the common release pipeline
# --------------------------------------------------------------------------------------------
class _PrototypeMechanism(Mechanism):
    """Clip -> per-class (or per-cluster) means -> Gaussian noise; neighbouring relations;
    per-client budget guard; small-class warnings."""

    sigma: float  # effective Gaussian noise multiplier of one release (ledger event)

    def __init__(self, config: PrivacyConfig, *, rounds: int, dim: int) -> None:
        super().__init__(config, rounds=rounds, dim=dim)
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds={rounds!r} is out of range; allowed: integers >= 1")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
            raise ValueError(f"dim={dim!r} is out of range; allowed: integers >= 2")
        self._released: dict[str, int] = {}

    # --- hooks ------------------------------------------------------------------------------
    @abstractmethod
    def _unit_std(self, mask_a: torch.Tensor | None) -> torch.Tensor:
        """Per-dimension noise std on a class SUM per unit of (per-example) clip: [d]."""

    @abstractmethod
    def _clip(self, features: torch.Tensor, mask_a: torch.Tensor | None) -> torch.Tensor:
        """Per-example clipping of the release (plain for IGPP, groupwise for VPP)."""

    # --- noiseless construction -----------------------------------------------------------
    def _build(
        self,
        features: torch.Tensor,
        labels: torch.Tensor,
        num_classes: int,
        mask_a: torch.Tensor | None,
        cluster_fn: ClusterFn | None,
        keep: torch.Tensor | None = None,
    ) -> _Built:
        cfg = self.config
        clipped = self._clip(features, mask_a)
        unit = self._unit_std(mask_a).to(device=features.device, dtype=features.dtype)
        r = cfg.clip
        if keep is not None:
            if cluster_fn is not None:
                raise ValueError(
                    "privacy.sample_rate < 1 cannot release per-cluster prototypes (the clusters "
                    "depend on the data); use class prototypes or sample_rate 1"
                )
            if cfg.addremove_counts == "public":
                return self._build_sampled(clipped, labels, num_classes, unit, keep)
            # noisy counts: the noisy sum and noisy count of the subsample, as below
            clipped, labels = clipped[keep], labels[keep]
        if cfg.neighbouring == "add_remove" and cfg.addremove_counts == "noisy":
            if cluster_fn is not None:
                raise ValueError(
                    "neighbouring=add_remove with addremove_counts=noisy cannot release "
                    "per-cluster prototypes (the number of clusters depends on the data); use "
                    "public counts"
                )
            sums = torch.zeros(num_classes, self.dim, dtype=features.dtype, device=features.device)
            sums.index_add_(0, labels, clipped)
            counts = torch.bincount(labels, minlength=num_classes)
            n = counts.clamp_min(1).to(features.dtype).unsqueeze(1)
            # noise on the sum: sqrt(2)*unit (half of the 1/z^2 budget), see release()
            return _Built(
                protos=sums / n,
                classes=torch.arange(num_classes),
                counts=counts.cpu(),
                sensitivity=(r / n.squeeze(1)).cpu(),
                noise_std=(math.sqrt(2.0) * unit).expand(num_classes, -1) / n,
            )
        protos, classes, counts = group_means(
            clipped, labels, num_classes=num_classes, cluster_fn=cluster_fn
        )
        factor = 2.0 if cfg.neighbouring == "replace_one" else 1.0  # 2R/n (replace) or R/n
        n = counts.to(device=features.device, dtype=features.dtype).unsqueeze(1)
        return _Built(
            protos=protos,
            classes=classes,
            counts=counts,
            sensitivity=(factor * r / n.squeeze(1)).cpu(),
            noise_std=factor * unit.unsqueeze(0) / n,
        )

    def _build_sampled(
        self,
        clipped: torch.Tensor,
        labels: torch.Tensor,
        num_classes: int,
        unit: torch.Tensor,
        keep: torch.Tensor,
    ) -> _Built:
        """Add/remove with public counts, Poisson subsample ``keep``: the class sums of the
        sampled clipped features over the FIXED denominator q*n_c (n_c the public class count,
        not the realised sample size), so one example moves one class's release by at most
        R/(q n_c): the subsampled Gaussian on the sum, scaled."""
        q = self.config.sample_rate
        full = torch.bincount(labels, minlength=num_classes)
        classes = (full > 0).nonzero().flatten()
        sums = torch.zeros(num_classes, self.dim, dtype=clipped.dtype, device=clipped.device)
        sums.index_add_(0, labels[keep], clipped[keep])
        counts = full[classes]
        denom = q * counts.to(device=clipped.device, dtype=clipped.dtype).unsqueeze(1)
        return _Built(
            protos=sums[classes] / denom,
            classes=classes.cpu(),
            counts=counts.cpu(),
            sensitivity=(self.config.clip / denom.squeeze(1)).cpu(),
            noise_std=unit.unsqueeze(0) / denom,
        )

    def _sample(self, n: int, generator: NoiseSource, device: torch.device) -> torch.Tensor | None:
        """The Poisson subsample of one release (``privacy.sample_rate``): each of the ``n``
        examples kept with probability q, from the client's noise key; None when q = 1."""
        if not self.config.sampled:
            return None
        return (draw_uniform(generator, (n,), "poisson-sample") < self.config.sample_rate).to(
            device
        )

    def _gaussian_event(self) -> dict[str, Any]:
        """The ledger event of one release's Gaussian (subsampled when ``sample_rate < 1``)."""
        if self.config.sampled:
            return {
                "kind": "poisson_gaussian",
                "noise_multiplier": self.sigma,
                "sample_rate": self.config.sample_rate,
            }
        return {"kind": "gaussian", "noise_multiplier": self.sigma}

    def _check(
        self, features: torch.Tensor, labels: torch.Tensor, num_classes: int, client: str
    ) -> None:
        if features.ndim != 2 or features.shape[1] != self.dim:
            raise ValueError(
                f"client {client!r}: features must have shape [n, {self.dim}], got "
                f"{tuple(features.shape)}"
            )
        if labels.shape != (features.shape[0],):
            raise ValueError(f"client {client!r}: labels must have shape [{features.shape[0]}]")
        check_finite(features, client)
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
            raise ValueError(f"client {client!r}: labels must lie in [0, {num_classes})")

    def _charge(self, client: str) -> None:
        charge_release(self._released, client, self.rounds)

    def _warn_small(self, built: _Built, client: str) -> None:
        small = (built.counts < self.config.warn_min_count).nonzero().flatten().tolist()
        for i in small:
            n = int(built.counts[i])
            if n == 0:
                continue
            logger.warning(
                "client %r (local-only diagnostic): class %d prototype has only %d sample(s); "
                "released with its large "
                "sensitivity %.4g",
                client,
                int(built.classes[i]),
                n,
                float(built.sensitivity[i]),
                extra={"local_only": True},  # an exact count: the client's log, not run.log
            )

    def _noisy(
        self, built: _Built, generator: NoiseSource, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add the Gaussian noise; returns (prototypes, classes, counts, sensitivity, std)."""
        noise = draw_normal(generator, tuple(built.protos.shape), "gaussian", dtype).to(
            built.protos.device
        )
        cfg = self.config
        if cfg.neighbouring == "add_remove" and cfg.addremove_counts == "noisy":
            n_true = built.counts.to(device=built.protos.device, dtype=dtype).clamp_min(1.0)
            sums = built.protos * n_true.unsqueeze(1)
            std_sum = built.noise_std * n_true.unsqueeze(1)
            noisy_sum = sums + noise * std_sum
            count_noise = draw_normal(
                generator, (built.protos.shape[0],), "gaussian-count", dtype
            ).to(built.protos.device)
            noisy_n = (
                built.counts.to(built.protos.device, dtype)
                + math.sqrt(2.0) * self.sigma * count_noise
            )
            keep = noisy_n >= 0.5  # post-processing of the noisy count
            denom = noisy_n.clamp_min(1.0).unsqueeze(1)
            return (
                (noisy_sum / denom)[keep],
                built.classes[keep.cpu()],
                noisy_n.round().clamp_min(1.0).long().cpu()[keep.cpu()],
                (self.config.clip / denom.squeeze(1)).cpu()[keep.cpu()],
                (std_sum / denom)[keep],
            )
        return (
            built.protos + noise * built.noise_std,
            built.classes,
            built.counts,
            built.sensitivity,
            built.noise_std,
        )

    def _finish(
        self,
        built: _Built,
        *,
        generator: NoiseSource,
        client: str,
        dtype: torch.dtype,
        events: list[dict[str, Any]],
        info: dict[str, float],
        diagnostics: dict[str, float] | None = None,
    ) -> Release:
        protos, classes, counts, sens, std = self._noisy(built, generator, dtype)
        if built.protos.shape[0] > 0:
            # all per-class releases of one round compose in parallel: one Gaussian event
            events = [*events, self._gaussian_event()]
        return Release(
            prototypes=protos,
            classes=classes,
            counts=counts,
            sensitivity=sens,
            noise_std=std,
            mechanism=self.name,
            events=events,
            info={"sigma": float(self.sigma), **info},
            diagnostics=dict(diagnostics or {}),
        )

    @staticmethod
    def _dtype(features: torch.Tensor) -> torch.dtype:
        return features.dtype if features.is_floating_point() else torch.float32

    def _describe_common(self) -> dict[str, Any]:
        cfg = self.config
        out: dict[str, Any] = {
            "mechanism": self.name,
            "sigma": float(self.sigma),
            "accountant": cfg.accountant,
            "epsilon": cfg.epsilon,
            "delta": cfg.delta,
            "rounds": self.rounds,
            "neighbouring": cfg.neighbouring,
            "neighbouring_note": NEIGHBOURING_NOTES[cfg.neighbouring],
            "clip": cfg.clip,
        }
        if cfg.neighbouring == "add_remove":
            out["addremove_counts"] = cfg.addremove_counts
        if cfg.sampled:
            out["sample_rate"] = cfg.sample_rate
            out["sampling"] = (
                "Poisson: each example enters a release with probability sample_rate, drawn "
                "from the client's noise key; public counts divide by the fixed sample_rate*n"
            )
        return out

    def max_noise_std(self, count: int) -> float | None:
        """Largest per-dimension noise std added to a prototype of ``count`` samples."""
        cfg = self.config
        if cfg.neighbouring == "replace_one":
            factor = 2.0
        elif cfg.addremove_counts == "public":
            factor = 1.0 / cfg.sample_rate if cfg.sampled else 1.0  # fixed denominator q*n
        else:
            factor = math.sqrt(2.0)  # noisy sum / released (noisy) count
        return factor * float(self._max_unit_std()) / max(int(count), 1)

    @abstractmethod
    def _max_unit_std(self) -> float:
        """Largest per-dimension entry of ``_unit_std`` over any partition."""

    def release_events(self, release_index: int) -> list[dict[str, Any]]:
        """One Gaussian event of multiplier ``sigma`` per release (VPP adds its selection)."""
        return [self._gaussian_event()]

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-safe per-client state (release counters)."""
        return {"released": dict(self._released)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        self._released = {str(k): int(v) for k, v in state.get("released", {}).items()}

    def _release_vectorised(
        self,
        features: Sequence[torch.Tensor],
        labels: Sequence[torch.Tensor],
        num_classes: int,
        generators: Sequence[NoiseSource],
        clients: Sequence[str],
    ) -> list[Release]:
        dim = self.dim
        valid = all(
            f.shape[1] == dim and lab.shape == (f.shape[0],) for f, lab in zip(features, labels)
        ) and bool(torch.isfinite(torch.cat(list(features))).all())
        for i in range(len(features)):
            if not valid:  # the per-client checks raise the per-client message, in order
                self._check(features[i], labels[i], num_classes, clients[i])
            self._charge(clients[i])
        return _private_many(self, features, labels, num_classes, generators, clients)

    @abstractmethod
    def _partition_many(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        seg: torch.Tensor,
        sizes: list[int],
        num_classes: int,
        generators: Sequence[NoiseSource],
        clients: Sequence[str],
        infos: list[dict[str, float]],
        diags: list[dict[str, float]],
        events: list[list[dict[str, Any]]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The partition step of the vectorised release (see :meth:`IGPP._partition_many`)."""

    def _after_release(self, client: str, release: Release, num_classes: int) -> None:
        """Called with each release of the vectorised path (VPP keeps its history)."""

    def releases_left(self, client: str) -> int:
        """How many more releases ``client`` may make within the calibrated budget."""
        return self.rounds - self._released.get(client, 0)


# --------------------------------------------------------------------------------------------
# many clients at once
# --------------------------------------------------------------------------------------------
def release_many(
    mechanism: Mechanism,
    features: Sequence[torch.Tensor],
    labels: Sequence[torch.Tensor],
    *,
    num_classes: int,
    generators: Sequence[NoiseSource],
    clients: Sequence[str],
    cluster_fn: ClusterFn | None = None,
) -> list[Release]:
    """:meth:`Mechanism.release_many` (kept as a function for callers that hold a mechanism)."""
    return mechanism.release_many(
        features,
        labels,
        num_classes=num_classes,
        generators=generators,
        clients=clients,
        cluster_fn=cluster_fn,
    )


def _blocks(sizes: list[int], rows: int = 4096, clients: int = 256) -> list[tuple[int, int]]:
    """Consecutive client ranges of at most ``rows`` samples (or one client) and ``clients``
    clients, so that the temporaries of the vectorised steps stay small (in cache)."""
    out: list[tuple[int, int]] = []
    start, used = 0, 0
    for i, n in enumerate(sizes):
        if i > start and (used + n > rows or i - start >= clients):
            out.append((start, i))
            start, used = i, 0
        used += n
    out.append((start, len(sizes)))
    return out


def _private_many(
    mech: _PrototypeMechanism,
    features: Sequence[torch.Tensor],
    labels: Sequence[torch.Tensor],
    num_classes: int,
    generators: Sequence[NoiseSource],
    clients: Sequence[str],
) -> list[Release]:
    sizes = [int(f.shape[0]) for f in features]
    out: list[Release] = []
    for a, b in _blocks(sizes):
        out.extend(
            _private_block(
                mech, features[a:b], labels[a:b], num_classes, generators[a:b], clients[a:b]
            )
        )
    return out


def _private_block(
    mech: _PrototypeMechanism,
    features: Sequence[torch.Tensor],
    labels: Sequence[torch.Tensor],
    num_classes: int,
    generators: Sequence[NoiseSource],
    clients: Sequence[str],
) -> list[Release]:
    cfg = mech.config
    x, y, seg, sizes = _segments(features, labels)
    m, d = len(sizes), mech.dim
    dtype = mech._dtype(features[0])
    infos: list[dict[str, float]] = [{} for _ in range(m)]
    diags: list[dict[str, float]] = [{} for _ in range(m)]
    events: list[list[dict[str, Any]]] = [[] for _ in range(m)]
    # --- partitions (VPP selection, IGPP's optional random group clip): the mechanism's own
    clipped, unit = mech._partition_many(
        x, y, seg, sizes, num_classes, generators, clients, infos, diags, events
    )
    # --- class means, sensitivities, noise ----------------------------------------------------
    sums, counts, owner, classes = _class_sums(clipped, y, seg, m, num_classes)
    n = counts.to(dtype)
    protos = (sums / counts[:, None].to(torch.float64)).to(dtype)
    factor = 2.0 if cfg.neighbouring == "replace_one" else 1.0
    sensitivity = factor * cfg.clip / n
    noise_std = factor * unit.to(dtype)[owner] / n[:, None]
    per = torch.bincount(owner, minlength=m).tolist()
    noise = torch.empty(protos.shape, dtype=dtype)
    start = 0
    for i in range(m):
        # the draw of _noisy, client by client
        noise[start : start + per[i]] = draw_normal(generators[i], (per[i], d), "gaussian", dtype)
        start += per[i]
    noisy = protos + noise * noise_std
    small = (counts < cfg.warn_min_count).tolist() if cfg.warn_min_count > 0 else None
    out: list[Release] = []
    start = 0
    for i in range(m):
        stop = start + per[i]
        if small is not None and any(small[start:stop]):
            mech._warn_small(
                _Built(
                    protos=protos[start:stop],
                    classes=classes[start:stop],
                    counts=counts[start:stop],
                    sensitivity=sensitivity[start:stop],
                    noise_std=noise_std[start:stop],
                ),
                clients[i],
            )
        ev = events[i]
        if per[i] > 0:
            ev = [*ev, mech._gaussian_event()]
        release = Release(
            # the [k, d] tensors get their own storage (a single release saved alone stays
            # small); the [k] ones are views of the block's few-kB vectors
            prototypes=noisy[start:stop].clone(),
            classes=classes[start:stop],
            counts=counts[start:stop],
            sensitivity=sensitivity[start:stop],
            noise_std=noise_std[start:stop].clone(),
            mechanism=mech.name,
            events=ev,
            info={"sigma": float(mech.sigma), **infos[i]},
            diagnostics=diags[i],
        )
        start = stop
        mech._after_release(clients[i], release, num_classes)
        out.append(release)
    return out
