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

PREDICTION_RULES = ("classifier", "prototype")
"""Evaluation rules every executor implements: the classifier head's argmax, or the nearest
global prototype (L2) of the feature ``f``."""


@dataclass
class Step:
    """One local step of ``k`` clients (see the module doc for shapes)."""

    f: torch.Tensor
    logits: torch.Tensor
    y: torch.Tensor
    ok: torch.Tensor
    params: Mapping[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Group:
    """The clients a term is prepared for, in executor order: their method states
    (:class:`~protofl.methods.base.ClientState`), their domain labels (-1: none reported) and
    the number of classes."""

    states: Sequence[Any]
    domains: Sequence[int]
    num_classes: int


# ----- kernels ---------------------------------------------------------------------------------
def masked_mean(values: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Per-client mean of ``values`` [k, b] over the valid rows ``ok`` [k, b] -> [k]."""
    okf = ok.to(values.dtype)
    return (values * okf).sum(dim=1) / okf.sum(dim=1)


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
            return torch.zeros(step.y.shape[0], dtype=step.f.dtype)
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


@dataclass(frozen=True)
class LocalObjective:
    """Cross-entropy plus ``terms``: the whole local objective of a method that declares it."""

    terms: tuple[Term, ...] = ()

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

    def loss(self, step: Step, prepared: Sequence[Any], rows: slice) -> torch.Tensor:
        """Cross-entropy + every term, per client [k] (the per-client loop's whole loss)."""
        out = cross_entropy(step.logits, step.y, step.ok)
        for term, prep in zip(self.terms, prepared):
            out = out + term.value(step, prep, rows)
        return out

    def feature_loss(self, step: Step, prepared: Sequence[Any], rows: slice) -> torch.Tensor:
        """Cross-entropy + the feature terms, per client [k]."""
        out = cross_entropy(step.logits, step.y, step.ok)
        for term, prep in zip(self.terms, prepared):
            if not term.on_params:
                out = out + term.value(step, prep, rows)
        return out

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
