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


def finch(x: torch.Tensor, metric: str = "cosine") -> list[torch.Tensor]:
    """All FINCH partitions of the rows of ``x``, finest first.

    Returns a list of label vectors ([n] int64, ids 0..k-1 in order of first appearance). Every
    level has at most half the clusters of the one before. The recursion stops at one cluster
    (that trivial level is included when reached, so ``finch(x)[-1]`` may be all zeros; see
    :func:`coarsest_partition`). ``n == 0`` gives ``[]``, ``n == 1`` gives ``[tensor([0])]``.
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
    labels = _components(first_neighbours(xd, metric))
    levels = [labels]
    k = int(labels.max()) + 1
    while k > 1:
        means = cluster_means(xd, labels)
        merge = _components(first_neighbours(means, metric))
        new_k = int(merge.max()) + 1
        if new_k >= k:  # cannot happen for k >= 2 (every node has an edge), kept as a guard
            break
        labels = relabel(merge[labels])
        levels.append(labels)
        k = new_k
    return levels


def coarsest_partition(x: torch.Tensor, metric: str = "cosine") -> torch.Tensor:
    """The coarsest FINCH partition with at least two clusters, if FINCH finds one.

    Otherwise (the first level is already a single cluster, which is always the case for
    ``n <= 2``) all points form cluster 0. This is the partition FPL and FedPLVM use.
    """
    levels = finch(x, metric)
    if not levels:
        return torch.zeros(0, dtype=torch.long)
    for labels in reversed(levels):
        if int(labels.max()) >= 1:
            return labels
    return levels[0]


def finch_cluster_fn(metric: str = "cosine") -> ClusterFn:
    """A :data:`ClusterFn` for mechanisms: one class's clipped features -> coarsest partition."""

    def fn(features: torch.Tensor) -> torch.Tensor:
        return coarsest_partition(features, metric)

    return fn


def cluster_per_class(
    prototypes: torch.Tensor, classes: torch.Tensor, metric: str = "cosine"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Server-side FINCH per class: the coarsest-partition cluster means of each class's vectors.

    Returns ``(centres [Q, d], centre_classes [Q])`` ordered by class, then cluster id. A class
    with one or two vectors gives one centre, their plain mean (FINCH links two points to each
    other). Means are unweighted, as in FPL's and FedPLVM's server aggregation.
    """
    centres: list[torch.Tensor] = []
    owners: list[int] = []
    for c in torch.unique(classes).tolist():
        members = prototypes[classes == c]
        labels = coarsest_partition(members, metric)
        means = cluster_means(members.to(torch.float64), labels).to(prototypes.dtype)
        centres.append(means)
        owners.extend([c] * means.shape[0])
    if not centres:
        return prototypes.new_zeros(0, prototypes.shape[1]), torch.zeros(0, dtype=torch.long)
    return torch.cat(centres), torch.tensor(owners, dtype=torch.long)
