"""FINCH: parameter-free first-neighbour clustering (Sarfraz, Sharma and Stiefelhagen, CVPR 2019).

Each point is linked to its first neighbour (its nearest other point); the connected components of
that graph are the first partition. The paper's adjacency (its Eq. 1),

    A(i, j) = 1  if  j = kappa_i  or  kappa_j = i  or  kappa_i = kappa_j,

has the same connected components as the undirected graph with one edge ``(i, kappa_i)`` per point
(``kappa_i = kappa_j`` puts i and j in the component of ``kappa_i`` anyway), which is what is built
here. The step is repeated on the means of the current clusters (means of the original points, as
in the paper's recursion) until a single cluster remains or the number of clusters stops falling,
giving a hierarchy of partitions, finest first.

Used by FPL (server-side clustering of uploaded prototypes) and FedPLVM (client-side clustering of
one class's clipped features, server-side clustering of the uploaded centres). Both use the
*coarsest* partition that still has two clusters or more (:func:`coarsest_partition`); the
reference implementation drops the final all-in-one level in the same way.

Early exit (``early_exit=True``; the reference code's ``ensure_early_exit``). The reference
``FINCH`` can cut, at every level after the first, each link whose weighted distance exceeds the
largest weighted distance of a first-level link (``min_sim``). Its weights are the entries of its
adjacency ``(A + I)(A + I)^T`` (off the diagonal): 2 for a mutual first-neighbour pair, 1 for a
one-way link or two points sharing a first neighbour (the ``kappa_i = kappa_j`` case of Eq. 1).
The recursion then stops when a level merges nothing (that level is dropped) or merges exactly one
pair of clusters (that level is kept and is the last). Without early exit (the default, and the
paper's algorithm) nothing is cut, and a level merges at least half the clusters, so neither stop
can happen before the all-in-one level.

Deterministic: ties in the nearest-neighbour search go to the lowest index, and labels are
numbered in order of first appearance.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch
from scipy.sparse.csgraph import connected_components

from protofl.privacy.base import ClusterFn

METRICS = ("cosine", "euclidean")
_CHUNK = 4096


def first_neighbours(x: torch.Tensor, metric: str = "cosine") -> torch.Tensor:
    """Index of every row's nearest other row ([n] int64; needs n >= 2).

    ``cosine`` distance is ``1 - cos(x_i, x_j)`` (a zero vector has cosine 0 to everything);
    ``euclidean`` is the L2 distance. Computed in float64, in row chunks, lowest index on ties.
    """
    if metric not in METRICS:
        raise ValueError(f"finch: metric={metric!r}; choose one of {', '.join(METRICS)}")
    n = x.shape[0]
    if n < 2:
        raise ValueError("finch: first neighbours need at least 2 points")
    xd = x.detach().to(torch.float64)
    if metric == "cosine":
        xd = xd / xd.norm(dim=1, keepdim=True).clamp_min(1e-12)
    out = torch.empty(n, dtype=torch.long)
    for start in range(0, n, _CHUNK):
        rows = xd[start : start + _CHUNK]
        if metric == "cosine":
            dist = 1.0 - rows @ xd.T
        else:
            dist = torch.cdist(rows, xd)
        idx = torch.arange(start, start + rows.shape[0])
        dist[idx - start, idx] = torch.inf
        out[start : start + rows.shape[0]] = dist.argmin(dim=1)
    return out


def _components(nbr: torch.Tensor) -> torch.Tensor:
    """Connected components of the undirected graph with edges ``(i, nbr[i])``, labels in order."""
    n = nbr.shape[0]
    rows = np.arange(n)
    graph = sp.csr_matrix((np.ones(n), (rows, nbr.numpy())), shape=(n, n))
    _, labels = connected_components(graph, directed=True, connection="weak")
    return relabel(torch.from_numpy(labels.astype(np.int64)))


def _pair_distance(x: torch.Tensor, i: torch.Tensor, j: torch.Tensor, metric: str) -> torch.Tensor:
    """Distance between rows ``x[i[k]]`` and ``x[j[k]]`` for every k (the metric of
    :func:`first_neighbours`; ``x`` already normalised for ``cosine``)."""
    if metric == "cosine":
        return 1.0 - (x[i] * x[j]).sum(dim=1)
    return (x[i] - x[j]).norm(dim=1)


def _weighted_links(
    x: torch.Tensor, nbr: torch.Tensor, metric: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every linked pair of Eq. 1 once, ``(i, j, weight * distance)``.

    Links: ``j = kappa_i`` (weight 2 when also ``kappa_j = i``, else 1) and ``kappa_i = kappa_j``
    (weight 1), the off-diagonal entries of the reference code's ``(A + I)(A + I)^T``.
    """
    n = nbr.shape[0]
    xd = x.to(torch.float64)
    if metric == "cosine":
        xd = xd / xd.norm(dim=1, keepdim=True).clamp_min(1e-12)
    src = torch.arange(n)
    mutual = nbr[nbr] == src
    keep = ~mutual | (src < nbr)  # a mutual pair once
    i, j = src[keep], nbr[keep]
    weight = torch.where(mutual[keep], 2.0, 1.0).to(torch.float64)
    rows, cols, weights = [i], [j], [weight]
    order = torch.argsort(nbr, stable=True)
    groups = torch.unique_consecutive(nbr[order], return_counts=True)[1]
    for members in torch.split(order, groups.tolist()):
        if members.numel() > 1:  # points sharing a first neighbour
            a, b = torch.triu_indices(members.numel(), members.numel(), offset=1)
            rows.append(members[a])
            cols.append(members[b])
            weights.append(torch.ones(a.numel(), dtype=torch.float64))
    i, j, w = torch.cat(rows), torch.cat(cols), torch.cat(weights)
    return i, j, w * _pair_distance(xd, i, j, metric)


