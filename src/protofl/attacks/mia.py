"""Membership inference against released prototypes (VPDR Appendix E.6.2) and a calibrated variant.

Threat model: the adversary sees one client's released (noisy) prototypes and can evaluate the
client's feature path phi (the path whose outputs were averaged into the prototypes).  Members are
the client's training samples, non-members held-out samples of the same domain.

* **Distance attack** (the paper's): ``s(x) = -min_k ||phi(x) - p_k||^2`` over the released
  prototypes ``p_k`` of x's class (one per class unless the method releases clusters).
* **Per-class calibrated distance** (``pc``): the distance score z-scored with the mean and
  standard deviation of reference non-members' scores of the same class, so one global threshold
  is not confounded by classes of different spread.
* **Likelihood-ratio attack** (``cal``, an offline LiRA-style test): a Gaussian likelihood ratio
  between "x was one of the ``n`` examples averaged into ``p``" and "x was not", with a *shadow*
  class mean and per-dimension spread estimated from reference non-member data of the same class,
  and the release's stated noise variance.  Per dimension j::

      H0: p_j - mu_j ~ N(0,                v0_j),  v0_j = s2_j/n + s2_j/m + tau_j^2
      H1: p_j - mu_j ~ N((f_j - mu_j)/n,   v1_j),  v1_j = s2_j (n-1)/n^2 + s2_j/m + tau_j^2

  (``m`` reference samples, ``tau_j`` the noise std).  The score is log N(H1) - log N(H0) summed
  over dimensions.  Unlike the distance, it is not confounded by how atypical a sample is, so one
  global threshold works across samples and classes.

Both calibrated attacks need reference data from the population (the adversary's own samples of
the domain).  They are *cross-fitted*: the non-members are split in two folds; each sample
(member or non-member) is scored with the statistics of the fold it is not in, so no non-member
calibrates its own score.  Under heavy DP noise the ``cal`` score is essentially the projection of
the sample onto the release's noise vector, so on ONE release its AUC scatters around 0.5 more
widely than the distance attack's (in both directions); average over rounds or clients.

Metrics (``membership_metrics``): ROC-AUC, TPR at 1% FPR, advantage max(TPR - FPR) and F1 at the
F1-maximising threshold (on the precision-recall curve), all from ``sklearn.metrics``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sklearn.metrics import precision_recall_curve, roc_auc_score, roc_curve

from protofl.engine.hooks import DIAGNOSTIC_HOOKS
from protofl.seeding import Stream, derive_seed

MAX_PER_CLASS = 800
"""VPDR App. E.6.2: at most 800 members and 800 non-members per class."""

METRIC_KEYS = ("auc", "tpr_at_1fpr", "advantage", "f1")


@dataclass(frozen=True)
class ReleasedPrototypes:
    """The parts of a release the attacks use (float64 numpy).

    ``noise_std`` is per dimension ``[K, d]``; from a saved run (which keeps only the mean over
    dimensions) it is that mean broadcast over dimensions.
    """

    prototypes: np.ndarray
    classes: np.ndarray
    counts: np.ndarray
    noise_std: np.ndarray


def as_released(release: Any) -> ReleasedPrototypes:
    """Accept a :class:`protofl.privacy.base.Release` or a saved-run release dict."""

    def arr(x: Any) -> np.ndarray:
        if isinstance(x, torch.Tensor):
            return x.detach().cpu().to(torch.float64).numpy()
        return np.asarray(x, dtype=np.float64)

    if isinstance(release, Mapping):
        protos = arr(release["prototypes"])
        classes = arr(release["classes"]).astype(np.int64)
        counts = arr(release["counts"])
        if "noise_std" in release:
            std = arr(release["noise_std"])
        elif "noise_std_mean" in release:
            std = np.repeat(arr(release["noise_std_mean"]).reshape(-1, 1), protos.shape[1], axis=1)
        else:
            std = np.zeros_like(protos)
    else:
        protos = arr(release.prototypes)
        classes = arr(release.classes).astype(np.int64)
        counts = arr(release.counts)
        std = arr(release.noise_std)
    if protos.ndim != 2:
        raise ValueError(f"release prototypes must be [K, d], got shape {protos.shape}")
    std = np.broadcast_to(std, protos.shape).copy()
    return ReleasedPrototypes(protos, classes, counts, std)


def _np(x: Any, dtype: Any = np.float64) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


def cap_per_class(
    labels: np.ndarray, max_per_class: int | None, rng: np.random.Generator
) -> np.ndarray:
    """Sorted indices keeping at most ``max_per_class`` random samples of every class."""
    if max_per_class is None:
        return np.arange(len(labels))
    keep: list[np.ndarray] = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        if len(idx) > max_per_class:
            idx = rng.choice(idx, size=max_per_class, replace=False)
        keep.append(idx)
    return np.sort(np.concatenate(keep)) if keep else np.zeros(0, dtype=np.int64)


def nearest_prototype(
    features: np.ndarray, labels: np.ndarray, rel: ReleasedPrototypes
) -> tuple[np.ndarray, np.ndarray]:
    """(index of the nearest released prototype of each sample's own class, or -1; its squared
    distance, or nan)."""
    n = features.shape[0]
    idx = np.full(n, -1, dtype=np.int64)
    dist = np.full(n, np.nan)
    for c in np.unique(labels):
        rows = np.flatnonzero(rel.classes == c)
        if len(rows) == 0:
            continue
        mask = labels == c
        diff = features[mask][:, None, :] - rel.prototypes[rows][None, :, :]
        d2 = np.einsum("nkd,nkd->nk", diff, diff)
        best = d2.argmin(axis=1)
        idx[mask] = rows[best]
        dist[mask] = d2[np.arange(len(best)), best]
    return idx, dist


def distance_scores(features: Any, labels: Any, release: Any) -> np.ndarray:
    """The paper's score s(x) = -min_k ||phi(x) - p_k||^2 over x's class; nan if the class was
    not released."""
    rel = release if isinstance(release, ReleasedPrototypes) else as_released(release)
    _, dist = nearest_prototype(_np(features), _np(labels, np.int64), rel)
    return -dist


def membership_metrics(member_scores: Any, nonmember_scores: Any) -> dict[str, float]:
    """ROC-AUC, TPR at 1% FPR, advantage max(TPR-FPR), F1 at the F1-maximising threshold.

    Higher score means "member".  Non-finite scores are dropped.  With no members or no
    non-members every metric is nan.
    """
    s1 = _np(member_scores)
    s0 = _np(nonmember_scores)
    s1, s0 = s1[np.isfinite(s1)], s0[np.isfinite(s0)]
    if len(s1) == 0 or len(s0) == 0:
        return {k: math.nan for k in METRIC_KEYS}
    y = np.concatenate([np.ones(len(s1)), np.zeros(len(s0))])
    s = np.concatenate([s1, s0])
    fpr, tpr, _ = roc_curve(y, s)
    low = fpr <= 0.01 + 1e-12
    precision, recall, _ = precision_recall_curve(y, s)
    with np.errstate(invalid="ignore", divide="ignore"):
        f1 = np.where(precision + recall > 0, 2 * precision * recall / (precision + recall), 0.0)
    return {
        "auc": float(roc_auc_score(y, s)),
        "tpr_at_1fpr": float(tpr[low].max()) if low.any() else 0.0,
        "advantage": float(np.max(tpr - fpr)),
        "f1": float(np.nanmax(f1)),
    }


# --------------------------------------------------------------------------------------------
# the calibrated (likelihood-ratio) attack
# --------------------------------------------------------------------------------------------
SHRINK = 10.0
"""Pseudo-count shrinking per-dimension reference variances toward their mean over dimensions."""


def _reference_stats(
    ref_f: np.ndarray, ref_proto: np.ndarray, num_protos: int, d: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per released prototype: shadow mean [K, d], shrunk per-dim variance [K, d], count [K]."""
    mu = np.zeros((num_protos, d))
    var = np.zeros((num_protos, d))
    m = np.zeros(num_protos)
    pooled = ref_f.var(axis=0) if len(ref_f) > 1 else np.ones(d)
    for k in range(num_protos):
        fk = ref_f[ref_proto == k]
        m[k] = len(fk)
        if len(fk) == 0:
            continue
        mu[k] = fk.mean(axis=0)
        v = fk.var(axis=0, ddof=1) if len(fk) > 1 else pooled
        # shrink toward the (pooled if tiny) mean variance: stable with few reference samples
        target = v.mean() if len(fk) > 2 else pooled.mean()
        var[k] = (len(fk) * v + SHRINK * target) / (len(fk) + SHRINK)
    return mu, np.maximum(var, 1e-12), m


