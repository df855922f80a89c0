"""Client allocations over domains, and the papers' data presets, as data.

Allocations (how many clients each domain gets; :func:`resolve_allocation`):

- ``None`` or ``"equal"``: ``clients_per_domain`` clients in every domain;
- ``"one_per_domain"`` (alias ``"vpdr"``): one client per domain (VPDR's domain-skew setting);
- ``"feddap"``: FedDAP's uneven allocation for the data set (:data:`FEDDAP_ALLOCATIONS`);
- a mapping ``{domain: count}`` covering every domain (0 = no client in that domain).

Presets (:data:`PRESETS`, :func:`preset_values`): the training fraction and split settings of
each paper per data set. Keys of a preset entry:

- ``train_fraction``: share of a domain's training split used for training;
- ``fraction_unit``: ``"domain"`` (VPDR: the domain's clients share ``train_fraction`` of the
  domain) or ``"client"`` (FedDAP: *each* client draws ``train_fraction`` of its domain's
  training split, disjoint from the other clients of that domain, until the domain runs out;
  see :func:`per_client_fraction_shards`);
- ``allocation``: the allocation name above;
- ``protocol``: the loader's split protocol option (``data.options.protocol``);
- ``image_size``: the paper's input size (VPDR 224 for ViT, FedDAP 32 for its ResNets).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from protofl.data.partition import PartitionError

FEDDAP_ALLOCATIONS: dict[str, dict[str, int]] = {
    "office_caltech10": {"caltech": 3, "amazon": 2, "webcam": 1, "dslr": 4},
    "pacs": {"photo": 3, "art_painting": 2, "cartoon": 1, "sketch": 4},
    "domainnet": {
        "clipart": 3,
        "infograph": 1,
        "painting": 4,
        "quickdraw": 6,
        "real": 4,
        "sketch": 2,
    },
}
"""FedDAP's uneven client counts per domain (10, 10 and 20 clients)."""

ALLOCATIONS: tuple[str, ...] = ("equal", "one_per_domain", "vpdr", "feddap")

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "vpdr": {
        "pacs": {
            "train_fraction": 0.3,
            "fraction_unit": "domain",
            "allocation": "one_per_domain",
            "protocol": "vpdr",
            "image_size": 224,
        },
        "office_caltech10": {
            "train_fraction": 0.3,
            "fraction_unit": "domain",
            "allocation": "one_per_domain",
            "protocol": "vpdr",
            "image_size": 224,
        },
        "digits": {
            "train_fraction": 0.1,
            "fraction_unit": "domain",
            "allocation": "one_per_domain",
            "protocol": "official",
            "image_size": 224,
        },
    },
    "feddap": {
        "pacs": {
            "train_fraction": 0.3,
            "fraction_unit": "client",
            "allocation": "feddap",
            "protocol": "feddap",
            "image_size": 32,
        },
        "office_caltech10": {
            "train_fraction": 0.2,
            "fraction_unit": "client",
            "allocation": "feddap",
            "protocol": "feddap",
            "image_size": 32,
        },
        "domainnet": {
            "train_fraction": 0.1,
            "fraction_unit": "client",
            "allocation": "feddap",
            "protocol": "feddap",
            "image_size": 32,
        },
        "digits": {
            "train_fraction": 0.01,
            "fraction_unit": "client",
            "allocation": "equal",
            "protocol": "official",
            "image_size": 32,
        },
    },
}
"""The papers' settings per data set (see the module docstring for the keys)."""


def preset_values(preset: str, dataset: str) -> dict[str, Any]:
    """A copy of ``PRESETS[preset][dataset]``; fails naming the valid presets or data sets."""
    if preset not in PRESETS:
        raise ValueError(f"unknown data preset {preset!r}; valid presets: " + ", ".join(PRESETS))
    table = PRESETS[preset]
    if dataset not in table:
        raise ValueError(
            f"data preset {preset!r} has no values for data set {dataset!r}; it covers: "
            + ", ".join(table)
        )
    return dict(table[dataset])


