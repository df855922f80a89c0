"""IGPP: Isotropic Gaussian Prototype Perturbation (VPDR Sec. 4.1), on the common release
pipeline of :mod:`protofl.privacy.prototype`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from protofl.privacy.accounting import calibrate_gaussian, calibrate_sampled
from protofl.privacy.base import MECHANISM_REGISTRY, ClusterFn, Release
from protofl.privacy.config import PrivacyConfig
from protofl.privacy.noise import NoiseSource
from protofl.privacy.prototype import _PrototypeMechanism, clip_groups, clip_l2, random_mask


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
