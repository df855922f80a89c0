"""Local objectives declared once, run by every executor.

A method that can say its local objective as cross-entropy plus a sum of *terms* declares a
:class:`LocalObjective` (``Method.objective``).  Every term is a kernel over tensors with a
leading client dimension ``k``: the per-client loop runs it with ``k = 1`` (``Method.client_loss``
does this by default), the batched executor with a whole group of clients stacked.  So the
arithmetic of an objective lives here once; an executor only supplies tensors.

Shapes in a :class:`Step`: features ``f`` [k, b, d] (after DCR's soft clip when DCR is on),
``logits`` [k, b, C], labels ``y`` [k, b], ``ok`` [k, b] (False on padding rows of a client with
fewer samples in the step) and the clients' trainable parameters ``params[name]`` [k, ...].
Every kernel returns one loss per client, [k]: the mean over that client's valid rows.

A term that needs more than ``f`` and the logits reads the step's inputs ``z`` (as the model saw
them), the raw feature ``f_raw`` (before DCR's soft clip) and ``model``, a :class:`ModelView` of
the step's clients (their features under other parameters: MOON's reference models; the
projection alone: MPFT's teacher input).  An objective may also change the inputs before the
model sees them (:class:`InputTransform`: FedRDN's normalisation) and weight the cross-entropy
(``ce_weight``; FedPCL trains without it).

Two kinds of terms:

* feature terms (:class:`PrototypePull`): functions of ``f``/``logits``, differentiated by
  autograd in both executors;
* parameter terms (:class:`Proximal`): functions of the parameters alone; the per-client loop
  differentiates them by autograd, the batched executor adds their closed-form gradient
  (:meth:`Term.param_grad`) to the gradient buffers it owns.

Adding a batched method is then: declare ``objective`` (and, if its evaluation is one of the
:data:`PREDICTION_RULES`, ``prediction``), nothing in the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

GlobalState = dict[str, torch.Tensor]

PREDICTION_RULES = ("classifier", "prototype", "features")
"""Evaluation rules every executor implements: the classifier head's argmax, the nearest
global prototype (L2) of the feature ``f``, or ``features``: the method's own
``Method.predict_from`` on ``f`` and the head's logits (cosine rules, ensembles of heads)."""


