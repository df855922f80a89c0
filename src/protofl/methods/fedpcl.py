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

Evaluation (``eval: prototype``, the default): nearest *un-noised* local prototype by cosine, the
client's own class means of f recomputed with its model after local training. They never leave the
client, so they cost no privacy. ``end_local`` computes them from ``train_z``/``train_y`` when the
engine passes them; otherwise from the batches the client trained on this round (each epoch visits
every training sample once, so the class means equal the training-set class means). Before any
local prototypes exist it falls back to the nearest global prototype. ``eval: classifier`` uses
the head.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from protofl.methods.base import (
    METHOD_REGISTRY,
    Batch,
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


@METHOD_REGISTRY.register("fedpcl")
class FedPCL(Method):
    """Global + per-client prototype-softmax contrast; evaluation by nearest local prototype.

    Parameters: ``tau`` (0.07), ``ce_weight`` (0.0: no CE on the head), ``eval``
    (``prototype`` | ``classifier``).
    """

    name = "fedpcl"
    defaults: ClassVar[dict[str, Any]] = {"tau": 0.07, "ce_weight": 0.0}
    eval_modes = ("prototype", "classifier")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # training batches seen this round, per client (transient, never saved)
        self._seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

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

    def begin_local(
        self, model: ClientModel, state: ClientState, global_state: GlobalState, client: int
    ) -> None:
        """Start a fresh record of this round's training batches."""
        self._seen[client] = []

    def client_loss(
        self, batch: Batch, global_state: GlobalState, state: ClientState
    ) -> torch.Tensor:
        """Global + mean per-client prototype-softmax CE (+ ``ce_weight`` * head CE)."""
        if self.params["eval"] == "prototype":
            self._seen.setdefault(batch.client, []).append((batch.z.detach(), batch.y.detach()))
        head_ce = F.cross_entropy(batch.logits, batch.y)
        if not has_prototypes(global_state):
            return head_ce  # nothing to contrast against yet: plain CE
        rows = class_index(global_state["classes"], self.num_classes)[batch.y]
        mask = rows >= 0
        if not mask.any():
            return head_ce
        tau = float(self.params["tau"])
        f, t = batch.f[mask], rows[mask]
        loss = prototype_softmax_loss(f, t, global_state["prototypes"], tau)
        tables = global_state.get("client_prototypes")
        if tables is not None and tables.shape[0] > 0:
            loss = loss + prototype_softmax_loss(f, t, tables, tau)
        w = float(self.params["ce_weight"])
        if w > 0:
            loss = loss + w * head_ce
        return loss

    def end_local(
        self,
        model: ClientModel,
        state: ClientState,
        global_state: GlobalState,
        client: int,
        train_z: torch.Tensor | None = None,
        train_y: torch.Tensor | None = None,
    ) -> None:
        """Recompute the client's un-noised local prototypes with its trained model."""
        seen = self._seen.pop(client, [])
        if train_z is None or train_y is None:
            if not seen:
                return
            train_z = torch.cat([z for z, _ in seen])
            train_y = torch.cat([y for _, y in seen])
        self.fit_local_prototypes(model, state, train_z, train_y)

    def fit_local_prototypes(
        self, model: ClientModel, state: ClientState, z: torch.Tensor, y: torch.Tensor
    ) -> None:
        """Store the class means of ``model.features(z)`` as the client's local prototypes."""
        with torch.no_grad(), eval_mode(model):  # evaluation prototypes: no dropout
            f = model.features(z)
        classes = torch.unique(y)
        sums = segment_sum(f, y, self.num_classes)
        counts = torch.bincount(y, minlength=self.num_classes).to(f.dtype)
        state.tensors["local_prototypes"] = sums[classes] / counts[classes, None]
        state.tensors["local_classes"] = classes

    def predict(
        self, model: Any, z: torch.Tensor, global_state: GlobalState, state: ClientState
    ) -> torch.Tensor:
        """Nearest local prototype (cosine; global ones until local exist), or the head."""
        if self.params["eval"] == "classifier":
            return super().predict(model, z, global_state, state)
        if "local_prototypes" in state.tensors:
            protos, classes = state.tensors["local_prototypes"], state.tensors["local_classes"]
        elif has_prototypes(global_state):
            protos, classes = global_state["prototypes"], global_state["classes"]
        else:
            return super().predict(model, z, global_state, state)
        return nearest_prototype(model.features(z), protos, classes)