def likelihood_ratio_scores(
    features: np.ndarray,
    proto_idx: np.ndarray,
    rel: ReleasedPrototypes,
    mu: np.ndarray,
    var: np.ndarray,
    m: np.ndarray,
) -> np.ndarray:
    """log p(release | x member) - log p(release | x not a member) under the Gaussian model in
    the module docstring; nan where the sample's class has no prototype or no reference data."""
    out = np.full(features.shape[0], np.nan)
    ok = (proto_idx >= 0) & (m[np.maximum(proto_idx, 0)] > 0)
    if not ok.any():
        return out
    k = proto_idx[ok]
    f = features[ok]
    n = np.maximum(rel.counts[k], 1.0)[:, None]
    tau2 = rel.noise_std[k] ** 2
    s2 = var[k]
    est = s2 / m[k][:, None]
    v0 = s2 / n + est + tau2
    v1 = s2 * (n - 1) / n**2 + est + tau2
    v1 = np.maximum(v1, 1e-12)
    r = rel.prototypes[k] - mu[k]
    shift = (f - mu[k]) / n
    ll1 = -0.5 * ((r - shift) ** 2 / v1 + np.log(v1))
    ll0 = -0.5 * (r**2 / v0 + np.log(v0))
    out[ok] = (ll1 - ll0).sum(axis=1)
    return out


