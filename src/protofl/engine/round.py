"""The server side of one round, once for every engine.

The in-process simulator (:class:`~protofl.engine.simulation.Simulation`, with its per-client or
batched executor) and the Flower strategy
(:class:`~protofl.engine.flower.strategy.ProtoStrategy`) run the same round::

    select participants  ->  release (clients)  ->  validate  ->  aggregate (method)
        ->  local training (clients)  ->  average weights (weight-sharing methods)
        ->  evaluate (clients)  ->  round metrics, privacy status

Everything the server does in that list is here, as functions of plain values (the engine
supplies clients' names, domains, counts, ledgers and weights from wherever it holds them), so
both engines draw the same participants for the same seed, average the same way and report the
same metrics by construction.

The sequence itself is :func:`run_round`, once for the in-process engines: the simulator runs it
over its one run with its own executor (sequential or batched), a fused sweep over several runs
with the fused executor (:mod:`protofl.engine.fused`).  The Flower strategy sends the same
phases as messages and calls the same server-step functions.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from protofl.config import WEIGHT_RULES, FederationConfig
from protofl.methods.base import Upload, WeightPlan
from protofl.methods.validation import validate_upload
from protofl.models.device import to_device
from protofl.privacy.ledger import PrivacyLedger

if TYPE_CHECKING:
    from protofl.engine.client import Client

log = logging.getLogger(__name__)

LOCAL_ONLY_FIELDS = ("feature_norms", "mia", "privacy.partition_overlap", "train_loss")
"""Fields of a metrics row computed on clients' private data outside the privacy mechanism:
diagnostics for the experimenter's own run files, never sent by a deployed client."""