def _pruned_components(
    x: torch.Tensor, nbr: torch.Tensor, metric: str, min_sim: float
) -> torch.Tensor:
    """Connected components of the Eq. 1 links whose weighted distance is at most ``min_sim``."""
    n = nbr.shape[0]
    i, j, wd = _weighted_links(x, nbr, metric)
    kept = wd <= min_sim
    graph = sp.csr_matrix(
        (np.ones(int(kept.sum())), (i[kept].numpy(), j[kept].numpy())), shape=(n, n)
    )
    _, labels = connected_components(graph, directed=True, connection="weak")
    return relabel(torch.from_numpy(labels.astype(np.int64)))


def relabel(labels: torch.Tensor) -> torch.Tensor:
    """Renumber cluster ids 0..k-1 in order of first appearance (a canonical form)."""
    labels = labels.to(torch.long)
    if labels.numel() == 0:
        return labels
    uniq, inverse = torch.unique(labels, return_inverse=True)
    first = torch.full((len(uniq),), labels.numel(), dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(labels.numel()), reduce="amin")
    rank = torch.empty_like(first)
    rank[torch.argsort(first)] = torch.arange(len(uniq))
    return rank[inverse]


def cluster_means(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Unweighted mean of the rows of ``x`` in each cluster ([k, d], k = labels.max() + 1)."""
    k = int(labels.max()) + 1 if labels.numel() else 0
    return segment_sum(x, labels, k) / torch.bincount(labels, minlength=k).to(x.dtype)[:, None]


def segment_sum(x: torch.Tensor, index: torch.Tensor, k: int) -> torch.Tensor:
    """``out[j] = sum of x[i] with index[i] == j`` ([k, d]).

    ``index_put_`` with accumulation (deterministic on CPU) rather than ``index_add_``, whose
    2-D CPU kernel was measured at ~0.1 s per call on tiny inputs here.
    """
    return torch.zeros(k, x.shape[1], dtype=x.dtype).index_put_((index,), x, accumulate=True)


def finch(x: torch.Tensor, metric: str = "cosine", early_exit: bool = False) -> list[torch.Tensor]:
    """All FINCH partitions of the rows of ``x``, finest first.

    Returns a list of label vectors ([n] int64, ids 0..k-1 in order of first appearance). Every
    level has at most half the clusters of the one before. The recursion stops at one cluster
    (that trivial level is included when reached, so ``finch(x)[-1]`` may be all zeros; see
    :func:`coarsest_partition`). ``n == 0`` gives ``[]``, ``n == 1`` gives ``[tensor([0])]``.

    ``early_exit``: the reference code's ``ensure_early_exit`` (module docstring): links longer
    than the first level's longest are cut, and the recursion stops at a level that merges
    nothing (dropped) or exactly one pair (kept, the last). A level then has fewer clusters than
    the one before, but not necessarily half as many.
    """
    if metric not in METRICS:
        raise ValueError(f"finch: metric={metric!r}; choose one of {', '.join(METRICS)}")
    if x.dim() != 2:
        raise ValueError(f"finch: expected a 2-D tensor [n, d], got shape {tuple(x.shape)}")
    n = x.shape[0]
    if n == 0:
        return []
    if not torch.isfinite(x).all():
        raise ValueError("finch: input holds NaN or inf")
    if n == 1:
        return [torch.zeros(1, dtype=torch.long)]
    xd = x.detach().to(torch.float64)
    nbr = first_neighbours(xd, metric)
    labels = _components(nbr)
    levels = [labels]
    min_sim = None
    if early_exit and n > 2:  # the longest first-level link (the reference skips n <= 2)
        min_sim = float(_weighted_links(xd, nbr, metric)[2].max())
    k = int(labels.max()) + 1
    while k > 1:
        means = cluster_means(xd, labels)
        nbr = first_neighbours(means, metric)
        if min_sim is None:
            merge = _components(nbr)
        else:
            merge = _pruned_components(means, nbr, metric, min_sim)
        new_k = int(merge.max()) + 1
        if new_k >= k:  # without early exit this cannot happen (every node has an edge)
            break
        labels = relabel(merge[labels])
        levels.append(labels)
        if early_exit and k - new_k == 1:  # the reference stops after merging a single pair
            break
        k = new_k
    return levels


def coarsest_partition(
    x: torch.Tensor, metric: str = "cosine", early_exit: bool = False
) -> torch.Tensor:
    """The coarsest FINCH partition with at least two clusters, if FINCH finds one.

    Otherwise (the first level is already a single cluster, which is always the case for
    ``n <= 2``) all points form cluster 0. This is the partition FPL and FedPLVM use (the
    reference code's last column, ``c[:, -1]``); ``early_exit`` as in :func:`finch`.
    """
    levels = finch(x, metric, early_exit)
    if not levels:
        return torch.zeros(0, dtype=torch.long)
    for labels in reversed(levels):
        if int(labels.max()) >= 1:
            return labels
    return levels[0]


def finch_cluster_fn(metric: str = "cosine", early_exit: bool = False) -> ClusterFn:
    """A :data:`ClusterFn` for mechanisms: one class's clipped features -> coarsest partition."""

    def fn(features: torch.Tensor) -> torch.Tensor:
        return coarsest_partition(features, metric, early_exit)

    return fn


def cluster_per_class(
    prototypes: torch.Tensor,
    classes: torch.Tensor,
    metric: str = "cosine",
    early_exit: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Server-side FINCH per class: the coarsest-partition cluster means of each class's vectors.

    Returns ``(centres [Q, d], centre_classes [Q])`` ordered by class, then cluster id. A class
    with one or two vectors gives one centre, their plain mean (FINCH links two points to each
    other). Means are unweighted, as in FPL's and FedPLVM's server aggregation. ``early_exit`` as
    in :func:`finch`.
    """
    centres: list[torch.Tensor] = []
    owners: list[int] = []
    for c in torch.unique(classes).tolist():
        members = prototypes[classes == c]
        labels = coarsest_partition(members, metric, early_exit)
        means = cluster_means(members.to(torch.float64), labels).to(prototypes.dtype)
        centres.append(means)
        owners.extend([c] * means.shape[0])
    if not centres:
        return prototypes.new_zeros(0, prototypes.shape[1]), torch.zeros(0, dtype=torch.long)
    return torch.cat(centres), torch.tensor(owners, dtype=torch.long)