def _per_class_z(
    scores: np.ndarray,
    labels: np.ndarray,
    ref_scores: np.ndarray,
    ref_labels: np.ndarray,
) -> np.ndarray:
    """(score - mean) / std of the reference scores of the sample's class (nan if < 2 refs)."""
    out = np.full(len(scores), np.nan)
    for c in np.unique(labels):
        ref = ref_scores[(ref_labels == c) & np.isfinite(ref_scores)]
        if len(ref) < 2:
            continue
        sd = ref.std(ddof=1)
        mask = labels == c
        out[mask] = (scores[mask] - ref.mean()) / (sd if sd > 0 else 1.0)
    return out


def calibrated_scores(
    members: np.ndarray,
    labels_members: np.ndarray,
    nonmembers: np.ndarray,
    labels_nonmembers: np.ndarray,
    rel: ReleasedPrototypes,
    rng: np.random.Generator,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Cross-fitted calibrated scores ``{"pc": (members, non-members), "cal": (...)}``.

    ``pc``: the distance score z-scored per class with the reference non-members' scores;
    ``cal``: the Gaussian likelihood ratio.  Non-members are split into two stratified folds and
    members assigned to folds at random; every sample is calibrated on the fold it is not in.
    """
    d = rel.prototypes.shape[1]
    k_num = rel.prototypes.shape[0]
    idx_m, dist_m = nearest_prototype(members, labels_members, rel)
    idx_n, dist_n = nearest_prototype(nonmembers, labels_nonmembers, rel)
    fold_n = np.zeros(len(nonmembers), dtype=np.int64)
    fold_m = rng.integers(0, 2, size=len(members))
    for c in np.unique(labels_nonmembers):  # stratified halves
        where = np.flatnonzero(labels_nonmembers == c)
        fold_n[rng.permutation(where)[: len(where) // 2]] = 1
    out = {
        key: (np.full(len(members), np.nan), np.full(len(nonmembers), np.nan))
        for key in ("pc", "cal")
    }
    for fold in (0, 1):
        ref = fold_n != fold  # reference data: the other fold
        sel_m = fold_m == fold
        sel_n = ~ref
        pc_m, pc_n = out["pc"]
        pc_m[sel_m] = _per_class_z(
            -dist_m[sel_m], labels_members[sel_m], -dist_n[ref], labels_nonmembers[ref]
        )
        pc_n[sel_n] = _per_class_z(
            -dist_n[sel_n], labels_nonmembers[sel_n], -dist_n[ref], labels_nonmembers[ref]
        )
        mu, var, m = _reference_stats(nonmembers[ref], idx_n[ref], k_num, d)
        lr_m, lr_n = out["cal"]
        lr_m[sel_m] = likelihood_ratio_scores(members[sel_m], idx_m[sel_m], rel, mu, var, m)
        lr_n[sel_n] = likelihood_ratio_scores(nonmembers[sel_n], idx_n[sel_n], rel, mu, var, m)
    return out


# --------------------------------------------------------------------------------------------
# the engine's per-round diagnostic (registered as its ``mia`` upload hook)
# --------------------------------------------------------------------------------------------
class MembershipDiagnostic:
    """An upload hook (``Simulation(upload_hooks=...)``): the paper's audit (VPDR App. E.6.2)
    on every ``every``-th round's releases, written to ``sim.last_mia`` (a local-only
    diagnostic: computed on the client's private data, never sent)."""

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"run.mia_every={every!r}: a diagnostic runs every k >= 1 rounds")
        self.every = every

    def __call__(self, sim: Any, client: Any, features: torch.Tensor, release: Any) -> None:
        if (sim.round + 1) % self.every:
            return
        c = client
        with torch.no_grad():  # the features on run.device, the scoring on the CPU
            test_f = sim.method.upload_features(c.model, c.data.test_z.float()).cpu()
        sim.last_mia[c.data.name] = mia_on_release(
            features.cpu(),
            c.data.train_y.cpu(),
            test_f,
            c.data.test_y.cpu(),
            release,
            seed=derive_seed(sim.config.seed, Stream.DIAGNOSTICS, c.data.client, sim.round),
        )


