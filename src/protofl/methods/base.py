"""The method contract: a client objective plus a server aggregator, with defaults and a name.

A method never runs an engine loop. The engine (``protofl.engine``) calls, per round:

1. ``upload_features`` on every client (no grad) and passes them through the privacy mechanism
   (with ``cluster_fn`` when the method releases several prototypes per class);
2. ``aggregate`` on the server with every client's :class:`Upload`, giving the broadcast
   :data:`GlobalState`;
3. ``begin_local``, ``client_loss`` for every local batch, then ``end_local``; a method whose
   objective is cross-entropy plus declared terms says so in ``objective`` (see
   :mod:`protofl.methods.objectives`) and the default ``client_loss`` runs it; the batched
   executor runs the same declaration for many clients at once;
4. if ``shares_weights``, the engine combines the trained weights as ``weight_plan`` says
   (default: FedAvg's sample-weighted mean of every tensor, sent to all);
5. ``predict`` on each client's test set (the default runs the declared ``prediction`` rule;
   a method with its own rule on the features declares ``features`` and writes
   ``predict_from``, which every executor calls with the features and logits it computed).

A method whose clients keep something computed from their own trained model and data (FedPCL's
un-noised local prototypes) does it in ``after_training``, which every executor calls with the
client's training data once its local training is over.

A method that needs more from a client than its release and weights (a loss value, input
statistics, a classifier head) says so in ``extra_uploads`` and computes it in
``upload_extras``; it travels in :attr:`Upload.extras` to ``aggregate`` (the server), outside
the privacy mechanism, and the run's privacy statement lists it as not covered.

A subclass that overrides ``client_loss`` (or ``predict``) without also declaring
``objective`` (``prediction``) has its own arithmetic: the inherited declaration is dropped, so
an executor never runs a parent's objective in its place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch.func import functional_call

from protofl.methods.objectives import (
    Group,
    LocalObjective,
    ModelView,
    Step,
    nearest_prototype,
    prototype_table,
)
from protofl.models.client import ClientModel
from protofl.privacy.base import ClusterFn, Release
from protofl.registry import Registry, nearest

GlobalState = dict[str, torch.Tensor]
"""What the server broadcasts: named tensors (global prototypes, their classes, ...)."""


@dataclass
class Upload:
    """One client's message to the server in one round."""

    client: int
    domain: int
    release: Release | None
    num_samples: int
    weights: dict[str, torch.Tensor] | None = None
    # what ``Method.upload_extras`` computed (outside the mechanism, not covered by the DP claim)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightPlan:
    """How the server combines one round's trained weights (``Method.weight_plan``).

    ``coefficients``: one per member, in the members' order, for the ``mean`` rule (None: the
    public sample counts, i.e. FedAvg); the engine normalises them to sum 1.  ``local``:
    state-dict key prefixes that are not averaged: each client keeps its own (COPA's heads).
    """

    coefficients: tuple[float, ...] | None = None
    local: tuple[str, ...] = ()

    def keeps_local(self, key: str) -> bool:
        """Whether the state-dict entry ``key`` stays each client's own."""
        return any(key.startswith(prefix) for prefix in self.local)


@dataclass
class Batch:
    """One local training batch as the method's objective sees it.

    ``f`` is the feature the objective should use (soft-clipped when DCR is on), ``f_raw`` the
    feature before DCR, ``logits`` the head's output on ``f``.
    """

    z: torch.Tensor
    y: torch.Tensor
    f: torch.Tensor
    f_raw: torch.Tensor
    logits: torch.Tensor
    model: ClientModel
    client: int
    domain: int