@dataclass
class RoundMetrics:
    """One round's results (accuracies are fractions in [0, 1])."""

    round: int
    acc: dict[str, float]
    client_acc: dict[str, float]
    avg_acc: float
    std_acc: float
    train_loss: float
    wall_s: float
    privacy: dict[str, Any] = field(default_factory=dict)
    holdout_acc: float | None = None
    participants: list[str] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)
    feature_norms: dict[str, dict[str, float]] = field(default_factory=dict)
    mia: dict[str, dict[str, float]] = field(default_factory=dict)
    missing_classes: list[int] = field(default_factory=list)
    # how the round was evaluated (:func:`evaluation_plan`): full | sample | none (no accuracy)
    evaluation: str = "full"

    def to_json(self) -> dict[str, Any]:
        """The whole row as a JSON-safe dict (a checkpoint's history).  A run folder splits it
        (:func:`protofl.engine.rundir.split_round`): ``metrics.jsonl`` gets all but the
        :data:`LOCAL_ONLY_FIELDS`, which go to the client-local ``diagnostics.jsonl``."""
        return {
            "round": self.round,
            "acc": self.acc,
            "client_acc": self.client_acc,
            "avg_acc": self.avg_acc,
            "std_acc": self.std_acc,
            "train_loss": self.train_loss,
            "wall_s": self.wall_s,
            "privacy": self.privacy,
            "holdout_acc": self.holdout_acc,
            "participants": self.participants,
            "rejected": self.rejected,
            "feature_norms": self.feature_norms,
            "mia": self.mia,
            "missing_classes": self.missing_classes,
            "evaluation": self.evaluation,
            "local_only": list(LOCAL_ONLY_FIELDS),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoundMetrics:
        """Inverse of :meth:`to_json`; a ``metrics.jsonl`` row without its local-only fields
        has a NaN ``train_loss`` (and no feature norms, MIA or partition overlap)."""
        fields = {k: v for k, v in data.items() if k != "local_only"}
        fields.setdefault("train_loss", math.nan)
        return cls(**fields)


# ----- 1. participants ---------------------------------------------------------------------------
def select_participants(
    federation: FederationConfig, num_clients: int, generator: torch.Generator
) -> list[bool]:
    """Which of ``num_clients`` clients (in client / partition order) take part this round:
    seeded sampling of ``ceil(participation * M)`` clients, then independent dropout."""
    m = num_clients
    chosen = [True] * m
    if federation.participation < 1.0:
        k = max(1, math.ceil(federation.participation * m))
        picked = torch.randperm(m, generator=generator)[:k].tolist()
        chosen = [i in picked for i in range(m)]
    if federation.dropout > 0:
        drops = torch.rand(m, generator=generator) < federation.dropout
        chosen = [ch and not bool(d) for ch, d in zip(chosen, drops)]
    return chosen


# ----- 2. validation -----------------------------------------------------------------------------
def validate_uploads(
    uploads: Sequence[Upload],
    *,
    names: Mapping[int, str],
    domains: Mapping[int, int],
    num_classes: int,
    dim: int,
    norm_bound: Any,
    one_per_class: bool,
    round_number: int,
) -> tuple[list[Upload], list[dict[str, str]]]:
    """Server-side checks of every upload (shape, classes, counts, domain, norm): the accepted
    ones, and a ``{"client", "reason"}`` row per rejected one (logged, left out)."""
    accepted, rejected = [], []
    for up in uploads:
        reason = validate_upload(
            up,
            declared_domain=domains[up.client],
            num_classes=num_classes,
            dim=dim,
            norm_bound=norm_bound,
            one_per_class=one_per_class,
        )
        if reason is None:
            accepted.append(up)
            continue
        name = names[up.client]
        log.warning("round %d: rejected upload of client %r: %s", round_number, name, reason)
        rejected.append({"client": name, "reason": reason})
    return accepted, rejected


def missing_classes(accepted: Sequence[Upload], num_classes: int, round_number: int) -> list[int]:
    """Classes no accepted upload carries this round (reported, never invented)."""
    present: set[int] = set()
    for up in accepted:
        if up.release is not None:
            present.update(int(c) for c in up.release.classes.tolist())
    missing = [c for c in range(num_classes) if c not in present]
    if missing:
        log.warning(
            "round %d: no client uploaded a prototype of class(es) %s", round_number, missing
        )
    return missing


# ----- 3. weight averaging -----------------------------------------------------------------------
def average_weights(
    states: Sequence[Mapping[str, torch.Tensor]],
    counts: Sequence[float],
    *,
    rule: str = "mean",
    trim_ratio: float = 0.2,
) -> dict[str, torch.Tensor]:
    """The clients' weights combined into one state.

    ``mean``: FedAvg's sample-weighted mean (McMahan et al., 2017) with weights ``counts``
    (uniform when they sum to 0); ``median`` / ``trimmed_mean``: the coordinate-wise median or
    mean after dropping ``floor(trim_ratio * n)`` values at each end (Yin et al., 2018), which a
    minority of clients cannot move arbitrarily far; they ignore ``counts`` (a client's claimed
    size buys it nothing).  Arithmetic in float64, results in each tensor's own dtype.
    """
    if not states:
        raise ValueError("average_weights: no client weights to average")
    if rule not in WEIGHT_RULES:
        raise ValueError(
            f"federation.weight_aggregation={rule!r} is unknown; choose one of: "
            + ", ".join(WEIGHT_RULES)
        )
    first = states[0]
    if rule == "mean":
        w = torch.tensor([float(c) for c in counts], dtype=torch.float64)
        total = float(w.sum())
        w = w / total if total > 0 else torch.full_like(w, 1.0 / len(states))
        return {
            k: sum(float(wi) * s[k].double() for wi, s in zip(w, states)).to(first[k].dtype)  # type: ignore[union-attr]
            for k in first
        }
    out = {}
    for k in first:
        stack = torch.stack([s[k].double() for s in states])
        if rule == "median":
            value = stack.quantile(0.5, dim=0) if stack.is_floating_point() else stack[0]
        else:
            cut = int(trim_ratio * len(states))
            ordered = stack.sort(dim=0).values
            value = ordered[cut : len(states) - cut].mean(dim=0)
        out[k] = value.to(first[k].dtype)
    return out


def combine_weights(
    plan: WeightPlan,
    states: Sequence[Mapping[str, torch.Tensor]],
    counts: Sequence[float],
    *,
    rule: str = "mean",
    trim_ratio: float = 0.2,
    method: str = "method",
) -> dict[str, torch.Tensor]:
    """The members' weights combined as the method's :class:`WeightPlan` says: the entries
    every client loads (those under ``plan.local`` are left out: each client keeps its own),
    averaged by :func:`average_weights` with the plan's coefficients, or ``counts`` (FedAvg)."""
    weights: Sequence[float] = counts
    if plan.coefficients is not None:
        if len(plan.coefficients) != len(states):
            raise ValueError(
                f"method {method!r} gave {len(plan.coefficients)} aggregation weights for "
                f"{len(states)} clients"
            )
        if rule != "mean":
            raise ValueError(
                f"method {method!r} chooses its own aggregation weights, which "
                f"federation.weight_aggregation={rule!r} ignores; use mean"
            )
        weights = plan.coefficients
    shared = [{k: v for k, v in s.items() if not plan.keeps_local(k)} for s in states]
    return average_weights(shared, weights, rule=rule, trim_ratio=trim_ratio)


# ----- 4. metrics and privacy status ------------------------------------------------------------
def round_metrics(
    *,
    round_number: int,
    client_acc: Mapping[str, float],
    domain_of: Mapping[str, str],
    losses: Sequence[float],
    wall_s: float,
    privacy: dict[str, Any],
    holdout_acc: float | None = None,
    participants: Sequence[str] = (),
    rejected: Sequence[dict[str, str]] = (),
    feature_norms: dict[str, dict[str, float]] | None = None,
    mia: dict[str, dict[str, float]] | None = None,
    missing: Sequence[int] = (),
    evaluation: str = "full",
) -> RoundMetrics:
    """The round's row: per-domain accuracy (the mean over the domain's clients, in the order
    the clients are given), their mean (AVG) and spread (STD), the mean training loss.  A round
    that was not evaluated (``evaluation="none"``, no ``client_acc``) has NaN accuracies."""
    per_domain: dict[str, list[float]] = {}
    for name, a in client_acc.items():
        per_domain.setdefault(domain_of[name], []).append(a)
    acc = {d: float(np.mean(v)) for d, v in per_domain.items()}
    values = list(acc.values())
    return RoundMetrics(
        round=round_number,
        acc=acc,
        client_acc=dict(client_acc),
        avg_acc=float(np.mean(values)) if values else math.nan,
        std_acc=float(np.std(values)) if values else math.nan,
        train_loss=float(np.mean(losses)) if len(losses) else math.nan,
        wall_s=wall_s,
        privacy=privacy,
        holdout_acc=holdout_acc,
        participants=list(participants),
        rejected=list(rejected),
        feature_norms=feature_norms or {},
        mia=mia or {},
        missing_classes=list(missing),
        evaluation=evaluation,
    )


EVAL_ALWAYS_LAST = 5
"""The last rounds that are always evaluated on the whole test sets (the headline metrics,
``final`` and ``last5``, are never estimated from a subsample)."""


def evaluation_plan(fed: FederationConfig, round_index: int) -> str:
    """How round ``round_index`` (0-based) is evaluated under ``federation.eval_every`` and
    ``federation.eval_samples``: ``full`` (every test set whole: the last
    :data:`EVAL_ALWAYS_LAST` rounds, and every round by default), ``sample`` (each test set's
    fixed seeded subsample) or ``none`` (skipped: no accuracy that round)."""
    if round_index >= fed.rounds - EVAL_ALWAYS_LAST:
        return "full"
    if (round_index + 1) % fed.eval_every != 0:
        return "none"
    return "sample" if fed.eval_samples > 0 else "full"


def eval_subsample(size: int, samples: int, generator: torch.Generator) -> torch.Tensor | None:
    """Sorted indices of a seeded subsample of ``samples`` of ``size`` test samples (None: the
    whole set, when ``samples`` is 0 or not smaller)."""
    if samples <= 0 or samples >= size:
        return None
    return torch.randperm(size, generator=generator)[:samples].sort().values


def privacy_status(
    ledgers: Mapping[str, PrivacyLedger],
    *,
    uses_prototypes: bool,
    partition_overlaps: Sequence[float] = (),
) -> dict[str, Any]:
    """Epsilon spent per client (None without a guarantee), from the ledgers the engine keeps
    for them; clients with the same privacy events are composed once (the accountant keeps its
    compositions, and a ledger its last epsilon: a PLD composition costs ~20 ms, i.e. 20 s a
    round at 1000 clients).  ``partition_overlaps``: VPP's local-only diagnostic of this
    round's releases (their mean is reported)."""
    if not uses_prototypes:
        return {"mechanism": "n/a (no prototype release)"}
    eps = {name: ledger.epsilon_spent() for name, ledger in ledgers.items()}
    status: dict[str, Any] = {"epsilon_spent": eps}
    if partition_overlaps:  # local-only diagnostic (computed on private data, never uploaded)
        status["partition_overlap"] = float(np.mean(list(partition_overlaps)))
    return status


# ----- the round sequence of the in-process engines ---------------------------------------------
class RoundRun(Protocol):
    """What :func:`run_round` reads and advances of one run (a
    :class:`~protofl.engine.simulation.Simulation` is one)."""

    config: Any
    method: Any
    clients: list[Client]
    round: int
    history: list[RoundMetrics]
    global_state: Any
    device: torch.device
    last_feature_norms: dict[str, dict[str, float]]
    last_mia: dict[str, dict[str, float]]

    def select_participants(self) -> list[bool]: ...

    def validate(self, uploads: list[Upload]) -> tuple[list[Upload], list[dict[str, str]]]: ...

    def missing_classes(self, accepted: list[Upload]) -> list[int]: ...

    def average_weights(self, active: Sequence[bool] | None = None) -> None: ...

    def evaluate_holdout(self, clients: Sequence[Client] | None = None) -> float | None: ...

    def privacy_status(self) -> dict[str, Any]: ...

    def offload_state(self, clients: Sequence[Client]) -> None: ...

    def page_out(self, clients: Sequence[Client] | None = None) -> None: ...


class RoundExecutor(Protocol):
    """The client side of :func:`run_round` for runs ``0..R-1``: each run's releases (the
    mechanism, ledgers and hooks as :meth:`Simulation.upload`), local training of the chosen
    clients, and evaluation (``samples``: run -> evaluate on the fixed subsample)."""

    def upload(self, active: Mapping[int, list[bool]]) -> dict[int, list[Upload]]: ...

    def train(self, chosen: Mapping[int, list[Client]]) -> dict[int, list[float]]: ...

    def evaluate(self, samples: Mapping[int, bool]) -> dict[int, dict[str, float]]: ...

    def scope(self, run: int) -> AbstractContextManager[Any]:
        """While open, log lines go to run ``run``'s log only."""
        ...


def run_round(runs: Sequence[RoundRun], executor: RoundExecutor) -> list[RoundMetrics]:
    """One round of every run in ``runs`` (all at the same round number), in the order the
    module doc gives: select, release, validate and aggregate, train, average weights,
    evaluate, metrics.  Each run advances its ``round`` and appends to its ``history``."""
    t0 = time.perf_counter()
    index = range(len(runs))
    active = {r: runs[r].select_participants() for r in index}
    chosen = {r: [c for c, a in zip(runs[r].clients, active[r]) if a] for r in index}
    uploads = executor.upload(active)
    rejected: dict[int, list[dict[str, str]]] = {}
    missing: dict[int, list[int]] = {}
    for r in index:
        run = runs[r]
        with executor.scope(r):
            accepted, rejected[r] = run.validate(uploads[r])
            run.global_state = to_device(run.method.aggregate(accepted, run.round), run.device)
            missing[r] = run.missing_classes(accepted)
    losses = executor.train(chosen)
    plans: dict[int, str] = {}
    for r in index:
        run = runs[r]
        if run.method.shares_weights and any(active[r]):
            run.average_weights(active[r])
        plans[r] = evaluation_plan(run.config.federation, run.round)
    accs = executor.evaluate({r: plans[r] == "sample" for r in index if plans[r] != "none"})
    holdout = {r: runs[r].evaluate_holdout() if plans[r] != "none" else None for r in index}
    for r in index:
        # what the round's participants' method state became goes to the mapped files too,
        # and the clients' pages leave the resident set (run.client_state=disk; no-ops else)
        runs[r].offload_state(chosen[r])
        runs[r].page_out()
    wall = time.perf_counter() - t0
    out = []
    for r in index:
        run = runs[r]
        metrics = round_metrics(
            round_number=run.round + 1,
            client_acc=accs.get(r, {}),
            domain_of={c.data.name: c.data.domain_name for c in run.clients},
            losses=losses[r],
            wall_s=wall,
            privacy=run.privacy_status(),
            holdout_acc=holdout[r],
            participants=[c.data.name for c in chosen[r]],
            rejected=rejected[r],
            feature_norms=run.last_feature_norms,
            mia=run.last_mia,
            missing=missing[r],
            evaluation=plans[r],
        )
        run.round += 1
        run.history.append(metrics)
        out.append(metrics)
    return out
