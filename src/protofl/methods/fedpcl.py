"""FedPCL: Federated Prototype-wise Contrastive Learning (Tan, Long, Liu et al., "Federated Learning
from Pre-Trained Models: A Contrastive Learning Approach", NeurIPS 2022), in the prototype-softmax
form that the VPDR reference code implements.

Server: the global prototype ``G_c`` is the unweighted mean of the clients' uploaded prototypes of
class c over the clients that have it (FedPCL's global prototype). The server also broadcasts every
client's own (noisy) local prototypes ``P_j``, with a class that client j lacks filled by ``G_c``
(FedPCL shares the local prototype sets so that each client contrasts against all of them).

Client objective (no cross-entropy on the classifier head; FedPCL's global + local
prototype-wise contrastive losses), with ``cos`` on L2-normalised vectors and tau = 0.07:

    L = CE( cos(f, G) / tau, y ) + (1/M) sum_{j=1..M} CE( cos(f, P_j) / tau, y )

where ``CE(logits, y)`` is the softmax cross-entropy over the classes that have a global
prototype and M counts every client that uploaded, the training client included.
``ce_weight > 0`` adds ``ce_weight * CE(h(f), y)`` on the head (off by default, as in the paper;
with it off, the head learns only through DCR's distillation term when DCR is on).

A batch none of whose samples has a global prototype (and every batch before the first global
prototypes arrive) is trained with the head's cross-entropy alone.  With ``ce_weight`` 0 the head
takes no optimiser step on a batch whose loss does not reach it (as torch skips a parameter
without a gradient), in every executor.

Evaluation (``eval: prototype``, the default): nearest *un-noised* local prototype by cosine, the
client's own class means of f over its whole training set, recomputed with its model after local
training (``after_training``). They never leave the client, so they cost no privacy. Before any
local prototypes exist it falls back to the nearest global prototype, then to the head.
``eval: classifier`` uses the head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from protofl.methods.base import (
    METHOD_REGISTRY,
    ClientState,
    GlobalState,
    Method,
    Upload,
    class_uniform_mean,
    eval_mode,
)
from protofl.methods.finch import segment_sum
from protofl.methods.fpl import (
    class_index,
    has_prototypes,
    is_number,
    nearest_prototype,
    report_missing,
)
from protofl.methods.objectives import (
    Group,
    LocalObjective,
    Step,
    Term,
    cosine,
    cross_entropy,
    hit_mean,
)
from protofl.models.client import ClientModel


def client_tables(
    uploads: Sequence[Upload], global_state: GlobalState, num_classes: int
) -> torch.Tensor:
    """Every uploading client's per-class prototype over the global classes ([M, K, d]).

    A client's several prototypes of one class (clusters) count as their count-weighted mean; a
    class the client lacks is filled with the global prototype.
    """
    classes, protos = global_state["classes"], global_state["prototypes"]
    rows = class_index(classes, num_classes)
    tables = []
    for up in uploads:
        if up.release is None:
            continue
        r = up.release
        w = r.counts.to(protos.dtype)
        idx = rows[r.classes]
        sums = segment_sum(r.prototypes.to(protos.dtype) * w[:, None], idx, len(classes))
        n = torch.zeros(len(classes), dtype=protos.dtype).index_put_((idx,), w, accumulate=True)
        table = protos.clone()
        has = n > 0
        table[has] = sums[has] / n[has, None]
        tables.append(table)
    if not tables:
        return protos.new_zeros(0, *protos.shape)
    return torch.stack(tables)


def prototype_softmax_loss(
    f: torch.Tensor, target: torch.Tensor, prototypes: torch.Tensor, tau: float
) -> torch.Tensor:
    """Mean ``CE(cos(f, P)/tau, target)`` for one ([K, d]) or several ([M, K, d]) prototype sets.

    With M sets the result is ``(1/M) sum_j CE(cos(f, P_j)/tau, target)``.
    """
    fn = F.normalize(f, dim=-1, eps=1e-8)
    pn = F.normalize(prototypes, dim=-1, eps=1e-8)
    if pn.dim() == 2:
        return F.cross_entropy(fn @ pn.T / tau, target)
    logits = torch.einsum("bd,mkd->mbk", fn, pn) / tau
    m, b, k = logits.shape
    return F.cross_entropy(logits.reshape(m * b, k), target.repeat(m))


def softmax_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-row ``CE(logits, target)``: [..., b, K] and [..., b] -> [..., b]."""
    return torch.logsumexp(logits, dim=-1) - logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True)