@dataclass
class ClientState:
    """Per-client state a method keeps between rounds (tensors only, so it serialises).

    With ``run.client_state: disk`` the engine replaces each entry, after the round, by an
    equal row of a memory-mapped file (``protofl.engine.store._Store.adopt_state``): a
    method reads its state from the dict and stores new tensors in it, and keeps no other
    reference to them."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class Method:
    """Base class; subclasses set ``name``, ``defaults`` and override the hooks they need."""

    name: ClassVar[str] = "base"
    defaults: ClassVar[dict[str, Any]] = {}
    uses_prototypes: bool = True
    shares_weights: bool = False
    needs_domain: bool = False
    eval_modes: ClassVar[tuple[str, ...]] = ("classifier",)
    extra_uploads: ClassVar[tuple[str, ...]] = ()
    """What ``upload_extras`` sends beside the release and the weights, in words (one entry
    per item, ``"name: what it is"``): the privacy statement lists each as not covered."""
    device: torch.device = torch.device("cpu")
    """Where the method's own server-side computation runs (FedTGP's prototypes, MPFT's head);
    the engine sets it from ``run.device``."""

    def __init__(
        self,
        params: Mapping[str, Any] | None = None,
        *,
        num_classes: int,
        num_domains: int,
        proto_dim: int,
        seed: int = 0,
        rounds: int | None = None,
    ) -> None:
        params = dict(params or {})
        allowed = {**self.defaults, "eval": self.eval_modes[0]}
        for key in params:
            if key not in allowed:
                raise ValueError(
                    f"method {self.name!r} has no parameter {key!r}"
                    f"{nearest(key, list(allowed))}; its parameters: {', '.join(sorted(allowed))}"
                )
        self.params: dict[str, Any] = {**allowed, **params}
        if self.params["eval"] not in self.eval_modes:
            raise ValueError(
                f"method {self.name!r}: eval={self.params['eval']!r} is not one of "
                f"{', '.join(self.eval_modes)}"
            )
        self.num_classes = num_classes
        self.num_domains = num_domains
        self.proto_dim = proto_dim
        # the experiment seed: every server-side random choice derives from it
        self.seed = int(seed)
        # the run's number of rounds R where the engine knows it (FedGA's step-size decay)
        self.rounds = None if rounds is None else int(rounds)
        self.server_state: dict[str, torch.Tensor] = {}
        self.validate()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # an override of the executed hook without a matching declaration voids the parent's
        if "client_loss" in cls.__dict__ and "objective" not in cls.__dict__:
            cls.objective = Method._undeclared_objective  # type: ignore[method-assign]
        if "predict" in cls.__dict__ and "prediction" not in cls.__dict__:
            cls.prediction = Method._undeclared_prediction  # type: ignore[method-assign]

    def validate(self) -> None:
        """Check hyperparameter ranges; raise ValueError naming the parameter."""

    # ----- declarations the executors read ----------------------------------------------------
    def objective(self) -> LocalObjective | None:
        """The local objective as cross-entropy plus declared terms, or None when only
        ``client_loss`` knows it (then it runs client by client).  Default: cross-entropy."""
        return LocalObjective()

    def prediction(self) -> str | None:
        """The evaluation rule (one of :data:`~protofl.methods.objectives.PREDICTION_RULES`),
        or None when only ``predict`` knows it.  Default: the classifier head."""
        return "classifier"

    def predict_from(
        self,
        f: torch.Tensor,
        logits: torch.Tensor,
        global_state: GlobalState,
        state: ClientState,
    ) -> torch.Tensor:
        """The ``features`` rule: labels from one client's features ``f`` [T, d] and head
        logits [T, C] (default: the head's argmax)."""
        return logits.argmax(dim=-1)

    def _undeclared_objective(self) -> LocalObjective | None:
        return None

    def _undeclared_prediction(self) -> str | None:
        return None

    @property
    def batchable(self) -> bool:
        """Whether the batched executor can run this method: its objective and evaluation
        rule are declared."""
        return self.objective() is not None and self.prediction() is not None

    @property
    def default_upload_features(self) -> bool:
        """Whether the released features are the model's ``features`` (no override)."""
        return type(self).upload_features is Method.upload_features

    # ----- client side ----------------------------------------------------------------------
    def cluster_fn(self) -> ClusterFn | None:
        """Per-class clustering of clipped features for multi-prototype releases (None: means)."""
        return None

    def upload_features(self, model: ClientModel, z: torch.Tensor) -> torch.Tensor:
        """Features whose prototypes are released (default: the adapter feature f)."""
        return model.features(z)

    def upload_extras(
        self, model: ClientModel, z: torch.Tensor, y: torch.Tensor, state: ClientState, client: int
    ) -> dict[str, torch.Tensor]:
        """What this client sends beside its release at the start of a round (eval mode, no
        grad; ``z, y``: its training data), declared in ``extra_uploads``.  It reaches the
        server unprotected.  Default: nothing."""
        return {}

    def begin_local(
        self, model: ClientModel, state: ClientState, global_state: GlobalState, client: int
    ) -> None:
        """Called once per round before local training (snapshot models, cache targets)."""

    def end_local(
        self, model: ClientModel, state: ClientState, global_state: GlobalState, client: int
    ) -> None:
        """Called once per round after local training, before any weight averaging."""

    def after_training(self, state: ClientState, f: torch.Tensor, y: torch.Tensor) -> None:
        """Called after ``end_local`` when ``uses_training_data`` is set, with the features
        ``f`` of the client's training inputs under its trained model (eval mode, no gradient;
        executors compute them as the upload features) and their labels ``y`` (FedPCL's local
        prototypes).  Default: nothing."""

    uses_training_data: bool = False
    """Whether the executors call :meth:`after_training` (it costs a pass over the data)."""

    def client_loss(
        self, batch: Batch, global_state: GlobalState, state: ClientState
    ) -> torch.Tensor:
        """The local objective on one batch: the declared :meth:`objective` run for one client
        (default: cross-entropy)."""
        objective = self.objective()
        if objective is None:
            return F.cross_entropy(batch.logits, batch.y)
        params = (
            {n: p.unsqueeze(0) for n, p in batch.model.named_parameters() if p.requires_grad}
            if objective.param_terms
            else {}
        )
        step = Step(
            f=batch.f.unsqueeze(0),
            logits=batch.logits.unsqueeze(0),
            y=batch.y.unsqueeze(0),
            ok=torch.ones(1, len(batch.y), dtype=torch.bool, device=batch.y.device),
            params=params,
            z=batch.z.unsqueeze(0),
            f_raw=batch.f_raw.unsqueeze(0),
            model=ClientView(batch.model),
        )
        group = Group([state], [batch.domain], self.num_classes, [batch.client])
        prepared = objective.prepare(global_state, group)
        return objective.loss(step, prepared, slice(0, 1))[0]

    # ----- server side ----------------------------------------------------------------------
    def aggregate(self, uploads: Sequence[Upload], round_index: int) -> GlobalState:
        """Uploads -> global state (default: nothing shared)."""
        return {}

    def secure_sum_groups(self) -> str:
        """How the server aggregates from secure sums and public counts alone
        (``privacy.mechanism: ddg``): ``class`` (one sum over the federation) or ``domain``
        (one per domain).  Default: refused, with the reason (a ValueError naming the method):
        its server needs each client's prototypes."""
        raise ValueError(
            f"privacy.mechanism=ddg gives the server only sums of the clients' class sums; "
            f"method {self.name!r} needs each client's prototypes (secure aggregation works "
            "for fedproto, and feddap with fusion: mean)"
        )

    def weight_plan(self, clients: Sequence[int], counts: Sequence[float]) -> WeightPlan:
        """How the engine combines the trained weights of ``clients`` (this round's members,
        with their public sample ``counts``) for a weight-sharing method.  Default: FedAvg of
        every tensor with the counts (:class:`WeightPlan` ``()``)."""
        return WeightPlan()

    # ----- evaluation -----------------------------------------------------------------------
    def predict(
        self,
        model: ClientModel,
        z: torch.Tensor,
        global_state: GlobalState,
        state: ClientState,
    ) -> torch.Tensor:
        """Predicted labels for cached representations ``z``: the declared
        :meth:`prediction` rule (classifier head, the nearest global prototype, or
        :meth:`predict_from`) on the inputs as the objective's ``inputs`` changes them."""
        objective = self.objective()
        if objective is not None and objective.inputs is not None:
            changed = objective.inputs.evaluate(z, global_state, [state])
            if changed is not None:
                z = changed[0]
        rule = self.prediction()
        if rule == "prototype" and global_state:
            return nearest_prototype(model.features(z), global_state)
        f, logits = model(z)
        if rule == "features":
            return self.predict_from(f, logits, global_state, state)
        return logits.argmax(dim=1)

    # ----- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Server-side method state (e.g. a trained generator) for checkpoints."""
        return dict(self.server_state)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore server-side state."""
        self.server_state = dict(state)


METHOD_REGISTRY: Registry[type[Method]] = Registry("method")


class ClientView(ModelView):
    """:class:`ModelView` of one client's model (``k = 1``), for the per-client loop."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def features(self, z: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        # eval mode: reference features see no dropout or augmentation
        with torch.no_grad(), eval_mode(self.model):
            f, _ = functional_call(self.model, {n: p[0] for n, p in params.items()}, (z[0],))
        return f.unsqueeze(0)

    def project(self, z: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model.proj(z[0]).unsqueeze(0)  # type: ignore[no-any-return]

    def select(self, at: torch.Tensor) -> ModelView:
        return self


def create_method(
    name: str,
    params: Mapping[str, Any] | None,
    *,
    num_classes: int,
    num_domains: int,
    proto_dim: int,
    seed: int = 0,
    rounds: int | None = None,
) -> Method:
    """Instantiate a registered method with validated parameters; ``seed`` is the experiment
    seed (server-side randomness of FedTGP, MPFT, ... derives from it), ``rounds`` the run's
    number of rounds where known."""
    cls = METHOD_REGISTRY.get(name)
    return cls(
        params,
        num_classes=num_classes,
        num_domains=num_domains,
        proto_dim=proto_dim,
        seed=seed,
        rounds=rounds,
    )


# ----- shared helpers used by several methods ---------------------------------------------
def model_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of what can change in ``model``: its buffers and trainable parameters, by
    state-dict name.  A frozen parameter (``requires_grad`` off) is left out: training never
    moves it and averaging equal values returns them, so it is the same in every snapshot, and
    a model call with a partial state (``functional_call``, :meth:`ModelView.features`) takes
    it from the model.  With a frozen 1280 -> 512 projection this keeps 0.17 M of the 0.83 M
    floats a client model holds."""
    frozen = frozen_parameter_names(model)
    return {n: w.detach().clone() for n, w in model.state_dict().items() if n not in frozen}


def frozen_parameter_names(model: torch.nn.Module) -> set[str]:
    """State-dict names of ``model``'s frozen parameters (``requires_grad`` off)."""
    return {n for n, p in model.named_parameters() if not p.requires_grad}


@contextlib.contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    """Run a block with ``model`` in eval mode (no dropout, no augmentation, BatchNorm running
    statistics), restoring its mode after: reference features and prototypes are computed so."""
    if not isinstance(model, torch.nn.Module):  # a duck-typed model has no modes to switch
        yield
        return
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def class_weighted_mean(uploads: Sequence[Upload], num_classes: int, dim: int) -> GlobalState:
    """Per-class mean of uploaded prototypes weighted by their counts, over clients with the class.

    Returns ``prototypes`` [K, d] and ``classes`` [K] for the K classes present anywhere.
    This is a prototype bank merge: sums and counts add, so it is order-free.
    """
    sums = torch.zeros(num_classes, dim)
    counts = torch.zeros(num_classes)
    for up in uploads:
        if up.release is None:
            continue
        r = up.release
        w = r.counts.to(sums.dtype)
        sums.index_add_(0, r.classes, r.prototypes.to(sums.dtype) * w[:, None])
        counts.index_add_(0, r.classes, w)
    present = counts > 0
    classes = torch.nonzero(present).flatten()
    return {"prototypes": sums[classes] / counts[classes, None], "classes": classes}


def class_uniform_mean(uploads: Sequence[Upload], num_classes: int, dim: int) -> GlobalState:
    """Per-class unweighted mean over the clients that uploaded the class (FedProto original)."""
    sums = torch.zeros(num_classes, dim)
    counts = torch.zeros(num_classes)
    for up in uploads:
        if up.release is None:
            continue
        r = up.release
        # several prototypes of one class from one client (clusters) count as their mean
        per_class = torch.zeros(num_classes, dim).index_add_(0, r.classes, r.prototypes)
        n = torch.zeros(num_classes).index_add_(0, r.classes, torch.ones(len(r.classes)))
        has = n > 0
        sums[has] += per_class[has] / n[has, None]
        counts[has] += 1
    present = counts > 0
    classes = torch.nonzero(present).flatten()
    return {"prototypes": sums[classes] / counts[classes, None], "classes": classes}


def class_robust_mean(
    uploads: Sequence[Upload], num_classes: int, dim: int, rule: str, trim_ratio: float = 0.2
) -> GlobalState:
    """Per-class coordinate-wise ``median`` or ``trimmed_mean`` over the clients with the class.

    Each client contributes one vector per class (the count-weighted mean of its prototypes of
    that class), so a minority of poisoning clients cannot move a coordinate arbitrarily far.
    ``trimmed_mean`` drops ``floor(trim_ratio * n)`` values at each end of every coordinate.
    """
    per_class: list[list[torch.Tensor]] = [[] for _ in range(num_classes)]
    for up in uploads:
        if up.release is None or up.release.num_prototypes == 0:
            continue
        r = up.release
        w = r.counts.to(r.prototypes.dtype)
        sums = torch.zeros(num_classes, dim, dtype=r.prototypes.dtype)
        sums.index_add_(0, r.classes, r.prototypes * w[:, None])
        n = torch.zeros(num_classes, dtype=r.prototypes.dtype).index_add_(0, r.classes, w)
        for c in torch.nonzero(n > 0).flatten().tolist():
            per_class[c].append(sums[c] / n[c])
    classes = [c for c in range(num_classes) if per_class[c]]
    protos = []
    for c in classes:
        stack = torch.stack(per_class[c]).float()
        if rule == "median":
            protos.append(
                stack.median(dim=0).values if len(stack) % 2 else stack.quantile(0.5, dim=0)
            )
        elif rule == "trimmed_mean":
            k = int(trim_ratio * len(stack))
            ordered = stack.sort(dim=0).values
            protos.append(ordered[k : len(stack) - k].mean(dim=0))
        else:
            raise ValueError(
                f"unknown robust aggregation rule {rule!r}; use median or trimmed_mean"
            )
    if not classes:
        return {"prototypes": torch.zeros(0, dim), "classes": torch.zeros(0, dtype=torch.long)}
    return {"prototypes": torch.stack(protos), "classes": torch.tensor(classes)}


def lookup_targets(
    global_state: GlobalState, y: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample global prototype of its class, and a mask of samples whose class has one."""
    found = prototype_table(global_state, num_classes)
    if found is None:
        return torch.zeros(len(y), 0), torch.zeros(len(y), dtype=torch.bool)
    table, has = found
    return table[y], has[y]
