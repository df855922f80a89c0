"""IGPP and VPP: local-DP release of class (or cluster) prototypes (VPDR Sec. 4.1 and 4.2).

Both mechanisms are calibrated once for a whole run (``rounds`` releases per client) in
``__init__`` and keep a little per-client state (how often a client has released, VPP's cached
partition or release history), so one instance can serve every client of a simulation.

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

from protofl.privacy.accounting import (
    VppBudget,
    calibrate_gaussian,
    calibrate_sampled,
    calibrate_vpp,
)
from protofl.privacy.base import (
    MECHANISM_REGISTRY,
    ClusterFn,
    Mechanism,
    Release,
    _class_sums,
    _segments,
    check_finite,
    group_means,
)
from protofl.privacy.config import PrivacyConfig
from protofl.privacy.noise import (
    NoiseSource,
    draw_laplace,
    draw_normal,
    draw_permutation,
    draw_uniform,
)

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


def anova_scores(
    features: torch.Tensor, labels: torch.Tensor, num_classes: int, zeta: float
) -> torch.Tensor:
    """ANOVA F-scores per dimension (float64), VPDR Eq. (7)-(8).

    V_ter_j = sum_c n_c (mu_cj - mu_j)^2, V_tra_j = sum_c (n_c - 1) s_cj^2,
    S_j = [V_ter_j / (C - 1)] / [V_tra_j / (n - C) + zeta'] with C the classes present and
    zeta' = zeta * median_j(V_tra_j / (n - C)) + 1e-12 (a scale-free zeta > 0).
    """
    x = features.detach().to(torch.float64)
    n, d = x.shape
    counts = torch.bincount(labels, minlength=num_classes).to(torch.float64)
    present = counts > 0
    c = int(present.sum())
    if c < 2:
        return torch.zeros(d, dtype=torch.float64, device=x.device)
    sums = torch.zeros(num_classes, d, dtype=torch.float64, device=x.device)
    sums.index_add_(0, labels, x)
    means = sums / counts.clamp_min(1.0).unsqueeze(1)
    grand = x.mean(dim=0)
    v_ter = (counts.unsqueeze(1) * (means - grand) ** 2).sum(dim=0)  # Eq. (7), between
    v_tra = ((x - means[labels]) ** 2).sum(dim=0)  # Eq. (7), within: sum_c (n_c - 1) s_c^2
    within = v_tra / (n - c) if n > c else torch.zeros_like(v_tra)
    zeta_eff = zeta * float(within.median()) + 1e-12
    return (v_ter / (c - 1)) / (within + zeta_eff)  # Eq. (8)


def laplace_noise(shape: tuple[int, ...], scale: float, generator: NoiseSource) -> torch.Tensor:
    """Lap(scale) samples (float64, CPU) as scale*(E1 - E2), E1, E2 ~ Exp(1) from ``generator``."""
    return draw_laplace(generator, shape, scale, "vpp-selection")


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the k largest entries."""
    mask = torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
    mask[torch.topk(scores, k).indices] = True
    return mask


def random_mask(dim: int, k: int, generator: NoiseSource) -> torch.Tensor:
    """A uniformly random k-subset of the dimensions (data-independent)."""
    mask = torch.zeros(dim, dtype=torch.bool)
    mask[draw_permutation(generator, dim, "random-partition")[:k]] = True
    return mask


def _reference_topk(raw: torch.Tensor, k: int) -> torch.Tensor:
    """The non-private top-k of the scores (non-finite scores count as 0, as in selection)."""
    return topk_mask(torch.nan_to_num(raw, nan=0.0, posinf=0.0, neginf=0.0), k)


def partition_overlap(private: torch.Tensor, reference: torch.Tensor) -> float:
    """|private top-k intersect reference top-k| / k."""
    k = int(reference.sum())
    return float((private.cpu() & reference.cpu()).sum()) / max(k, 1)


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
        used = self._released.get(client, 0)
        if used >= self.rounds:
            raise RuntimeError(
                f"client {client!r} has already made the {self.rounds} releases the mechanism was "
                "calibrated for; another release would exceed its privacy budget"
            )
        self._released[client] = used + 1

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
# IGPP
# --------------------------------------------------------------------------------------------
@MECHANISM_REGISTRY.register("igpp")
class IGPP(_PrototypeMechanism):
    """Isotropic Gaussian Prototype Perturbation (VPDR Sec. 4.1): per-example L2 clipping to R
    (Eq. 4), class or cluster means, noise N(0, (sigma_iso*Delta)^2 I) with Delta = 2R/n (Eq. 5).

    ``igpp_group_clip`` reproduces the reference code's accidental group clipping (A part to
    R*kappa_A, B part to R*kappa_B) on a uniformly random rho-subset drawn from the generator each
    release (the reference code's uncharged noisy top-k is, at its parameters, random).
    """

    name = "igpp"

    def __init__(self, config: PrivacyConfig, *, rounds: int, dim: int) -> None:
        super().__init__(config, rounds=rounds, dim=dim)
        if config.sampled:
            self.sigma = calibrate_sampled(
                config.epsilon, config.delta, rounds, config.sample_rate, config.accountant
            )
        else:
            self.sigma = calibrate_gaussian(config.epsilon, config.delta, rounds, config.accountant)
        self._k = min(max(math.ceil(config.vpp_rho * dim - 1e-9), 1), dim - 1)

    def _clip(self, features: torch.Tensor, mask_a: torch.Tensor | None) -> torch.Tensor:
        r = self.config.clip
        if mask_a is None:
            return clip_l2(features, r)  # VPDR Eq. (4)
        k = int(mask_a.sum())
        return clip_groups(
            features, mask_a, r * math.sqrt(k / self.dim), r * math.sqrt((self.dim - k) / self.dim)
        )

    def _unit_std(self, mask_a: torch.Tensor | None) -> torch.Tensor:
        return torch.full((self.dim,), self.sigma * self.config.clip, dtype=torch.float64)

    def _max_unit_std(self) -> float:
        return self.sigma * self.config.clip

    def noiseless_release(
        self,
        features: torch.Tensor,
        labels: torch.Tensor,
        *,
        num_classes: int,
        partition: torch.Tensor | None = None,
        cluster_fn: ClusterFn | None = None,
    ) -> Release:
        """The clipped prototypes before noise (test hook; not charged, not a DP release).
        ``partition`` is the group-clipping mask when ``igpp_group_clip`` is on."""
        self._check(features, labels, num_classes, "noiseless")
        built = self._build(features, labels, num_classes, partition, cluster_fn)
        return Release(
            prototypes=built.protos,
            classes=built.classes,
            counts=built.counts,
            sensitivity=built.sensitivity,
            noise_std=built.noise_std,
            mechanism=self.name,
        )

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
        """Clip, average per class (or per cluster of the clipped class features), add noise."""
        self._check(features, labels, num_classes, client)
        self._charge(client)
        mask = (
            random_mask(self.dim, self._k, generator).to(features.device)
            if self.config.igpp_group_clip
            else None
        )
        keep = self._sample(features.shape[0], generator, features.device)
        built = self._build(features, labels, num_classes, mask, cluster_fn, keep)
        self._warn_small(built, client)
        return self._finish(
            built,
            generator=generator,
            client=client,
            dtype=self._dtype(features),
            events=[],
            info={},
        )

    vectorised = True

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
        """``release`` 's partition step for every client at once (the vectorised release):
        the clipped features [n, d] and each client's per-dimension unit noise std [m, d];
        fills the per-client ``infos``, ``diags`` and selection ``events``."""
        cfg = self.config
        m, d = len(sizes), self.dim
        r = cfg.clip
        if cfg.igpp_group_clip:
            masks = torch.stack([random_mask(d, self._k, g) for g in generators])
            k = self._k
            clipped = clip_groups(x, masks[seg], r * math.sqrt(k / d), r * math.sqrt((d - k) / d))
        else:
            clipped = clip_l2(x, r)
        unit = torch.full((m, d), self.sigma * r, dtype=torch.float64)
        return clipped, unit

    def calibration(self) -> dict[str, Any]:
        """sigma_iso (VPDR Eq. 5): the noise std per dimension is sigma * Delta."""
        return {"sigma": float(self.sigma)}

    def describe(self) -> dict[str, Any]:
        """sigma, accountant, budget, neighbouring relation, clip."""
        out = self._describe_common()
        out["group_clip"] = self.config.igpp_group_clip
        out["noise_std_per_dim"] = (
            "sigma * Delta, Delta = 2R/n (replace_one) or R/n (add_remove; R/(q n) with "
            "sample_rate q and public counts)"
        )
        return out


# --------------------------------------------------------------------------------------------
# VPP
# --------------------------------------------------------------------------------------------
def vpp_budget(config: PrivacyConfig, *, rounds: int, dim: int) -> VppBudget:
    """VPP's calibration (:func:`~protofl.privacy.accounting.calibrate_vpp`) for a config."""
    return calibrate_vpp(
        config.epsilon,
        config.delta,
        rounds,
        ratio=config.vpp_ratio,
        rho=config.vpp_rho,
        dim=dim,
        score_max=config.vpp_score_max,
        split=config.vpp_split,
        accountant=config.accountant,
        variant=config.vpp_variant,
    )


@MECHANISM_REGISTRY.register("vpdr")  # VPP, with DCR in local training (PrivacyConfig.use_dcr)
@MECHANISM_REGISTRY.register("vpp")
class VPP(_PrototypeMechanism):
    """Variance-adaptive Prototype Perturbation (VPDR Sec. 4.2).

    Per release: ANOVA scores (Eq. 7-8) on the unclipped features, clipped to [0, H]; one-shot
    Laplace top-k (k = d_A = ceil(rho*d), Theorem 4.1) gives the partition A/B; groupwise clipping
    R_A = R*kappa_A, R_B = R*kappa_B (Eq. 10-11); noise sigma_A*Delta_A on A and sigma_B*Delta_B on
    B with sigma_{A,B} = sigma_ref/sqrt(w_{A,B}) and w_A = kappa_B/(kappa_A+kappa_B) (Eq. 12-14).

    Variants (``vpp_variant``), all with the same (epsilon, delta) guarantee:
    ``paper`` (as above, one selection per round, eps1/T each); ``normalized`` (scores rescaled
    to H*S/max S, still in [0, H]); ``once``/``normalized_once`` (one selection per client for the
    whole run, charged eps1 once); ``history`` (no private selection: the partition is the top-k
    of the between-class variance of the client's own past noisy releases, i.e. post-processing;
    random in round 1; the whole budget goes to the Gaussian).
    """

    name = "vpp"

    def __init__(self, config: PrivacyConfig, *, rounds: int, dim: int) -> None:
        super().__init__(config, rounds=rounds, dim=dim)
        self.budget: VppBudget = vpp_budget(config, rounds=rounds, dim=dim)
        b = self.budget
        # Eq. (19): the group release composes as one Gaussian of multiplier
        # (1/sigma_A^2 + 1/sigma_B^2)^-1/2 >= sigma_ref.
        inv = 1.0 / b.sigma_A**2 + 1.0 / b.sigma_B**2
        assert inv <= 1.0 / b.sigma_ref**2, "VPDR Eq. (19) violated"
        self.sigma = 1.0 / math.sqrt(inv)
        self.k = b.k
        self.radius_a = config.clip * b.kappa_A  # Eq. (10)
        self.radius_b = config.clip * b.kappa_B
        self._partitions: dict[str, torch.Tensor] = {}
        self._history: dict[str, dict[str, torch.Tensor]] = {}

    def calibration(self) -> dict[str, Any]:
        """sigma_ref (the Gaussian part's reference multiplier) and the whole VPP budget:
        selection budget, Laplace scale, partition sizes, group multipliers (Eq. 9-14)."""
        return {"sigma": float(self.budget.sigma_ref), **self.budget.as_dict()}

    # --- selection ----------------------------------------------------------------------------
    def scores(
        self, features: torch.Tensor, labels: torch.Tensor, num_classes: int
    ) -> torch.Tensor:
        """The non-private ANOVA scores S (Eq. 8), float64."""
        return anova_scores(features, labels, num_classes, self.config.vpp_zeta)

    def bounded_scores(self, raw: torch.Tensor) -> torch.Tensor:
        """Scores mapped into [0, H] (per-coordinate sensitivity <= H by the range bound).
        paper/once: clip(S, 0, H); normalized: H * S / max(S)."""
        h = self.config.vpp_score_max
        # a non-finite score (features of huge magnitude) must never win the selection
        raw = torch.nan_to_num(raw, nan=0.0, posinf=0.0, neginf=0.0)
        if self.config.vpp_variant in ("normalized", "normalized_once"):
            top = float(raw.max()) if raw.numel() else 0.0
            return raw.clamp_min(0.0) * (h / top) if top > 0 else torch.zeros_like(raw)
        return raw.clamp(0.0, h)

    def _select(
        self,
        raw: torch.Tensor,
        generator: NoiseSource,
        client: str,
        num_classes: int,
    ) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        """The partition mask A and the pure-DP events charged for it this round."""
        variant = self.config.vpp_variant
        if variant == "history":
            return self._history_mask(client, generator), []
        if variant in ("once", "normalized_once") and client in self._partitions:
            return self._partitions[client], []
        noisy = (
            self.bounded_scores(raw).cpu()
            + laplace_noise((self.dim,), self.budget.laplace_scale, generator).cpu()
        )  # one-shot Laplace top-k, Theorem 4.1
        mask = topk_mask(noisy, self.k)
        if variant in ("once", "normalized_once"):
            self._partitions[client] = mask
        return mask, [{"kind": "pure", "epsilon": self.budget.eps_select}]

    def _history_mask(self, client: str, generator: NoiseSource) -> torch.Tensor:
        h = self._history.get(client)
        if h is not None:
            seen = h["n"] > 0
            if int(seen.sum()) >= 2:
                n = h["n"][seen].unsqueeze(1)
                mean = h["sum"][seen] / n
                noise_var = (h["var"][seen] / n**2).mean(dim=0)
                score = mean.var(dim=0, unbiased=True) - noise_var
                return topk_mask(score, self.k)
        return random_mask(self.dim, self.k, generator)

    def _remember(self, client: str, release: Release, num_classes: int) -> None:
        if self.config.vpp_variant != "history" or release.num_prototypes == 0:
            return
        h = self._history.get(client)
        if h is None or h["sum"].shape[0] != num_classes:
            z = torch.zeros(num_classes, self.dim, dtype=torch.float64)
            h = {"sum": z, "var": z.clone(), "n": torch.zeros(num_classes, dtype=torch.float64)}
            self._history[client] = h
        cls = release.classes.cpu()
        h["sum"].index_add_(0, cls, release.prototypes.detach().cpu().to(torch.float64))
        h["var"].index_add_(0, cls, release.noise_std.detach().cpu().to(torch.float64) ** 2)
        h["n"].index_add_(0, cls, torch.ones(len(cls), dtype=torch.float64))

    # --- hooks --------------------------------------------------------------------------------
    def _clip(self, features: torch.Tensor, mask_a: torch.Tensor | None) -> torch.Tensor:
        assert mask_a is not None
        return clip_groups(features, mask_a, self.radius_a, self.radius_b)  # Eq. (11)

    def _unit_std(self, mask_a: torch.Tensor | None) -> torch.Tensor:
        assert mask_a is not None
        b = self.budget
        # Eq. (14): std sigma_A*Delta_A on A, sigma_B*Delta_B on B; Delta_g = 2 R_g / n (Eq. 10)
        return torch.where(
            mask_a.cpu(),
            torch.tensor(b.sigma_A * self.radius_a, dtype=torch.float64),
            torch.tensor(b.sigma_B * self.radius_b, dtype=torch.float64),
        )

    def _max_unit_std(self) -> float:
        b = self.budget
        return max(b.sigma_A * self.radius_a, b.sigma_B * self.radius_b)

    def noiseless_release(
        self,
        features: torch.Tensor,
        labels: torch.Tensor,
        *,
        num_classes: int,
        partition: torch.Tensor | None = None,
        cluster_fn: ClusterFn | None = None,
    ) -> Release:
        """Groupwise-clipped prototypes before noise for a given partition (default: the
        non-private top-k).  Test hook; not charged, not a DP release."""
        self._check(features, labels, num_classes, "noiseless")
        if partition is None:
            partition = topk_mask(self.scores(features, labels, num_classes), self.k)
        built = self._build(
            features, labels, num_classes, partition.to(features.device), cluster_fn
        )
        return Release(
            prototypes=built.protos,
            classes=built.classes,
            counts=built.counts,
            sensitivity=built.sensitivity,
            noise_std=built.noise_std,
            mechanism=self.name,
        )

    def release_events(self, release_index: int) -> list[dict[str, Any]]:
        """The selection's pure event when this release selects (every release for paper and
        normalized, the first for once variants, never for history), then the Gaussian."""
        variant = self.config.vpp_variant
        selects = variant in ("paper", "normalized") or (
            variant in ("once", "normalized_once") and release_index == 0
        )
        pure = [{"kind": "pure", "epsilon": self.budget.eps_select}] if selects else []
        return [*pure, self._gaussian_event()]

    def group_sensitivity(self, count: int) -> tuple[float, float]:
        """(Delta_A, Delta_B) of a prototype of ``count`` examples: 2R_g/n (replace-one)."""
        factor = 2.0 if self.config.neighbouring == "replace_one" else 1.0
        return factor * self.radius_a / count, factor * self.radius_b / count

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
        """Select the partition privately, clip groupwise, average, add group noise."""
        self._check(features, labels, num_classes, client)
        self._charge(client)
        info: dict[str, float] = {"k": float(self.k)}
        diagnostics: dict[str, float] = {}
        events: list[dict[str, Any]] = []
        if features.shape[0] == 0:
            mask = torch.zeros(self.dim, dtype=torch.bool)
            mask[: self.k] = True
        else:
            raw = self.scores(features, labels, num_classes)
            mask, events = self._select(raw, generator, client, num_classes)
            # computed on private data, outside the DP guarantee: local-only
            diagnostics["partition_overlap"] = partition_overlap(mask, _reference_topk(raw, self.k))
            info["selected"] = float(bool(events))
        built = self._build(features, labels, num_classes, mask.to(features.device), cluster_fn)
        self._warn_small(built, client)
        release = self._finish(
            built,
            generator=generator,
            client=client,
            dtype=self._dtype(features),
            events=events,
            info=info,
            diagnostics=diagnostics,
        )
        self._remember(client, release, num_classes)
        return release

    vectorised = True

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
        """``release`` 's partition step for every client at once (the vectorised release):
        the clipped features [n, d] and each client's per-dimension unit noise std [m, d];
        fills the per-client ``infos``, ``diags`` and selection ``events``."""
        cfg = self.config
        m, d = len(sizes), self.dim
        masks = torch.zeros(m, d, dtype=torch.bool)
        masks[:, : self.k] = True  # clients without samples
        raw = _anova_many(x, y, seg, sizes, num_classes, cfg.vpp_zeta)
        variant = cfg.vpp_variant
        draw: list[int] = []
        for i in range(m):
            infos[i]["k"] = float(self.k)
            if sizes[i] == 0:
                continue
            if variant == "history":
                masks[i] = self._history_mask(clients[i], generators[i])
            elif variant in ("once", "normalized_once") and clients[i] in self._partitions:
                masks[i] = self._partitions[clients[i]]
            else:
                draw.append(i)
        if draw:
            # one-shot Laplace top-k (Theorem 4.1): the draws of laplace_noise, client by client
            lap = torch.stack(
                [laplace_noise((d,), self.budget.laplace_scale, generators[i]) for i in draw]
            )
            idx = torch.tensor(draw)
            bounded = torch.stack([self.bounded_scores(raw[i]) for i in draw])
            chosen = _topk_masks(bounded + lap, self.k)
            masks[idx] = chosen
            for j, i in enumerate(draw):
                if variant in ("once", "normalized_once"):
                    self._partitions[clients[i]] = chosen[j].clone()
                events[i] = [{"kind": "pure", "epsilon": self.budget.eps_select}]
        has = [i for i in range(m) if sizes[i] > 0]
        if has:
            ref = _topk_masks(torch.nan_to_num(raw[has], nan=0.0, posinf=0.0, neginf=0.0), self.k)
            overlap = ((masks[has] & ref).sum(dim=1).double() / max(self.k, 1)).tolist()
            for j, i in enumerate(has):
                diags[i]["partition_overlap"] = overlap[j]
                infos[i]["selected"] = float(bool(events[i]))
        clipped = clip_groups(x, masks[seg], self.radius_a, self.radius_b)
        unit = torch.where(
            masks,
            torch.tensor(self.budget.sigma_A * self.radius_a, dtype=torch.float64),
            torch.tensor(self.budget.sigma_B * self.radius_b, dtype=torch.float64),
        )
        return clipped, unit

    def _after_release(self, client: str, release: Release, num_classes: int) -> None:
        self._remember(client, release, num_classes)

    def describe(self) -> dict[str, Any]:
        """sigma (= sigma_ref), the budget split and every VPP parameter."""
        out = self._describe_common()
        out.update(
            {
                "vpp_" + key: value
                for key, value in self.budget.as_dict().items()
                if key not in ("epsilon", "delta", "rounds", "accountant")
            }
        )
        out["noise_std_per_dim"] = (
            "A: sigma_A * Delta_A, B: sigma_B * Delta_B, Delta_g = 2 R_g / n (replace_one)"
        )
        return out

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-safe per-client state: release counters, cached partitions, release history."""
        state = super().state_dict()
        state["partitions"] = {
            c: m.nonzero().flatten().tolist() for c, m in self._partitions.items()
        }
        state["history"] = {
            c: {key: t.tolist() for key, t in h.items()} for c, h in self._history.items()
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        super().load_state_dict(state)
        self._partitions = {}
        for c, idx in state.get("partitions", {}).items():
            mask = torch.zeros(self.dim, dtype=torch.bool)
            mask[torch.tensor(idx, dtype=torch.long)] = True
            self._partitions[c] = mask
        self._history = {
            c: {key: torch.tensor(v, dtype=torch.float64) for key, v in h.items()}
            for c, h in state.get("history", {}).items()
        }


# --------------------------------------------------------------------------------------------
# many clients at once
# --------------------------------------------------------------------------------------------
def _anova_many(
    x: torch.Tensor,
    labels: torch.Tensor,
    seg: torch.Tensor,
    sizes: list[int],
    num_classes: int,
    zeta: float,
) -> torch.Tensor:
    """:func:`anova_scores` of every client at once ([M, d], float64); rows of clients with
    fewer than two classes (or no samples) are zero.  Sums are accumulated per (client, class)
    with ``index_add_``, so values agree with the per-client function to float64 rounding."""
    m = len(sizes)
    xd = x.detach().to(torch.float64)
    d = xd.shape[1]
    key = seg * num_classes + labels
    counts = torch.bincount(key, minlength=m * num_classes).to(torch.float64)
    sums = torch.zeros(m * num_classes, d, dtype=torch.float64).index_add_(0, key, xd)
    means = sums / counts.clamp_min(1.0).unsqueeze(1)
    n = torch.tensor(sizes, dtype=torch.float64)
    grand = sums.view(m, num_classes, d).sum(dim=1) / n.clamp_min(1.0)[:, None]
    c = (counts.view(m, num_classes) > 0).sum(dim=1).to(torch.float64)
    v_ter = (
        counts.view(m, num_classes, 1) * (means.view(m, num_classes, d) - grand[:, None]) ** 2
    ).sum(dim=1)
    dev = means.index_select(0, key)
    torch.sub(xd, dev, out=dev)
    v_tra = torch.zeros(m, d, dtype=torch.float64).index_add_(0, seg, dev.mul_(dev))
    dof = n - c
    within = torch.where((dof > 0)[:, None], v_tra / dof.clamp_min(1.0)[:, None], 0.0)
    zeta_eff = zeta * within.median(dim=1).values + 1e-12
    scores = (v_ter / (c - 1).clamp_min(1.0)[:, None]) / (within + zeta_eff[:, None])
    return torch.where((c >= 2)[:, None], scores, torch.zeros_like(scores))


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


def _topk_masks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`topk_mask` of every row.  The top-k set is unique unless the k-th and (k+1)-th
    largest values tie; such rows use the 1-D call itself, so ties break as per client."""
    masks = torch.zeros(scores.shape, dtype=torch.bool)
    if scores.shape[1] <= k:
        masks[:] = True
        return masks
    top = torch.topk(scores, k + 1, dim=1)
    masks.scatter_(1, top.indices[:, :k], True)
    tied = top.values[:, k - 1] == top.values[:, k]
    for i in torch.nonzero(tied).flatten().tolist():
        masks[i] = topk_mask(scores[i], k)
    return masks


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