class ModelView(ABC):
    """What a term may compute with the models of a step's ``k`` clients besides the step's own
    forward pass: no gradient flows through it."""

    @abstractmethod
    def features(self, z: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The feature ``f`` of inputs ``z`` [k, b, d_in] under the clients' parameters with the
        named ones replaced by ``params`` [k, ...] (state-dict names): [k, b, d]."""

    @abstractmethod
    def project(self, z: torch.Tensor) -> torch.Tensor:
        """The projection alone (no adapter) of ``z`` [k, b, d_in]: [k, b, d]."""

    @abstractmethod
    def select(self, at: torch.Tensor) -> ModelView:
        """The view of the clients at positions ``at``."""


@dataclass
class Step:
    """One local step of ``k`` clients (see the module doc for shapes)."""

    f: torch.Tensor
    logits: torch.Tensor
    y: torch.Tensor
    ok: torch.Tensor
    params: Mapping[str, torch.Tensor] = field(default_factory=dict)
    z: torch.Tensor | None = None
    f_raw: torch.Tensor | None = None
    model: ModelView | None = None

    def zeros(self) -> torch.Tensor:
        """A zero loss for every client of the step, [k] (a term with nothing to add)."""
        return torch.zeros(self.y.shape[0], dtype=self.f.dtype, device=self.f.device)

    def select(self, at: torch.Tensor) -> Step:
        """The step of the clients at positions ``at`` (a run's segment of a fused group)."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, at.to(t.device))

        return Step(
            f=self.f.index_select(0, at),
            logits=self.logits.index_select(0, at),
            y=self.y.index_select(0, at),
            ok=self.ok.index_select(0, at),
            params={n: p.index_select(0, at) for n, p in self.params.items()},
            z=pick(self.z),
            f_raw=pick(self.f_raw),
            model=None if self.model is None else self.model.select(at),
        )


@dataclass(frozen=True)
class Group:
    """The clients a term is prepared for, in executor order: their method states
    (:class:`~protofl.methods.base.ClientState`), their domain labels (-1: none reported), the
    number of classes and the clients' ids (empty where the caller does not know them)."""

    states: Sequence[Any]
    domains: Sequence[int]
    num_classes: int
    clients: Sequence[int] = ()


# ----- kernels ---------------------------------------------------------------------------------
def masked_mean(values: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Per-client mean of ``values`` [k, b] over the valid rows ``ok`` [k, b] -> [k]."""
    okf = ok.to(values.dtype)
    return (values * okf).sum(dim=1) / okf.sum(dim=1)


def hit_mean(values: torch.Tensor, hit: torch.Tensor) -> torch.Tensor:
    """Per-client mean of ``values`` [k, b] over the rows ``hit`` [k, b], 0 for a client with
    none; rows outside ``hit`` may hold anything finite."""
    hf = hit.to(values.dtype)
    return (values * hf).sum(dim=1) / hf.sum(dim=1).clamp_min(1)


def cosine(f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``cos(f, p)`` of every feature with every prototype: [k, b, d] x [Q, d] (or [k, Q, d])
    -> [k, b, Q]; a zero vector has cosine 0 to everything."""
    pn = F.normalize(p.to(f.dtype), dim=-1, eps=1e-8)
    fn = F.normalize(f, dim=-1, eps=1e-8)
    return fn @ (pn.T if pn.dim() == 2 else pn.transpose(-1, -2))


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Per-client mean cross-entropy [k] of ``logits`` [k, b, C] against ``y`` [k, b]."""
    k, b = y.shape
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none"
    ).view(k, b)
    return masked_mean(ce, ok)


def prototype_table(
    global_state: GlobalState, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The per-class global prototype table [C, d] and which classes have one [C] (None when
    the server sent no prototypes)."""
    if not global_state or "classes" not in global_state or len(global_state["classes"]) == 0:
        return None
    protos, classes = global_state["prototypes"], global_state["classes"]
    table = torch.zeros(num_classes, protos.shape[1], dtype=protos.dtype)
    has = torch.zeros(num_classes, dtype=torch.bool)
    table[classes] = protos
    has[classes] = True
    return table, has


def prototype_mse(
    f: torch.Tensor,
    y: torch.Tensor,
    ok: torch.Tensor,
    table: torch.Tensor,
    has: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per client, the MSE between ``f`` and the global prototype of each sample's class, over
    the valid samples whose class has one (FedProto Eq. 4 with the mean over dimensions, as
    ``F.mse_loss``); and whether the client had any such sample ([k] bool)."""
    hit = has[y] & ok
    n_hit = hit.sum(dim=1)
    sq = ((f - table[y].to(f.dtype)) ** 2).sum(dim=-1) * hit.to(f.dtype)
    mse = sq.sum(dim=1) / (n_hit * f.shape[-1]).clamp_min(1).to(f.dtype)
    return mse, n_hit > 0


def proximal(
    params: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """Per client ``sum_n ||w_n - a_n||^2`` over the named parameters [k, ...] -> [k]."""
    total: torch.Tensor | None = None
    for name, w in params.items():
        sq = (w - anchor[name]).pow(2).flatten(1).sum(dim=1)
        total = sq if total is None else total + sq
    if total is None:
        raise ValueError("proximal: no parameters")
    return total


def nearest_prototype(f: torch.Tensor, global_state: GlobalState) -> torch.Tensor:
    """Class of the nearest global prototype (L2) of every feature: [..., n, d] -> [..., n]."""
    protos = global_state["prototypes"].to(f.dtype)
    if f.ndim == 3:
        protos = protos.unsqueeze(0).expand(f.shape[0], -1, -1)
    return global_state["classes"][torch.cdist(f, protos).argmin(dim=-1)]


# ----- terms -----------------------------------------------------------------------------------
class Term(ABC):
    """One additive term of a local objective.

    ``prepare`` runs once per round and group of clients (the server's broadcast and the
    :class:`Group`: the clients' method states and domains in, whatever the term needs out);
    ``value`` gives the term per client [k] for rows ``rows`` of that group.  Parameter terms
    (``on_params``) also give ``param_grad``, the closed-form gradient the batched executor
    adds.
    """

    on_params: bool = False

    def prepare(self, global_state: GlobalState, group: Group) -> Any:
        """Per-round inputs of the term for this group of clients (default: none)."""
        return None

    def uses_logits(self, step: Step, prepared: Any, rows: slice) -> torch.Tensor | None:
        """Which clients' term value depends on the head's logits ([k] bool); None: none
        (the default).  Read only when the objective has no cross-entropy (``ce_weight`` 0):
        a client whose loss never reaches the head takes no optimiser step on it, as a
        parameter without a gradient takes none in torch."""
        return None

    @abstractmethod
    def value(self, step: Step, prepared: Any, rows: slice) -> torch.Tensor:
        """The term per client, [k]."""

    def param_grad(
        self, params: Mapping[str, torch.Tensor], prepared: Any, rows: slice
    ) -> dict[str, torch.Tensor]:
        """Closed-form gradient of a parameter term w.r.t. ``params`` (parameter terms only)."""
        raise TypeError(f"{type(self).__name__} is not a parameter term")


@dataclass(frozen=True)
class PrototypePull(Term):
    """``weight * MSE(f, G_y)`` over samples whose class has a global prototype (FedProto
    Eq. 4; FedTGP Eq. 8); zero for a client with no such sample in the step."""

    weight: float

    def prepare(self, global_state: GlobalState, group: Group) -> Any:
        return prototype_table(global_state, group.num_classes) if self.weight != 0 else None

    def value(self, step: Step, prepared: Any, rows: slice) -> torch.Tensor:
        if prepared is None:
            return step.zeros()
        mse, any_hit = prototype_mse(step.f, step.y, step.ok, *prepared)
        return torch.where(any_hit, self.weight * mse, torch.zeros_like(mse))


@dataclass(frozen=True)
class Proximal(Term):
    """``mu/2 * ||w - w_anchor||^2`` over the trainable parameters (FedProx Eq. 2); the anchor
    is the snapshot the method keeps in each client's state under ``prefix + name``."""

    mu: float
    prefix: str
    on_params = True

    def prepare(self, global_state: GlobalState, group: Group) -> Any:
        if self.mu == 0:
            return None
        states = group.states
        names = [n[len(self.prefix) :] for n in states[0].tensors if n.startswith(self.prefix)]
        return {n: torch.stack([s.tensors[self.prefix + n] for s in states]) for n in names}

    def value(self, step: Step, prepared: Any, rows: slice) -> torch.Tensor:
        k = next(iter(step.params.values())).shape[0] if step.params else step.y.shape[0]
        if prepared is None:
            return torch.zeros(k)
        anchor = {n: a[rows] for n, a in prepared.items()}
        params = {n: step.params[n] for n in anchor}
        return 0.5 * self.mu * proximal(params, anchor)

    def param_grad(
        self, params: Mapping[str, torch.Tensor], prepared: Any, rows: slice
    ) -> dict[str, torch.Tensor]:
        if prepared is None:
            return {}
        return {n: self.mu * (params[n] - a[rows]) for n, a in prepared.items()}


class InputTransform(ABC):
    """A change of a client's inputs before its model sees them (FedRDN's normalisation with
    other clients' statistics), declared by the objective; every executor applies it."""

    def prepare(self, global_state: GlobalState, group: Group) -> Any:
        """Per-round inputs for this group of clients, before their first local step."""
        return None

    @abstractmethod
    def train(
        self, z: torch.Tensor, ok: torch.Tensor, prepared: Any, rows: slice, step: int
    ) -> torch.Tensor:
        """The inputs of local step ``step`` (0-based, this round) of rows ``rows``:
        ``z`` [k, b, d_in], ``ok`` [k, b] (valid rows first) -> [k, b, d_in]."""

    def finish(self, prepared: Any, steps: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """After local training, with each client's number of steps (group order)."""

    def evaluate(
        self, z: torch.Tensor, global_state: GlobalState, states: Sequence[Any]
    ) -> torch.Tensor | None:
        """The test inputs ``z`` [T, d_in] of each client, [len(states), T, d_in]; None:
        unchanged for every client (the default)."""
        return None


@dataclass(frozen=True)
class LocalObjective:
    """``ce_weight`` x cross-entropy plus ``terms``, on inputs changed by ``inputs`` (if
    any): the whole local objective of a method that declares it."""

    terms: tuple[Term, ...] = ()
    ce_weight: float = 1.0
    inputs: InputTransform | None = None

    @property
    def feature_terms(self) -> tuple[Term, ...]:
        """Terms of ``f``/``logits`` (autograd in every executor)."""
        return tuple(t for t in self.terms if not t.on_params)

    @property
    def param_terms(self) -> tuple[Term, ...]:
        """Terms of the parameters alone (closed-form gradient in the batched executor)."""
        return tuple(t for t in self.terms if t.on_params)

    def prepare(self, global_state: GlobalState, group: Group) -> list[Any]:
        """Every term's per-round inputs, in term order."""
        return [t.prepare(global_state, group) for t in self.terms]

    def _cross_entropy(self, step: Step) -> torch.Tensor:
        if self.ce_weight == 0:  # the head's logits stay out of the graph
            return step.zeros()
        ce = cross_entropy(step.logits, step.y, step.ok)
        return ce if self.ce_weight == 1 else self.ce_weight * ce

    def loss(self, step: Step, prepared: Sequence[Any], rows: slice) -> torch.Tensor:
        """Cross-entropy + every term, per client [k] (the per-client loop's whole loss)."""
        out = self._cross_entropy(step)
        for term, prep in zip(self.terms, prepared):
            out = out + term.value(step, prep, rows)
        return out

    def feature_loss(self, step: Step, prepared: Sequence[Any], rows: slice) -> torch.Tensor:
        """Cross-entropy + the feature terms, per client [k]."""
        out = self._cross_entropy(step)
        for term, prep in zip(self.terms, prepared):
            if not term.on_params:
                out = out + term.value(step, prep, rows)
        return out

    def uses_logits(self, step: Step, prepared: Sequence[Any], rows: slice) -> torch.Tensor | None:
        """Which clients' loss reaches the head ([k] bool); None: every client's (it has a
        cross-entropy, or a parameter term)."""
        if self.ce_weight != 0 or any(
            t.on_params and p is not None for t, p in zip(self.terms, prepared)
        ):
            return None
        live = torch.zeros(step.y.shape[0], dtype=torch.bool, device=step.y.device)
        for term, prep in zip(self.terms, prepared):
            used = term.uses_logits(step, prep, rows)
            if used is not None:
                live = live | used
        return live

    def param_loss(
        self, params: Mapping[str, torch.Tensor], prepared: Sequence[Any], rows: slice, k: int
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """The parameter terms' value per client [k] (None without such terms) and their
        summed closed-form gradients."""
        value: torch.Tensor | None = None
        grads: dict[str, torch.Tensor] = {}
        dummy = torch.zeros(k, 0, dtype=torch.long)
        step = Step(f=torch.zeros(k, 0, 0), logits=torch.zeros(k, 0, 0), y=dummy, ok=dummy.bool())
        step.params = params
        for term, prep in zip(self.terms, prepared):
            if not term.on_params or prep is None:
                continue
            v = term.value(step, prep, rows)
            value = v if value is None else value + v
            for n, g in term.param_grad(params, prep, rows).items():
                grads[n] = g if n not in grads else grads[n] + g
        return value, grads
