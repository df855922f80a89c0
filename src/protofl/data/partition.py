"""Partitioners: training fractions, equal shards and Dirichlet label skew (bounded retries)."""

from __future__ import annotations

import numpy as np


class PartitionError(ValueError):
    """A partition cannot meet its constraints; the message gives the numbers."""


def subsample(
    labels: np.ndarray, fraction: float, rng: np.random.Generator, *, max_count: int | None = None
) -> np.ndarray:
    """Stratified random subset of ``fraction`` of the indices (at least one per present class)."""
    if not 0 < fraction <= 1:
        raise PartitionError(f"fraction={fraction} must lie in (0, 1]")
    n = len(labels)
    target = max(1, round(fraction * n))
    if max_count is not None:
        target = min(target, max_count)
    if target >= n:
        return np.arange(n)
    chosen: list[np.ndarray] = []
    classes = np.unique(labels)
    for c in classes:
        idx = np.flatnonzero(labels == c)
        k = max(1, round(target * len(idx) / n))
        chosen.append(rng.choice(idx, size=min(k, len(idx)), replace=False))
    out = np.sort(np.concatenate(chosen))
    return out


def validation_split(
    labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``(train, validation)`` of a stratified random split of ``labels``.

    Each class gives ``round(fraction * n_c)`` of its ``n_c`` samples to validation, but keeps at
    least one for training; both parts are sorted. Raises :class:`PartitionError` when nothing is
    left for validation.
    """
    if not 0 < fraction < 1:
        raise PartitionError(f"validation fraction={fraction} must lie in (0, 1)")
    held: list[np.ndarray] = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        k = min(round(fraction * len(idx)), len(idx) - 1)
        if k > 0:
            held.append(rng.choice(idx, size=k, replace=False))
    if not held:
        raise PartitionError(
            f"a validation fraction of {fraction} of {len(labels)} samples holds out none"
        )
    val = np.sort(np.concatenate(held))
    train = np.setdiff1d(np.arange(len(labels)), val)
    return train, val


def equal_shards(
    indices: np.ndarray, num_clients: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Shuffle and split into ``num_clients`` near-equal shards."""
    if len(indices) < num_clients:
        raise PartitionError(
            f"cannot give {num_clients} clients at least one sample each "
            f"from {len(indices)} samples"
        )
    perm = rng.permutation(indices)
    return [np.sort(s) for s in np.array_split(perm, num_clients)]


def _check_dirichlet(samples: int, num_clients: int, alpha: float, min_size: int) -> None:
    if alpha <= 0:
        raise PartitionError(f"dirichlet alpha={alpha} must be > 0")
    if samples < num_clients * min_size:
        raise PartitionError(
            f"{samples} samples cannot give {num_clients} clients at least {min_size} each"
        )


def dirichlet_split(
    indices: np.ndarray,
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    *,
    min_size: int = 1,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Per-class Dirichlet(alpha) proportions over clients; retries at most ``max_tries`` times.

    ``labels`` are the labels of ``indices`` (same length). Fails with the numbers when no draw
    gives every client ``min_size`` samples, instead of looping forever.
    """
    _check_dirichlet(len(indices), num_clients, alpha, min_size)
    classes = np.unique(labels)
    smallest = 0
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(indices[labels == c])
            props = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(props) * len(idx)).astype(int)[:-1]
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].append(chunk)
        shards = [np.sort(np.concatenate(p)) for p in parts]
        sizes = [len(s) for s in shards]
        smallest = min(sizes)
        if smallest >= min_size:
            return shards
    raise PartitionError(
        f"Dirichlet(alpha={alpha}) split of {len(indices)} samples over {num_clients} clients "
        f"gave a client only {smallest} samples after {max_tries} tries (minimum {min_size}); "
        "raise alpha, lower data.min_client_size or use fewer clients"
    )


def dirichlet_label_split(
    indices: np.ndarray,
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    *,
    min_size: int = 1,
) -> list[np.ndarray]:
    """Client-wise Dirichlet label skew at any scale (``data.partition: dirichlet_labels``).

    Every client gets an equal share of the samples (sizes differ by at most one) and draws its
    own label distribution ``q ~ Dirichlet(alpha)`` over the classes; its share is drawn class by
    class from ``Multinomial(size, q)`` without replacement, and a class that has run out is
    replaced by the client's next most likely class that has samples left.  Unlike
    :func:`dirichlet_split` (per-class proportions over clients, which leaves clients empty when
    there are thousands of them and a few samples each), no client is ever empty, so it serves
    cross-device federations of 10^4 clients.
    """
    _check_dirichlet(len(indices), num_clients, alpha, min_size)
    classes = np.unique(labels)
    pools = [list(rng.permutation(indices[labels == c])) for c in classes]
    left = np.array([len(p) for p in pools])
    sizes = [len(a) for a in np.array_split(np.arange(len(indices)), num_clients)]
    shards = []
    for size in sizes:
        q = rng.dirichlet(np.full(len(classes), alpha))
        want = rng.multinomial(size, q)
        take = np.minimum(want, left)
        short = int(size - take.sum())
        for c in np.argsort(-q, kind="stable"):  # refill from the client's likeliest classes
            if short == 0:
                break
            extra = min(short, int(left[c] - take[c]))
            take[c] += extra
            short -= extra
        chunk = []
        for c in np.flatnonzero(take):
            n = int(take[c])
            chunk.extend(pools[c][len(pools[c]) - n :])
            del pools[c][len(pools[c]) - n :]
        left -= take
        shards.append(np.sort(np.asarray(chunk, dtype=indices.dtype)))
    return shards
