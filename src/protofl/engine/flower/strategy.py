"""``ProtoStrategy``: one Flower strategy for every protofl method.

Flower's built-in strategies move one ArrayRecord of model weights; prototype methods move
per-client sets of (class, prototype, count) plus privacy facts, and some keep server-side
state (FedTGP's generator, MPFT's server head).  This strategy is parameterised by a protofl
:class:`~protofl.methods.base.Method` and reuses its server aggregator as it is.

One round, as in the in-process simulator (``Simulation.run_round``):

1. **release** (``train.release``) to the sampled clients: each applies the privacy mechanism
   locally and replies with its noisy release;
2. every reply is decoded and checked with
   :func:`~protofl.methods.validation.validate_upload`; error replies and malformed records are
   logged with node, partition, round and reason, and left out;
3. ``method.aggregate`` on the accepted uploads (in partition order) gives the global state;
4. **train** (``train``) with that state; methods that share weights reply their weights and
   the strategy averages them exactly as the simulator (:mod:`protofl.engine.round`);
5. **evaluate** (``evaluate``) on every known client, with the averaged weights if any.
   Under ``federation.eval_every`` / ``federation.eval_samples`` the round's
   :func:`~protofl.engine.round.evaluation_plan` is sent as ``config["evaluation"]``: ``full``
   (the whole test set), ``sample`` (the client's fixed seeded subsample, as in the simulator)
   or ``none``: no accuracy that round; the message then only carries the averaged weights
   (and is not sent at all for a method that shares none);
6. a :class:`~protofl.engine.simulation.RoundMetrics` with accuracies, privacy spent and the
   rejected replies.

Before round 1 a ``query.hello`` registers every node's partition id, domain and sample count
(the server only sees random node ids).  What the federation is (class count, domains, clients,
each partition's name and domain, and its sample count where the server built the partition
plan) comes from the server's own config (:class:`FederationPlan`), never from a node: a hello
that disagrees is refused and recorded.  Aggregation weights follow ``federation.weighting``
(:meth:`ProtoStrategy.weighted`): no node's self-declared count buys it more than
``federation.weight_cap`` times the median.  Sampling uses the simulator's own seeded procedure on
partition ids (Flower's ``sample_nodes`` draws from the unseeded global ``random``), so the same
seed picks the same clients on both engines.  Every phase waits at most ``round_timeout``
seconds: a node that vanished only costs that wait, and the round completes with the others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from protofl.config import ExperimentConfig
from protofl.engine.flower.codec import (
    DIAGNOSTIC_RECORD,
    CodecError,
    check_wire,
    claimed_partition,
    claimed_release_facts,
    decode_upload,
    encode_global_state,
    tensors_to_record,
    wire_fields,
)
from protofl.engine.flower.plan import (
    FederationPlan,
    NodeInfo,
    RoundLog,
    _same_facts,
    plan_from_config,
)
from protofl.engine.round import (
    RoundMetrics,
    combine_weights,
    evaluation_plan,
    privacy_status,
    round_metrics,
    select_participants,
)
from protofl.errors import ConfigError
from protofl.methods import METHOD_REGISTRY, create_method
from protofl.methods.base import GlobalState, Method, Upload
from protofl.methods.validation import validate_upload
from protofl.privacy import create_mechanism
from protofl.privacy.base import MECHANISM_REGISTRY, Mechanism, Release
from protofl.privacy.ledger import PrivacyLedger
from protofl.seeding import Stream, generator

log = logging.getLogger(__name__)

RELEASE = f"{MessageType.TRAIN}.release"
HELLO = f"{MessageType.QUERY}.hello"


class ProtoStrategy(Strategy):
    """Generic prototype-FL strategy driven by a protofl method's server aggregator.

    ``config`` is the experiment config (method, privacy, federation, seed).  ``min_nodes``:
    how many nodes to wait for before round 1 (None: as many as the clients report there are).
    ``round_timeout``: seconds each phase waits for replies.  ``wait_timeout``: seconds to wait
    for nodes to connect before giving up.  ``on_round`` is called with every round's metrics.
    ``plan``: what the federation is (:func:`plan_from_data` where the caller built the
    federated data; None: :func:`plan_from_config`, read when registration starts).
    """

    def __init__(
        self,
        config: ExperimentConfig,
        *,
        min_nodes: int | None = None,
        round_timeout: float = 600.0,
        wait_timeout: float = 300.0,
        on_round: Callable[[RoundMetrics], None] | None = None,
        poll_interval: float = 0.5,
        diagnostics: bool = False,
        plan: FederationPlan | None = None,
    ) -> None:
        self.config = config
        self.plan = plan
        # federation.weighting=declared: partition -> the operator's sample count
        self.declared = {int(p): n for p, n in config.federation.declared_counts.items()}
        extras = METHOD_REGISTRY.get(config.method.name).extra_uploads
        if extras:
            raise ValueError(
                f"method {config.method.name!r} has its clients upload "
                + "; ".join(e.split(":")[0] for e in extras)
                + " beside their weights, which the Flower engine does not carry; "
                "use run.engine=sim"
            )
        # accept the clients' local-only diagnostics record (protofl's own simulation only)
        self.diagnostics = diagnostics
        # every record.key the server received, per phase (the run record of what left clients)
        self.wire_seen: dict[str, set[str]] = {}
        # what the server received and accepted: per round, partition -> release
        self.received: list[dict[int, Any]] = []
        self.min_nodes = min_nodes
        self.round_timeout = float(round_timeout)
        self.wait_timeout = float(wait_timeout)
        self.on_round = on_round
        self.poll_interval = poll_interval
        fed = config.federation
        if getattr(MECHANISM_REGISTRY.get(config.privacy.mechanism), "secure_sum_mechanism", False):
            raise ConfigError(
                f"privacy.mechanism={config.privacy.mechanism} needs a secure sum, which the "
                "Flower engine does not run yet (SecAgg+ is not wired in); use run.engine=sim"
            )
        # calibrated as the clients' (privacy.release_schedule=once: for one release)
        self.mechanism: Mechanism = create_mechanism(
            config.privacy,
            rounds=config.privacy.releases(fed.rounds),
            dim=config.backbone.proto_dim,
        )
        # release_schedule=once: partition -> digest of the release it was charged for; a
        # reply carrying the very same release again is post-processing and is not charged
        self.sent_digests: dict[int, str] = {}
        self.method: Method | None = None
        self.nodes: dict[int, NodeInfo] = {}  # node id -> info
        # node id -> partition fixed from the authenticated identities (empty: first claim wins);
        # a node refused by it is not asked again (neither the map nor its claim changes)
        self.partition_map: dict[int, int] = {}
        self._off_map: set[int] = set()
        self.ledgers: dict[int, PrivacyLedger] = {}  # partition -> what left that client
        self.global_state: GlobalState = {}
        self.avg_weights: dict[str, torch.Tensor] | None = None
        self.history: list[RoundMetrics] = []
        self.num_clients = 0
        self.num_classes = 0
        self.server_gen = generator(config.seed, Stream.SERVER)
        self._partition_overlap: list[float] = []
        self._log = RoundLog()
        self._pending: list[dict[str, str]] = []  # registration refusals, shown in the next round
        # nodes refused at registration -> the partition they claimed (asked again only once
        # that partition's holder is gone)
        self._refused: dict[int, int] = {}
        self.rebinds: list[dict[str, str]] = []  # partitions moved to a restarted node
        self._failed: set[int] = set()
        self._round_nodes: list[NodeInfo] = []
        self._trained: list[int] = []
        self._losses: list[float] = []
        self._client_acc: dict[int, float] = {}
        self._holdout: dict[int, float] = {}
        self.num_domains = 0
        # a resumed run: partition -> the facts it registered before (a node claiming it now
        # must repeat them; node ids of the earlier session mean nothing now)
        self._resumed: dict[int, NodeInfo] = {}
        # partitions whose self-declared count was capped: name -> claimed, weight, first round
        self.capped: dict[str, dict[str, int]] = {}

    # ----- checkpoint state ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What the server needs to continue after a restart: the rounds so far, the global
        state, the method's server state, the seeded sampler, every client's server-side
        ledger, the registered facts per partition and what was received and rejected."""
        from protofl.privacy.base import release_to_dict

        return {
            "history": [m.to_json() for m in self.history],
            "global_state": dict(self.global_state),
            "avg_weights": self.avg_weights,
            "method": None if self.method is None else self.method.state_dict(),
            "shape": [self.num_clients, self.num_classes, self.num_domains],
            "server_gen": self.server_gen.get_state(),
            "ledgers": {p: led.state_dict() for p, led in sorted(self.ledgers.items())},
            "registered": {n.partition: asdict(n) for n in self._sorted_nodes()}
            | {p: asdict(n) for p, n in self._resumed.items() if p not in self._partitions()},
            "received": [
                {p: release_to_dict(r) for p, r in sorted(rnd.items())} for rnd in self.received
            ],
            "wire_seen": {k: sorted(v) for k, v in sorted(self.wire_seen.items())},
            "rebinds": list(self.rebinds),
            "partition_overlap": list(self._partition_overlap),
            "capped": {k: dict(v) for k, v in self.capped.items()},
            "sent_digests": dict(sorted(self.sent_digests.items())),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; the nodes register again (``hello``) and a node
        claiming a partition must repeat the facts that partition registered."""
        from protofl.privacy.base import release_from_dict

        self.history = [RoundMetrics.from_json(m) for m in state["history"]]
        self.global_state = dict(state["global_state"])
        self.avg_weights = state["avg_weights"]
        self.num_clients, self.num_classes, self.num_domains = (int(v) for v in state["shape"])
        if state["method"] is not None:
            self.method = self._create_method(self.num_classes, self.num_domains)
            self.method.load_state_dict(state["method"])
        self.server_gen.set_state(state["server_gen"])
        for p, ls in state["ledgers"].items():
            ledger = PrivacyLedger(
                delta=self.config.privacy.delta, accountant=self.config.privacy.accountant
            )
            ledger.load_state_dict(ls)
            self.ledgers[int(p)] = ledger
        self._resumed = {int(p): NodeInfo(**info) for p, info in state["registered"].items()}
        self.received = [
            {int(p): release_from_dict(r) for p, r in rnd.items()} for rnd in state["received"]
        ]
        self.wire_seen = {k: set(v) for k, v in state["wire_seen"].items()}
        self.rebinds = list(state["rebinds"])
        self.sent_digests = {int(p): str(d) for p, d in state.get("sent_digests", {}).items()}
        self._partition_overlap = [float(v) for v in state["partition_overlap"]]
        self.capped = {k: dict(v) for k, v in state.get("capped", {}).items()}

    def _partitions(self) -> set[int]:
        return {n.partition for n in self.nodes.values()}

    def registered_nodes(self) -> list[NodeInfo]:
        """Every partition's registered node in partition order (after a restart, a
        partition not registered again yet keeps its facts from before)."""
        now = {n.partition: n for n in self.nodes.values()}
        merged = {**{p: n for p, n in self._resumed.items() if p not in now}, **now}
        return [merged[p] for p in sorted(merged)]

    def _create_method(self, num_classes: int, num_domains: int) -> Method:
        return create_method(
            self.config.method.name,
            self.config.method.params,
            num_classes=num_classes,
            num_domains=num_domains,
            proto_dim=self.config.backbone.proto_dim,
            seed=self.config.seed,
        )

    # ----- Strategy interface ------------------------------------------------------------------
    def summary(self) -> None:
        """Log the configuration."""
        fed = self.config.federation
        log.info(
            "ProtoStrategy: method=%s mechanism=%s rounds=%d participation=%s dropout=%s "
            "round_timeout=%.0fs",
            self.config.method.name,
            self.config.privacy.mechanism,
            fed.rounds,
            fed.participation,
            fed.dropout,
            self.round_timeout,
        )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Training messages carrying the round's global state to the round's participants."""
        content = RecordDict(
            {"global": encode_global_state(self.global_state), "config": self._config(server_round)}
        )
        return self._messages(self._round_nodes, content, MessageType.TRAIN, server_round)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Mean training loss; for weight-sharing methods, the sample-weighted weight average."""
        losses: list[tuple[int, float]] = []
        members: list[tuple[int, Upload]] = []
        for node, msg in self._good_replies(replies, "train", server_round):
            try:
                check_wire("train", msg.content, diagnostics=self.diagnostics)
                up = decode_upload(msg.content, client=node.partition)
                diag = msg.content.get(DIAGNOSTIC_RECORD, MetricRecord())
                loss = float(diag.get("train-loss", math.nan))  # type: ignore[union-attr, arg-type]
            except (CodecError, KeyError, TypeError, ValueError) as exc:
                self._reject("train", node, msg, str(exc))
                continue
            reason = validate_upload(
                up,
                declared_domain=node.domain,
                num_classes=self.num_classes,
                dim=self.config.backbone.proto_dim,
            )
            reason = reason or self._registered_count_problem(node, up)
            shares = self.method is not None and self.method.shares_weights
            if reason is None and shares and up.weights is None:
                reason = "the method shares weights but the reply has none"
            if reason is not None:
                self._reject("train", node, msg, reason)
                continue
            losses.append((node.partition, loss))
            members.append((node.partition, up))
        losses.sort()
        self._trained = [p for p, _ in losses]
        self._losses = [v for _, v in losses if math.isfinite(v)]
        self.avg_weights = None
        if self.method is not None and self.method.shares_weights and members:
            ups = self.weighted([u for _, u in sorted(members, key=lambda m: m[0])], server_round)
            self.avg_weights = self._average_weights([(u.client, u) for u in ups])
            self.global_state["__weights_round"] = torch.tensor(server_round - 1)
        loss = float(np.mean(self._losses)) if self._losses else math.nan
        metrics = MetricRecord({"num-trained": len(losses)})
        if math.isfinite(loss):
            metrics["train-loss"] = loss
        arrays = None if self.avg_weights is None else tensors_to_record(self.avg_weights)
        return arrays, metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Evaluation messages to every known node (with the averaged weights, if any), saying
        how the round is evaluated (:func:`~protofl.engine.round.evaluation_plan`); none when
        the round is not evaluated and there are no weights to hand out."""
        plan = evaluation_plan(self.config.federation, server_round - 1)
        if plan == "none" and self.avg_weights is None:
            return []
        round_config = self._config(server_round)
        round_config["evaluation"] = plan
        content = RecordDict(
            {"global": encode_global_state(self.global_state), "config": round_config}
        )
        if self.avg_weights is not None:
            content["weights"] = tensors_to_record(self.avg_weights)
        live = set(grid.get_node_ids())
        nodes = [n for n in self._sorted_nodes() if n.node_id in live]
        return self._messages(nodes, content, MessageType.EVALUATE, server_round)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Per-client accuracies (kept for the round's metrics); returns their mean (None: the
        round is not evaluated, its replies only acknowledge the averaged weights)."""
        self._client_acc = {}
        self._holdout = {}
        good = self._good_replies(replies, "evaluate", server_round)
        plan = evaluation_plan(self.config.federation, server_round - 1)
        if plan == "none":
            return None
        for node, msg in good:
            try:
                metrics = msg.content["metrics"]
                acc = float(metrics["accuracy"])  # type: ignore[index, arg-type]
                if not 0.0 <= acc <= 1.0:
                    raise ValueError(f"accuracy {acc!r} is outside [0, 1]")
                self._check_evaluated(node, plan, metrics)
                if "holdout-accuracy" in metrics:  # type: ignore[operator]
                    self._holdout[node.partition] = float(metrics["holdout-accuracy"])  # type: ignore[index, arg-type]
            except (KeyError, TypeError, ValueError) as exc:
                self._reject("evaluate", node, msg, f"malformed metrics: {exc}")
                continue
            self._client_acc[node.partition] = acc
        if not self._client_acc:
            return None
        return MetricRecord({"accuracy": float(np.mean(list(self._client_acc.values())))})

    def _check_evaluated(self, node: NodeInfo, plan: str, metrics: Any) -> None:
        """A client measured what the round's plan asks: its whole test set (``full``) or the
        subsample of ``federation.eval_samples`` (``sample``); a client that ignores the plan
        (one built before evaluation plans) would report figures the simulator does not."""
        if node.num_test is None or "num-examples" not in metrics:
            return
        want = node.num_test
        if plan == "sample" and 0 < self.config.federation.eval_samples < node.num_test:
            want = self.config.federation.eval_samples
        got = int(metrics["num-examples"])
        if got != want:
            raise ValueError(
                f"evaluated on {got} test samples; the round's plan ({plan}) asks for {want}"
            )

    # ----- the release phase (prototype upload) ----------------------------------------------
    def configure_release(self, server_round: int, grid: Grid) -> list[Message]:
        """Release requests to this round's participants."""
        content = RecordDict({"config": self._config(server_round)})
        return self._messages(self._round_nodes, content, RELEASE, server_round)

    def aggregate_release(self, server_round: int, replies: Iterable[Message]) -> GlobalState:
        """Decode, charge, validate, aggregate: the new global state."""
        assert self.method is not None
        accepted: list[Upload] = []
        overlaps: list[float] = []
        for node, msg in self._good_replies(replies, "release", server_round):
            # a release that left the client is charged, accepted or not, and with what the
            # server's own configured mechanism costs (a client cannot omit or shrink events)
            facts = claimed_release_facts(msg.content)
            try:  # decoded once, before the charge (a re-send is recognised by its content)
                check_wire("release", msg.content, diagnostics=self.diagnostics)
                up: Upload | CodecError = decode_upload(msg.content, client=node.partition)
            except CodecError as exc:
                up = exc
            resent = self._resent(node, None if isinstance(up, CodecError) else up)
            if facts is not None or "release" in msg.content:
                reason = self._charge(node, server_round, facts, resent=resent)
                if reason is None and resent is False:
                    reason = "privacy.release_schedule=once: a second, different release (charged)"
                if reason is not None:
                    self._reject("release", node, msg, reason)
                    continue
            claimed = claimed_partition(msg.content)
            if claimed is not None and claimed != node.partition:
                self._reject(
                    "release",
                    node,
                    msg,
                    f"claims partition {claimed}, registered as {node.partition}",
                )
                continue
            if isinstance(up, CodecError):
                self._reject("release", node, msg, f"malformed record: {up}")
                continue
            reason = validate_upload(
                up,
                declared_domain=node.domain,
                num_classes=self.num_classes,
                dim=self.config.backbone.proto_dim,
                norm_bound=self.mechanism.norm_bound,
                one_per_class=self.method.cluster_fn() is None,
            ) or self._registered_count_problem(node, up)
            if reason is not None:
                self._reject("release", node, msg, reason)
                continue
            diag = msg.content.get(DIAGNOSTIC_RECORD)
            if isinstance(diag, MetricRecord) and "partition_overlap" in diag:
                overlaps.append(float(diag["partition_overlap"]))  # type: ignore[arg-type]
            accepted.append(up)
        accepted.sort(key=lambda u: u.client)  # the simulator's order: aggregation is bitwise equal
        self.received.append({u.client: u.release for u in accepted if u.release is not None})
        self._partition_overlap = overlaps
        return self.method.aggregate(self.weighted(accepted, server_round), server_round - 1)

    def _resent(self, node: NodeInfo, up: Upload | None) -> bool | None:
        """Under ``privacy.release_schedule: once``, for a partition that has released: True
        when the decoded reply ``up`` (None: malformed) carries exactly the release it was
        charged for (a re-send), False otherwise; None when the schedule does not apply.  The
        first release that reaches the server is remembered by its digest."""
        if self.config.privacy.release_schedule != "once" or not self.mechanism.is_private:
            return None
        digest = None if up is None or up.release is None else release_digest(up.release)
        known = self.sent_digests.get(node.partition)
        if known is None:
            if digest is not None:
                self.sent_digests[node.partition] = digest
            return None
        return digest == known

    def _charge(
        self,
        node: NodeInfo,
        server_round: int,
        facts: tuple[str, list[dict[str, Any]]] | None,
        *,
        resent: bool | None = None,
    ) -> str | None:
        """Charge ``node``'s ledger for one release with the events the server's mechanism
        prescribes (not a verified re-send of a release already charged); the reason to
        reject the reply when its declared facts disagree."""
        ledger = self.ledgers[node.partition]
        if resent:
            events = self.mechanism.release_events(0)  # what the re-sent release declared
        else:
            events = self.mechanism.release_events(len(ledger.entries))
            ledger.charge(server_round - 1, self.mechanism.name, events)
        if facts is None:
            return "a release record without readable mechanism and events"
        mechanism, declared = facts
        if mechanism != self.mechanism.name:
            return f"declares mechanism {mechanism!r}, the run's is {self.mechanism.name!r}"
        if declared != events:
            return f"declares privacy events {declared}, the configured mechanism charges {events}"
        return None

    def _registered_count_problem(self, node: NodeInfo, up: Upload) -> str | None:
        """A client's aggregation weight is what it registered: an upload claiming another
        sample count is refused (under noisy add/remove counts nothing exact is registered)."""
        if not self.config.privacy.counts_public:
            return None
        if up.num_samples != node.num_samples:
            return f"claims {up.num_samples} samples, registered {node.num_samples}"
        return None

    # ----- aggregation weights ----------------------------------------------------------------
    def weight_limit(self, claims: Sequence[int]) -> int | None:
        """The most weight one client may carry (None: no limit).  Only self-declared counts
        are capped (``federation.weighting: samples`` where the server knows no partition's
        count): ``federation.weight_cap`` times the lower median of the registered counts (of
        this round's ``claims`` where exact counts are private), so a minority of liars cannot
        move the median."""
        fed = self.config.federation
        if fed.weighting != "samples" or fed.weight_cap == 0:
            return None
        if self.plan is not None and self.plan.counts_known:
            return None  # every registered count was checked against the partition plan
        if self.config.privacy.counts_public:
            counts = [n.num_samples for n in self.registered_nodes()]
        else:
            counts = list(claims)
        if not counts:
            return None
        return max(1, math.floor(fed.weight_cap * statistics.median_low(counts)))

    def weighted(self, uploads: Sequence[Upload], server_round: int = 0) -> list[Upload]:
        """``uploads`` with the aggregation weights ``federation.weighting`` gives: each
        upload's ``num_samples`` (FedAvg's weight, and what methods weigh clients by) and its
        release's per-class counts, scaled alike.  ``samples``: the registered count, at most
        :meth:`weight_limit`; ``uniform``: the same for every client (the round's largest
        count, so scaled counts stay integers >= 1); ``declared``: the operator's count (every
        registration was checked against it).  An upload whose weight stays is passed on
        as it is (so honest runs aggregate bitwise as the simulator)."""
        ups = list(uploads)
        if not ups:
            return ups
        claims = [u.num_samples for u in ups]
        if self.config.federation.weighting == "uniform":
            targets = [max(max(claims), 1)] * len(ups)
        else:
            limit = self.weight_limit(claims)
            targets = claims if limit is None else [min(n, limit) for n in claims]
            names = {n.partition: n.name for n in self.registered_nodes()}
            for u, t in zip(ups, targets, strict=True):
                name = names.get(u.client, f"partition-{u.client}")
                if t != u.num_samples and name not in self.capped:
                    log.warning(
                        "round %d: %s claims %d samples; its weight is capped at %d "
                        "(federation.weight_cap x the median registered count)",
                        server_round,
                        name,
                        u.num_samples,
                        t,
                    )
                    self.capped[name] = {
                        "claimed": u.num_samples,
                        "weight": t,
                        "round": server_round,
                    }
        return [u if t == u.num_samples else _reweighted(u, t) for u, t in zip(ups, targets)]

    def weighting_summary(self) -> dict[str, Any]:
        """How the run weighted its clients (``summary.json``'s ``weighting``)."""
        fed = self.config.federation
        plan = self.plan
        if fed.weighting == "uniform":
            source = "none: every client weighs the same"
        elif fed.weighting == "declared":
            source = "federation.declared_counts (the operator's)"
        elif plan is not None and plan.counts_known:
            source = "the partition plan the server built (every registration checked)"
        elif not self.config.privacy.counts_public:
            source = "the released noisy counts, capped"
        else:
            source = "self-declared at registration, capped"
        out: dict[str, Any] = {
            "mode": fed.weighting,
            "counts": source,
            "plan": None if plan is None else plan.source,
        }
        limit = self.weight_limit([])
        if fed.weighting == "samples" and (limit is not None or fed.weight_cap == 0):
            out["weight_cap"] = fed.weight_cap
            out["limit"] = limit
        out["capped"] = {k: dict(v) for k, v in sorted(self.capped.items())}
        return out

    # ----- driving loop ------------------------------------------------------------------------
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int | None = None,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Register the nodes, then run ``num_rounds`` (default: ``federation.rounds``) rounds
        of release -> aggregate -> train -> evaluate; returns Flower's ``Result``."""
        if timeout is not None:
            self.round_timeout = float(timeout)
        rounds = self.config.federation.rounds if num_rounds is None else int(num_rounds)
        self.summary()
        result = Result()
        self.register(grid)
        train_config = train_config if train_config is not None else ConfigRecord()
        evaluate_config = evaluate_config if evaluate_config is not None else ConfigRecord()
        for rnd in range(len(self.history) + 1, len(self.history) + rounds + 1):
            t0 = time.perf_counter()
            self._log = RoundLog()
            self._failed = set()
            self._register_new(grid, rnd)
            self._log.rejected.extend(self._pending)
            self._pending = []
            self._round_nodes = self.select(grid)
            replies = self._send(grid, self.configure_release(rnd, grid), "release", rnd)
            self.global_state = self.aggregate_release(rnd, replies)
            # a node that failed or vanished while releasing sits out the rest of the round
            self._round_nodes = [n for n in self._round_nodes if n.node_id not in self._failed]
            msgs = self.configure_train(rnd, ArrayRecord(), train_config, grid)
            arrays, train_metrics = self.aggregate_train(rnd, self._send(grid, msgs, "train", rnd))
            if arrays is not None:
                result.arrays = arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[rnd] = train_metrics
            msgs = self.configure_evaluate(rnd, ArrayRecord(), evaluate_config, grid)
            eval_metrics = self.aggregate_evaluate(rnd, self._send(grid, msgs, "evaluate", rnd))
            if eval_metrics is not None:
                result.evaluate_metrics_clientapp[rnd] = eval_metrics
            metrics = self._round_metrics(rnd, time.perf_counter() - t0)
            self.history.append(metrics)
            spent = [e for e in metrics.privacy.get("epsilon_spent", {}).values() if e is not None]
            if spent:  # privacy per round in Flower's own Result, too
                record = result.train_metrics_clientapp.setdefault(rnd, MetricRecord())
                record["epsilon-max"] = float(max(spent))
                record["rejected"] = len(metrics.rejected)
            log.info(
                "round %d: avg %.4f std %.4f loss %.4f, %d rejected",
                rnd,
                metrics.avg_acc,
                metrics.std_acc,
                metrics.train_loss,
                len(metrics.rejected),
            )
            if evaluate_fn is not None:
                res = evaluate_fn(rnd, result.arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[rnd] = res
            if self.on_round is not None:
                self.on_round(metrics)
        return result

    # ----- registration and sampling -------------------------------------------------------
    def register(self, grid: Grid) -> None:
        """Wait for the nodes and learn each one's partition (``query.hello``)."""
        self._prepare()
        deadline = time.monotonic() + self.wait_timeout
        want = self.min_nodes or 1
        while True:
            live = sorted(grid.get_node_ids())
            new = self._unregistered(live)
            if new:
                self._hello(grid, new, 0)
            if self.min_nodes is None and self.num_clients:
                want = self.num_clients
            if len(self.nodes) >= want:
                break
            if time.monotonic() > deadline:
                refused = "; ".join(
                    f"node {r['node']} ({r['client']}) {r['reason']}" for r in self._pending
                )
                raise TimeoutError(
                    f"only {len(self.nodes)} of {want} nodes registered within "
                    f"{self.wait_timeout:.0f}s" + (f"; refused: {refused}" if refused else "")
                )
            log.info("waiting for nodes: %d of %d registered", len(self.nodes), want)
            time.sleep(self.poll_interval)
        if self.method is None:
            raise RuntimeError("no node answered the registration")

    def _prepare(self) -> None:
        """The federation's plan from the server's own config (never from a node), the method
        built for it, and the declared counts checked against it."""
        if self.plan is None:
            self.plan = plan_from_config(self.config)
        plan = self.plan
        self.num_clients, self.num_classes = plan.num_clients, plan.num_classes
        self.num_domains = plan.num_domains
        if self.method is None:
            self.method = create_method(
                self.config.method.name,
                self.config.method.params,
                num_classes=plan.num_classes,
                num_domains=plan.num_domains,
                proto_dim=self.config.backbone.proto_dim,
                seed=self.config.seed,
                rounds=self.config.federation.rounds,
            )
        declared = self.declared
        if self.config.federation.weighting == "declared":
            missing = [p for p in range(plan.num_clients) if p not in declared]
            extra = [p for p in declared if p >= plan.num_clients]
            if missing or extra:
                raise ValueError(
                    "federation.declared_counts: "
                    + (f"no count for partition(s) {missing}" if missing else "")
                    + ("; " if missing and extra else "")
                    + (f"partition(s) {extra} do not exist" if extra else "")
                    + f" (the run has partitions 0..{plan.num_clients - 1})"
                )
            for p, facts in enumerate(plan.partitions):
                if facts.num_samples is not None and facts.num_samples != declared[p]:
                    raise ValueError(
                        f"federation.declared_counts.{p}={declared[p]}, but the partition "
                        f"plan gives partition {p} ({facts.name}) {facts.num_samples} samples"
                    )

    def _plan_problem(self, info: NodeInfo, hello: Any) -> str | None:
        """Why a hello disagrees with the federation's plan (None: it agrees).  The shape
        (classes, domains, clients, held-out domain), the method and mechanism, the claimed
        partition's name and domain, and its sample count where the server knows it."""
        assert self.plan is not None
        plan = self.plan
        expected: list[tuple[str, Any, Any]] = [
            ("num-classes", plan.num_classes, hello.get("num-classes")),
            ("num-domains", plan.num_domains, hello.get("num-domains")),
            ("num-clients", plan.num_clients, hello.get("num-clients")),
            ("has-holdout", plan.has_holdout, hello.get("has-holdout", plan.has_holdout)),
            ("method", self.config.method.name, hello.get("method")),
            ("mechanism", self.mechanism.name, hello.get("mechanism")),
        ]
        for key, want, got in expected:
            if got != want:
                return f"reports {key}={got!r}, the run's config has {want!r}"
        if not 0 <= info.partition < plan.num_clients:
            return (
                f"claims partition {info.partition}, the run has partitions "
                f"0..{plan.num_clients - 1}"
            )
        facts = plan.partitions[info.partition]
        got_facts = (info.name, info.domain, info.domain_name)
        want_facts = (facts.name, facts.domain, facts.domain_name)
        if got_facts != want_facts:
            return (
                f"claims partition {info.partition} as {info.name} (domain {info.domain} "
                f"{info.domain_name}); the run's partition {info.partition} is {facts.name} "
                f"(domain {facts.domain} {facts.domain_name})"
            )
        if facts.num_test is not None and info.num_test not in (None, facts.num_test):
            return (
                f"registers {info.num_test} test samples, the partition plan has {facts.num_test}"
            )
        if not self.config.privacy.counts_public:
            return None
        if facts.num_samples is not None and info.num_samples != facts.num_samples:
            return (
                f"registers {info.num_samples} samples, the partition plan has {facts.num_samples}"
            )
        if self.config.federation.weighting == "declared":
            want = self.declared.get(info.partition)
            if info.num_samples != want:
                return (
                    f"registers {info.num_samples} samples, federation.declared_counts has {want}"
                )
        return None

    def _register_new(self, grid: Grid, rnd: int) -> None:
        live = set(grid.get_node_ids())
        new = self._unregistered(sorted(live))
        if new:
            self._hello(grid, new, rnd)

    def _unregistered(self, live: Sequence[int]) -> list[int]:
        """Live nodes to ask for registration: new ones, and refused ones whose claimed
        partition's holder has disconnected since."""
        holders = {info.partition: info.node_id for info in self.nodes.values()}
        alive = set(live)
        return [
            n
            for n in live
            if n not in self.nodes
            and (n not in self._refused or holders.get(self._refused[n]) not in alive)
            and n not in self._off_map
        ]

    def _hello(self, grid: Grid, node_ids: Sequence[int], rnd: int) -> None:
        msgs = [
            Message(
                content=RecordDict({"config": self._config(rnd)}),
                dst_node_id=n,
                message_type=HELLO,
            )
            for n in node_ids
        ]
        taken = {info.partition: info for info in self.nodes.values()}
        live = set(grid.get_node_ids())
        replies = grid.send_and_receive(msgs, timeout=self.round_timeout)
        # in node-id order: which of two simultaneous claims wins does not depend on timing
        for msg in sorted(replies, key=lambda m: m.metadata.src_node_id):
            node_id = msg.metadata.src_node_id
            if msg.has_error():
                log.warning("node %d: registration failed: %s", node_id, msg.error.reason)
                continue
            self.wire_seen.setdefault("hello", set()).update(wire_fields(msg.content))
            try:
                h = msg.content["hello"]
                info = NodeInfo(
                    node_id=node_id,
                    partition=int(h["partition-id"]),  # type: ignore[arg-type]
                    name=str(h["name"]),
                    domain=int(h["domain"]),  # type: ignore[arg-type]
                    domain_name=str(h["domain-name"]),
                    # absent under add_remove with noisy counts (the exact count is private)
                    num_samples=int(h.get("num-samples", 0)),  # type: ignore[call-overload, arg-type]
                    has_holdout=bool(h.get("has-holdout", False)),
                    noise_key=str(h.get("noise-key", "unknown")),
                    num_test=int(h["num-test"]) if "num-test" in h else None,  # type: ignore[call-overload, arg-type]
                )
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("node %d: malformed registration (%s); ignored", node_id, exc)
                self._pending.append(
                    {
                        "client": f"node-{node_id}",
                        "node": str(node_id),
                        "phase": "hello",
                        "reason": f"malformed registration ({type(exc).__name__}: {exc})",
                    }
                )
                continue
            reason = self._plan_problem(info, h)
            if reason is not None:
                # the federation is what the server's config says: a hello cannot change it,
                # and one that disagrees holds no partition (its facts cannot become right:
                # not asked again)
                log.warning("node %d %s; refused", node_id, reason)
                self._off_map.add(node_id)
                self._pending.append(
                    {"client": info.name, "node": str(node_id), "phase": "hello", "reason": reason}
                )
                continue
            bound = self.partition_map.get(node_id, -1) if self.partition_map else info.partition
            if bound != info.partition:  # also covers a rebind to a node not bound to it
                reason = f"claims partition {info.partition}, its identity is bound to " + (
                    f"partition {bound}" if bound >= 0 else "no partition"
                )
                log.warning("node %d %s; refused", node_id, reason)
                self._off_map.add(node_id)
                self._pending.append(
                    {"client": info.name, "node": str(node_id), "phase": "hello", "reason": reason}
                )
                continue
            held = taken.get(info.partition)
            if held is not None and held.node_id not in live and _same_facts(held, info):
                # the holder is gone (a restarted SuperNode gets a new id): the partition moves
                # to the new node, with the same registered facts and the same server ledger
                log.warning(
                    "partition %d re-bound from node %d (no longer connected) to node %d",
                    info.partition,
                    held.node_id,
                    node_id,
                )
                self.rebinds.append(
                    {
                        "partition": str(info.partition),
                        "from": str(held.node_id),
                        "to": str(node_id),
                    }
                )
                del self.nodes[held.node_id]
                del taken[info.partition]
            before = self._resumed.get(info.partition)
            if before is not None and not _same_facts(before, info):
                reason = (
                    f"claims partition {info.partition} with other facts ({info.name}, domain "
                    f"{info.domain_name}, {info.num_samples} samples) than it registered before "
                    f"the restart ({before.name}, domain {before.domain_name}, "
                    f"{before.num_samples} samples)"
                )
                log.warning("node %d %s; refused", node_id, reason)
                self._off_map.add(node_id)  # its facts cannot become right: not asked again
                self._pending.append(
                    {"client": info.name, "node": str(node_id), "phase": "hello", "reason": reason}
                )
                continue
            if info.partition in taken:
                reason = (
                    f"claims partition {info.partition}, already held by node "
                    f"{taken[info.partition].node_id}"
                )
                log.warning("node %d %s; refused", node_id, reason)
                self._refused[node_id] = info.partition
                self._pending.append(
                    {"client": info.name, "node": str(node_id), "phase": "hello", "reason": reason}
                )
                continue
            assert self.method is not None  # built from the plan before any hello
            if self.method.needs_domain and info.domain < 0:
                raise ValueError(
                    f"method {self.method.name!r} needs every client to report a domain"
                )
            self.nodes[node_id] = info
            taken[info.partition] = info
            self.ledgers.setdefault(
                info.partition,
                PrivacyLedger(
                    delta=self.config.privacy.delta, accountant=self.config.privacy.accountant
                ),
            )
            log.info(
                "node %d registered as partition %d (%s, domain %s, %d samples)",
                node_id,
                info.partition,
                info.name,
                info.domain_name,
                info.num_samples,
            )

    def select(self, grid: Grid) -> list[NodeInfo]:
        """This round's participants: the simulator's seeded sampling over partition ids.

        :func:`protofl.engine.round.select_participants` over the partition list, as the
        simulator's, so both engines draw the same clients for the same seed.  Partitions whose
        node is gone are dropped (they would only time out).
        """
        partitions = max(
            self.num_clients, max((n.partition for n in self.nodes.values()), default=-1) + 1
        )
        chosen = select_participants(self.config.federation, partitions, self.server_gen)
        by_partition = {n.partition: n for n in self.nodes.values()}
        live = set(grid.get_node_ids())
        out = []
        for p, ch in enumerate(chosen):
            if not ch:
                continue
            node = by_partition.get(p)
            if node is None or node.node_id not in live:
                self._log.add("select", node, -1 if node is None else node.node_id, "not connected")
                continue
            out.append(node)
        return out

    # ----- helpers ---------------------------------------------------------------------------
    def _config(self, rnd: int) -> ConfigRecord:
        return ConfigRecord({"server-round": rnd})

    def _sorted_nodes(self) -> list[NodeInfo]:
        return sorted(self.nodes.values(), key=lambda n: n.partition)

    def _messages(
        self, nodes: Sequence[NodeInfo], content: RecordDict, message_type: str, rnd: int
    ) -> list[Message]:
        return [
            Message(
                content=RecordDict(dict(content)),
                dst_node_id=n.node_id,
                message_type=message_type,
                group_id=str(rnd),
            )
            for n in nodes
        ]

    def _send(
        self, grid: Grid, msgs: list[Message] | Iterable[Message], phase: str, rnd: int
    ) -> list[Message]:
        msgs = list(msgs)
        if not msgs:
            return []
        sent = {m.metadata.dst_node_id for m in msgs}
        replies = list(grid.send_and_receive(msgs, timeout=self.round_timeout))
        answered = {m.metadata.src_node_id for m in replies}
        for node_id in sorted(sent - answered):
            node = self.nodes.get(node_id)
            reason = f"no reply within {self.round_timeout:g}s (node gone or too slow)"
            log.warning(
                "round %d, %s: node %d (%s) timed out",
                rnd,
                phase,
                node_id,
                node.name if node else "?",
            )
            self._log.add(phase, node, node_id, reason)
            self._failed.add(node_id)
        return replies

    def _good_replies(
        self, replies: Iterable[Message], phase: str, rnd: int
    ) -> list[tuple[NodeInfo, Message]]:
        out = []
        for msg in replies:
            node_id = msg.metadata.src_node_id
            node = self.nodes.get(node_id)
            if node is None:
                log.warning("round %d, %s: reply from unknown node %d ignored", rnd, phase, node_id)
                continue
            if msg.has_error():
                reason = f"error reply (code {msg.error.code}): {msg.error.reason}"
                log.warning(
                    "round %d, %s: node %d (partition %d, %s) failed: %s",
                    rnd,
                    phase,
                    node_id,
                    node.partition,
                    node.name,
                    reason,
                )
                self._log.add(phase, node, node_id, reason)
                self._failed.add(node_id)
                continue
            self.wire_seen.setdefault(phase, set()).update(wire_fields(msg.content))
            out.append((node, msg))
        return out

    def _reject(self, phase: str, node: NodeInfo, msg: Message, reason: str) -> None:
        log.warning(
            "round %s, %s: rejected reply of node %d (partition %d, %s): %s",
            msg.metadata.group_id or "?",
            phase,
            node.node_id,
            node.partition,
            node.name,
            reason,
        )
        self._log.add(phase, node, node.node_id, reason)

    def _average_weights(self, members: Sequence[tuple[int, Upload]]) -> dict[str, torch.Tensor]:
        """:func:`protofl.engine.round.combine_weights` with the method's weight plan, in
        partition order, as the simulator."""
        assert self.method is not None
        ups = [u for _, u in members]
        keys = set(ups[0].weights or {})
        ok = [u for u in ups if set(u.weights or {}) == keys]
        fed = self.config.federation
        counts = [u.num_samples for u in ok]
        return combine_weights(
            self.method.weight_plan([u.client for u in ok], counts),
            [u.weights or {} for u in ok],
            counts,
            rule=fed.weight_aggregation,
            trim_ratio=fed.weight_trim_ratio,
            method=self.method.name,
        )

    def _round_metrics(self, rnd: int, wall_s: float) -> RoundMetrics:
        by_partition = {n.partition: n for n in self.nodes.values()}
        client_acc = {by_partition[p].name: a for p, a in sorted(self._client_acc.items())}
        holdout = (
            float(np.mean([a for _, a in sorted(self._holdout.items())])) if self._holdout else None
        )
        return round_metrics(
            round_number=rnd,
            client_acc=client_acc,
            domain_of={n.name: n.domain_name for n in self.nodes.values()},
            losses=self._losses,
            wall_s=wall_s,
            privacy=self.privacy_status(),
            holdout_acc=holdout,
            participants=[by_partition[p].name for p in self._trained],
            rejected=self._log.rejected,
            evaluation=evaluation_plan(self.config.federation, rnd - 1),
        )

    def guarantee(self) -> dict[str, Any]:
        """The run's per-client guarantee (:func:`~protofl.privacy.guarantee.describe_guarantee`)
        with the noise-key mode each client reported; a client that reported none, or a
        derived key, counts as derived (the conservative reading)."""
        from protofl.privacy.guarantee import describe_guarantee

        per_client = {n.name: n.noise_key for n in self.registered_nodes()}
        mode = "secret" if per_client and set(per_client.values()) == {"secret"} else "derived"
        out = describe_guarantee(
            self.config.privacy,
            noise_key=mode,
            rounds=self.config.privacy.releases(self.config.federation.rounds),
            clustered=self.method is not None and self.method.cluster_fn() is not None,
            shares_weights=self.method is not None and self.method.shares_weights,
            uses_prototypes=self.method is None or self.method.uses_prototypes,
            other_uploads=() if self.method is None else self.method.extra_uploads,
            # every evaluated round brings each client's accuracy to this server (of a model
            # that depends on the private data unless nothing trains on it)
            evaluation_reported=self.config.federation.local_epochs > 0
            or (self.method is not None and self.method.uses_training_data),
            # the server accepts the clients' diagnostics records (run.diagnostics=true)
            diagnostics_reported=self.diagnostics,
            # every client trains its adapter/projection between releases (local_epochs > 0)
            trained_feature_map=self.config.federation.local_epochs > 0,
        )
        out["noise_key_per_client"] = per_client
        return out

    def privacy_status(self) -> dict[str, Any]:
        """Epsilon charged per client for what left it (the simulator's ``privacy_status``)."""
        names = {n.partition: n.name for n in self.registered_nodes()}
        return privacy_status(
            {names[p]: self.ledgers[p] for p in sorted(self.ledgers)},
            uses_prototypes=self.method is None or self.method.uses_prototypes,
            partition_overlaps=self._partition_overlap,
        )


def _reweighted(up: Upload, weight: int) -> Upload:
    """``up`` carrying ``weight`` samples: its release's per-class counts scaled by
    ``weight / up.num_samples`` (rounded, at least 1), so its prototypes weigh what it does."""
    release = up.release
    if release is not None and release.counts.numel() and up.num_samples > 0:
        scale = weight / up.num_samples
        counts = torch.clamp(torch.round(release.counts.double() * scale), min=1)
        release = dataclasses.replace(release, counts=counts.to(release.counts.dtype))
    return dataclasses.replace(up, num_samples=weight, release=release)


def release_digest(release: Release) -> str:
    """SHA-256 of what a release says (prototypes, classes, counts, noise stds): equal for a
    re-sent release, different for any new draw."""
    h = hashlib.sha256()
    for t in (release.prototypes, release.classes, release.counts, release.noise_std):
        a = t.detach().cpu().contiguous()
        h.update(f"{a.dtype}{tuple(a.shape)}".encode())
        h.update(a.numpy().tobytes())
    return h.hexdigest()