def membership_diagnostic(config: Any) -> MembershipDiagnostic | None:
    """The membership diagnostic ``config.run.mia_every`` asks for, or None (registered as the
    engine's ``mia`` diagnostic hook)."""
    every = int(config.run.mia_every)
    return MembershipDiagnostic(every) if every else None


def diagnostics_for(config: Any) -> list[MembershipDiagnostic]:
    """The upload hooks ``config.run`` asks for (``mia_every``)."""
    hook = membership_diagnostic(config)
    return [hook] if hook is not None else []


DIAGNOSTIC_HOOKS.add("mia", membership_diagnostic)


# --------------------------------------------------------------------------------------------
# the entry point the engine calls every round
# --------------------------------------------------------------------------------------------
def mia_on_release(
    features_members: Any,
    labels_members: Any,
    features_nonmembers: Any,
    labels_nonmembers: Any,
    release: Any,
    *,
    max_per_class: int | None = MAX_PER_CLASS,
    calibrated: bool = True,
    seed: int = 0,
) -> dict[str, float]:
    """The membership attacks on one client's release.

    ``features_*``: phi of the client's training samples (members) and of held-out samples of its
    domain (non-members), computed with the model that made ``release`` (a ``Release`` or a saved
    release dict).  Returns ``mia_{auc,tpr_at_1fpr,advantage,f1}`` (the paper's distance
    attack), ``mia_pc_*`` (per-class calibrated distance), ``mia_cal_*`` (the likelihood-ratio
    attack; both calibrated ones absent with ``calibrated=False``), ``mia_members`` and
    ``mia_nonmembers`` (samples scored).  Deterministic for a given ``seed``.
    """
    rel = as_released(release)
    fm, ym = _np(features_members), _np(labels_members, np.int64)
    fn, yn = _np(features_nonmembers), _np(labels_nonmembers, np.int64)
    if (
        fm.ndim != 2
        or fn.ndim != 2
        or fm.shape[1] != rel.prototypes.shape[1]
        or (fn.shape[1] != rel.prototypes.shape[1])
    ):
        raise ValueError(
            f"features must be [n, {rel.prototypes.shape[1]}] like the prototypes; got "
            f"{fm.shape} (members) and {fn.shape} (non-members)"
        )
    if ym.shape != (fm.shape[0],) or yn.shape != (fn.shape[0],):
        raise ValueError("labels must have one entry per feature row")
    rng = np.random.default_rng(seed)
    keep_m = cap_per_class(ym, max_per_class, rng)
    keep_n = cap_per_class(yn, max_per_class, rng)
    # only classes that were released can be attacked
    released = np.isin(ym[keep_m], rel.classes)
    keep_m = keep_m[released]
    keep_n = keep_n[np.isin(yn[keep_n], rel.classes)]
    fm, ym, fn, yn = fm[keep_m], ym[keep_m], fn[keep_n], yn[keep_n]
    out = {
        f"mia_{k}": v
        for k, v in membership_metrics(
            distance_scores(fm, ym, rel), distance_scores(fn, yn, rel)
        ).items()
    }
    if calibrated:
        for key, (s_m, s_n) in calibrated_scores(fm, ym, fn, yn, rel, rng).items():
            out.update({f"mia_{key}_{k}": v for k, v in membership_metrics(s_m, s_n).items()})
    out["mia_members"] = float(len(ym))
    out["mia_nonmembers"] = float(len(yn))
    return out