class PrototypeContrast(Term):
    """FedPCL's global + mean per-client prototype-softmax cross-entropy over the samples whose
    class has a global prototype; a client with none in the step (or before any prototype) is
    trained with the head's cross-entropy, weighted ``1 - ce_weight`` here so that with the
    objective's ``ce_weight`` it is plain CE (module docstring)."""

    tau: float
    ce_weight: float = 0.0

    def prepare(self, global_state: GlobalState, group: Group) -> Any:
        if not has_prototypes(global_state):
            return None
        rows = class_index(global_state["classes"], group.num_classes)
        tables = global_state.get("client_prototypes")
        if tables is not None and tables.shape[0] == 0:
            tables = None
        return global_state["prototypes"], rows, tables

    def _hits(self, step: Step, prepared: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if prepared is None:
            none = torch.zeros_like(step.ok)
            return none, none.any(dim=1)
        hit = (prepared[1][step.y] >= 0) & step.ok
        return hit, hit.any(dim=1)

    def value(self, step: Step, prepared: Any, rows: slice) -> torch.Tensor:
        hit, any_hit = self._hits(step, prepared)
        fallback = 1.0 - self.ce_weight
        if prepared is not None:
            protos, index, tables = prepared
            target = index[step.y].clamp_min(0)
            per = softmax_ce(cosine(step.f, protos) / self.tau, target)
            if tables is not None:  # [k, b, M*K] -> the mean over the M client tables
                m, k_cls, d = tables.shape
                logits = cosine(step.f, tables.reshape(m * k_cls, d)) / self.tau
                logits = logits.unflatten(-1, (m, k_cls)).transpose(-2, -3)  # [k, M, b, K]
                per = per + softmax_ce(logits, target.unsqueeze(1).expand_as(logits[..., 0])).mean(
                    dim=1
                )
            proto = hit_mean(per, hit)
            if fallback == 0 or bool(any_hit.all()):
                return torch.where(any_hit, proto, torch.zeros_like(proto))
        else:
            proto = step.zeros()
        if fallback == 0:
            return proto
        head = fallback * cross_entropy(step.logits, step.y, step.ok)
        return torch.where(any_hit, proto, head)

    def uses_logits(self, step: Step, prepared: Any, rows: slice) -> torch.Tensor | None:
        if self.ce_weight == 1.0:
            return None
        return ~self._hits(step, prepared)[1]


@METHOD_REGISTRY.register("fedpcl")
class FedPCL(Method):
    """Global + per-client prototype-softmax contrast; evaluation by nearest local prototype.

    Parameters: ``tau`` (0.07), ``ce_weight`` (0.0: no CE on the head), ``eval``
    (``prototype`` | ``classifier``).
    """

    name = "fedpcl"
    defaults: ClassVar[dict[str, Any]] = {"tau": 0.07, "ce_weight": 0.0}
    eval_modes = ("prototype", "classifier")

    def validate(self) -> None:
        """tau > 0, ce_weight >= 0."""
        tau = self.params["tau"]
        if not is_number(tau) or not float(tau) > 0:
            raise ValueError(f"fedpcl.tau={tau!r} must be a number > 0")
        w = self.params["ce_weight"]
        if not is_number(w) or not float(w) >= 0:
            raise ValueError(f"fedpcl.ce_weight={w!r} must be a number >= 0")

    def aggregate(self, uploads: Sequence[Upload], round_index: int) -> GlobalState:
        """Global prototypes (unweighted mean over clients) plus every client's filled-in table."""
        state = class_uniform_mean(uploads, self.num_classes, self.proto_dim)
        report_missing(self, state["classes"])
        if len(state["classes"]) == 0:
            return {}
        state["client_prototypes"] = client_tables(uploads, state, self.num_classes)
        return state

    def objective(self) -> LocalObjective:
        """``ce_weight`` * head CE + the global and mean per-client prototype-softmax CE."""
        w = float(self.params["ce_weight"])
        return LocalObjective(terms=(PrototypeContrast(float(self.params["tau"]), w),), ce_weight=w)

    @property
    def uses_training_data(self) -> bool:  # type: ignore[override]
        """The local prototypes of ``eval: prototype`` are fitted after training."""
        return self.params["eval"] == "prototype"

    def after_training(self, state: ClientState, f: torch.Tensor, y: torch.Tensor) -> None:
        """Store the class means of the trained model's features as the local prototypes."""
        classes = torch.unique(y)
        sums = segment_sum(f, y, self.num_classes)
        counts = torch.bincount(y, minlength=self.num_classes).to(f.dtype)
        state.tensors["local_prototypes"] = sums[classes] / counts[classes, None]
        state.tensors["local_classes"] = classes

    def fit_local_prototypes(
        self, model: ClientModel, state: ClientState, z: torch.Tensor, y: torch.Tensor
    ) -> None:
        """:meth:`after_training` from the inputs ``z`` (eval mode, no gradient)."""
        with torch.no_grad(), eval_mode(model):  # evaluation prototypes: no dropout
            self.after_training(state, model.features(z), y)

    def prediction(self) -> str:
        """The head (``eval: classifier``), or :meth:`predict_from`'s cosine rule."""
        return "classifier" if self.params["eval"] == "classifier" else "features"

    def predict_from(
        self, f: torch.Tensor, logits: torch.Tensor, global_state: GlobalState, state: ClientState
    ) -> torch.Tensor:
        """Nearest local prototype (cosine; the global ones until local ones exist; the head
        before either)."""
        if "local_prototypes" in state.tensors:
            protos, classes = state.tensors["local_prototypes"], state.tensors["local_classes"]
        elif has_prototypes(global_state):
            protos, classes = global_state["prototypes"], global_state["classes"]
        else:
            return logits.argmax(dim=-1)
        return nearest_prototype(f, protos.to(f.dtype), classes)
