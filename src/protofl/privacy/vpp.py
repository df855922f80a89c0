"""VPP: Variance-aware Prototype Perturbation (VPDR Sec. 4.2): a privately chosen
discriminative subspace (ANOVA scores, noisy top-k) gets less noise; on the common release
pipeline of :mod:`protofl.privacy.prototype`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from protofl.privacy.accounting import VppBudget, calibrate_vpp
from protofl.privacy.base import MECHANISM_REGISTRY, ClusterFn, Release
from protofl.privacy.config import PrivacyConfig
from protofl.privacy.noise import NoiseSource, draw_laplace
from protofl.privacy.prototype import _PrototypeMechanism, clip_groups, random_mask


# --------------------------------------------------------------------------------------------
# building blocks
# --------------------------------------------------------------------------------------------
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


def _reference_topk(raw: torch.Tensor, k: int) -> torch.Tensor:
    """The non-private top-k of the scores (non-finite scores count as 0, as in selection)."""
    return topk_mask(torch.nan_to_num(raw, nan=0.0, posinf=0.0, neginf=0.0), k)


def partition_overlap(private: torch.Tensor, reference: torch.Tensor) -> float:
    """|private top-k intersect reference top-k| / k."""
    k = int(reference.sum())
    return float((private.cpu() & reference.cpu()).sum()) / max(k, 1)


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