# --------------------------------------------------------------------------------------------
# a finished run
# --------------------------------------------------------------------------------------------
def mean_metrics(per_client: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Mean of every metric over clients (nan-aware)."""
    keys = sorted({k for m in per_client.values() for k in m})
    out: dict[str, float] = {}
    for k in keys:
        vals = np.array([m.get(k, math.nan) for m in per_client.values()], dtype=np.float64)
        out[k] = float(np.nanmean(vals)) if np.isfinite(vals).any() else math.nan
    return out


def mia_on_run(
    run_dir: Any,
    *,
    round_: int | None = None,
    clients: list[str] | None = None,
    max_per_class: int | None = MAX_PER_CLASS,
    seed: int = 0,
    home: Any = None,
    write: bool = True,
    device: str | None = None,
) -> dict[str, Any]:
    """Both membership attacks on every (or the named) client's release of round ``round_``
    (1-based; default the last) of a saved run; writes ``attack_mia.json`` into the run folder.

    ``device``: where the client models compute the features (default: the run's
    ``run.device``, resolved on this machine); the scoring runs on the CPU."""
    import json
    from pathlib import Path

    from protofl.attacks.artifacts import json_safe, load_run, rebuild_clients, run_facts
    from protofl.models.device import prepare_device

    art = load_run(run_dir)
    dev = prepare_device(device or art.config.run.device)
    r = art.rounds if round_ is None else round_
    targets = [art.client_index(n) for n in clients] if clients else range(len(art.clients))
    releases = {i: art.release(r, i) for i in targets}  # validates round and clients first
    per_client: dict[str, dict[str, float]] = {}
    for view in rebuild_clients(art, clients, home=Path(home) if home else None, round_=r):
        view.to(dev)
        per_client[view.name] = mia_on_release(
            view.phi_z(view.train_z),
            view.train_labels,
            view.phi_z(view.test_z),
            view.test_labels,
            releases[view.index],
            max_per_class=max_per_class,
            seed=seed,
        )
    result: dict[str, Any] = {
        "attack": "mia",
        **run_facts(art, r),
        "max_per_class": max_per_class,
        "seed": seed,
        "device": str(dev),
        "clients": per_client,
        "mean": mean_metrics(per_client),
    }
    if write:
        (art.run_dir / "attack_mia.json").write_text(json.dumps(json_safe(result), indent=2) + "\n")
    return result
