"""The federation a Flower server expects (:class:`FederationPlan`, from the run's data or its
config), the facts a node registers (:class:`NodeInfo`) and one round's fault log
(:class:`RoundLog`): what :class:`~protofl.engine.flower.strategy.ProtoStrategy` checks
registrations and replies against."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protofl.config import ExperimentConfig


@dataclass
class NodeInfo:
    """What the server knows about one registered node (from its ``hello`` reply)."""

    node_id: int
    partition: int
    name: str
    domain: int
    domain_name: str
    num_samples: int
    has_holdout: bool = False
    noise_key: str = "unknown"
    num_test: int | None = None  # the size of its domain's test set (evaluation plans)


@dataclass(frozen=True)
class PartitionFacts:
    """One partition as the server's own config defines it (what its node must register)."""

    name: str
    domain: int
    domain_name: str
    num_samples: int | None = None  # None: not known to the server (or not public)
    num_test: int | None = None


@dataclass(frozen=True)
class FederationPlan:
    """What the federation is, from the server's config (never from a node's ``hello``).

    ``source``: ``partition plan`` (the server built the federated data, as protofl's own
    Flower simulation does: every partition's sample count is known) or ``data set`` (the
    configured data set's classes and domains and the configured clients; sample counts are
    self-declared)."""

    num_classes: int
    domains: tuple[str, ...]
    partitions: tuple[PartitionFacts, ...]
    has_holdout: bool
    source: str

    @property
    def num_clients(self) -> int:
        """How many partitions (clients) the run has."""
        return len(self.partitions)

    @property
    def num_domains(self) -> int:
        """How many training domains the run has."""
        return len(self.domains)

    @property
    def counts_known(self) -> bool:
        """Whether every partition's sample count is known to the server."""
        return all(p.num_samples is not None for p in self.partitions)


def plan_from_data(config: ExperimentConfig, data: Any) -> FederationPlan:
    """The plan of federated data the server built itself (a
    :class:`~protofl.engine.federated_data.FederatedData`): every partition's facts, with its
    sample count unless the privacy config keeps exact counts private."""
    public = config.privacy.counts_public
    return FederationPlan(
        num_classes=int(data.num_classes),
        domains=tuple(data.domains),
        partitions=tuple(
            PartitionFacts(
                name=c.name,
                domain=c.domain,
                domain_name=c.domain_name,
                num_samples=c.num_train if public else None,
                num_test=len(c.test_y),
            )
            for c in data.clients
        ),
        has_holdout=data.holdout is not None,
        source="partition plan",
    )


def plan_from_config(config: ExperimentConfig, home: Path | None = None) -> FederationPlan:
    """The plan the configured data set gives without building any client's data: its classes,
    the training domains (``data.domains`` less ``data.holdout_domain``) and the clients of each
    (``data.allocation`` / ``data.clients_per_domain``), named as
    :func:`~protofl.engine.federated_data.build_federated_data` names them.  Sample counts are
    not known.  The data set must load on the server (``home``: default ``PROTOFL_HOME``)."""
    from protofl.data.cache import protofl_home

    home = Path(home) if home is not None else protofl_home()
    data = config.to_dict()["data"]
    key = (json.dumps([data, config.backbone.image_size], sort_keys=True), str(home))
    if key not in _PLANS:
        if len(_PLANS) >= 8:
            _PLANS.clear()
        _PLANS[key] = _load_plan(config, home)
    return _PLANS[key]


_PLANS: dict[tuple[str, str], FederationPlan] = {}
"""plan_from_config's per-process memo: (data config, home) -> plan."""


def _load_plan(config: ExperimentConfig, home: Path) -> FederationPlan:
    from protofl.engine.federated_data import client_counts, load_dataset

    try:
        dataset = load_dataset(config, home)
    except Exception as exc:
        raise RuntimeError(
            f"the server reads the federation's classes, domains and clients from the "
            f"configured data set {config.data.name!r}, which does not load here "
            f"({type(exc).__name__}: {exc}); make it available on the server (protofl datasets)"
        ) from None
    dcfg = config.data
    domains = list(dataset.domains)
    if dcfg.domains is not None:
        domains = [dataset.domain(name) for name in dcfg.domains]
    if dcfg.holdout_domain is not None:
        domains = [d for d in domains if d.name != dcfg.holdout_domain]
    counts = client_counts(config, dataset.name, [d.name for d in domains])
    parts = []
    for index, dom in enumerate(domains):
        k = counts[dom.name]
        for j in range(k):
            name = dom.name if k == 1 else f"{dom.name}-{j}"
            parts.append(PartitionFacts(name=name, domain=index, domain_name=dom.name))
    return FederationPlan(
        num_classes=dataset.num_classes,
        domains=tuple(d.name for d in domains),
        partitions=tuple(parts),
        has_holdout=dcfg.holdout_domain is not None and dcfg.validation_fraction is None,
        source="data set",
    )


@dataclass
class RoundLog:
    """Faults of one round: error replies, rejected records, nodes that did not answer."""

    rejected: list[dict[str, str]] = field(default_factory=list)

    def add(self, phase: str, node: NodeInfo | None, node_id: int, reason: str) -> None:
        name = node.name if node is not None else f"node-{node_id}"
        self.rejected.append(
            {"client": name, "node": str(node_id), "phase": phase, "reason": reason}
        )


def _same_facts(old: NodeInfo, new: NodeInfo) -> bool:
    """A re-registration of a partition must repeat its registered facts."""
    return (old.name, old.domain, old.domain_name, old.num_samples) == (
        new.name,
        new.domain,
        new.domain_name,
        new.num_samples,
    )