def resolve_allocation(
    spec: str | Mapping[str, int] | None,
    domains: Sequence[str],
    clients_per_domain: int,
    dataset: str | None = None,
) -> dict[str, int]:
    """Number of clients per domain, in the order of ``domains``.

    ``dataset`` is needed for ``"feddap"`` (the table depends on it); with a subset of the
    domains (e.g. one held out), only those domains' counts are returned.
    """
    domains = list(domains)
    if not domains:
        raise ValueError("resolve_allocation: no domains")
    if isinstance(clients_per_domain, bool) or int(clients_per_domain) < 1:
        raise ValueError(f"clients_per_domain must be >= 1, got {clients_per_domain!r}")
    if spec is None or spec == "equal":
        return {d: int(clients_per_domain) for d in domains}
    if spec in ("one_per_domain", "vpdr"):
        return {d: 1 for d in domains}
    if spec == "feddap":
        if dataset not in FEDDAP_ALLOCATIONS:
            raise ValueError(
                f"allocation 'feddap' is defined for {', '.join(FEDDAP_ALLOCATIONS)}, not for "
                f"data set {dataset!r}; give the counts as a mapping {{domain: clients}}"
            )
        table = FEDDAP_ALLOCATIONS[str(dataset)]
        unknown = [d for d in domains if d not in table]
        if unknown:
            raise ValueError(
                f"allocation 'feddap' for {dataset!r} has no count for domain(s) {unknown}; "
                "its domains: " + ", ".join(table)
            )
        return {d: table[d] for d in domains}
    if isinstance(spec, str):
        raise ValueError(
            f"unknown allocation {spec!r}; valid: {', '.join(ALLOCATIONS)}, or a mapping "
            "{domain: clients}"
        )
    if not isinstance(spec, Mapping):
        raise ValueError(f"allocation must be a name or a mapping, got {type(spec).__name__}")
    extra = sorted(set(spec) - set(domains))
    missing = [d for d in domains if d not in spec]
    if extra or missing:
        raise ValueError(
            f"allocation mapping must give a count for exactly the domains {domains}; "
            f"missing {missing}, unknown {extra}"
        )
    out: dict[str, int] = {}
    for d in domains:
        v = spec[d]
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or int(v) < 0:
            raise ValueError(f"allocation for domain {d!r} must be an int >= 0, got {v!r}")
        out[d] = int(v)
    if sum(out.values()) == 0:
        raise ValueError("allocation gives no client at all")
    return out


def per_client_fraction_shards(
    indices: np.ndarray, num_clients: int, fraction: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """FedDAP's sampling: each client in turn draws ``int(fraction * n)`` of the unused indices.

    Client shards are disjoint; when the domain runs out (e.g. 4 PACS sketch clients at 30%),
    the last clients get what remains. Fails with the numbers when a client would get nothing.
    """
    if not 0 < fraction <= 1:
        raise PartitionError(f"fraction={fraction} must lie in (0, 1]")
    n = len(indices)
    per = int(fraction * n)
    if per < 1:
        raise PartitionError(
            f"a per-client fraction of {fraction} of {n} samples gives each client 0 samples"
        )
    unused = np.asarray(indices)
    shards: list[np.ndarray] = []
    for client in range(num_clients):
        perm = rng.permutation(unused)
        shard, unused = perm[:per], perm[per:]
        if len(shard) == 0:
            raise PartitionError(
                f"{num_clients} clients drawing {per} samples each ({fraction:.0%} of {n}) "
                f"leave client {client} with none; lower the fraction or the client count"
            )
        shards.append(np.sort(shard))
    return shards


__all__ = [
    "ALLOCATIONS",
    "FEDDAP_ALLOCATIONS",
    "PRESETS",
    "per_client_fraction_shards",
    "preset_values",
    "resolve_allocation",
]
