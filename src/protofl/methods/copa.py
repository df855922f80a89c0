"""COPA (Wu & Gong, ICCV 2021): a shared feature extractor and an ensemble of per-client heads.

Collaborative Optimization and Aggregation, for decentralized domain generalisation, as
described in the paper (Sec. 3) and carried onto protofl's frozen backbone:

* **Model.** The trainable feature extractor (adapter + projection, the domain-invariant part)
  and a classifier head per client (the domain-specific part; the paper has one node per domain).
* **Aggregation.** The feature extractor is averaged across clients by FedAvg
  (``w_E = sum_k n_k w_E^k / sum_k n_k``); each head stays its client's own
  (:meth:`COPA.weight_plan` keeps ``head.*`` local) and is uploaded (``upload_extras``) so the
  server can assemble the ensemble ``{h_1, ..., h_M}`` and broadcast it.
* **Collaboration of frozen classifiers.** Locally, the features are trained through the
  client's own head and through every other client's head, frozen:
  ``L_k = CE(h_k(f(x)), y) + collab_weight * (1/|J|) sum_{j in J} CE(h_j(f(x)), y)``, with
  ``J`` the other clients whose heads the server broadcast; gradients reach ``f`` and ``h_k``
  only.
* **Prediction.** The output ensemble: ``p(y|x) = (1/M) sum_j softmax(h_j(f(x)))`` over the
  client's current head and the broadcast heads of the others (``eval: ensemble``); ``own``
  predicts with the client's own head only.

Deviations forced by the frozen backbone (docs/methods.md): the paper's hybrid batch-instance
normalisation lives inside the CNN feature extractor, which is frozen here (the trainable part has
no normalisation layer), so it is left out; the prediction-agreement mechanism is COPA's
domain-adaptation part (unlabelled target data), not used for generalisation.

Privacy: the weights and the heads leave every client without noise; COPA releases no
prototypes, so a run with it has no DP guarantee (the statement says so, naming both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch.func import functional_call

from protofl.methods.base import (
    METHOD_REGISTRY,
    Batch,
    ClientState,
    GlobalState,
    Method,
    Upload,
    WeightPlan,
)
from protofl.methods.fpl import is_number
from protofl.models.client import ClientModel

HEAD = "head."
"""State-dict prefix of the classifier head (every protofl client model names it ``head``)."""
BANK = "copa.head."  # server state: copa.head.<client>.<head key>
ENSEMBLE = "copa.ensemble."  # broadcast: copa.ensemble.<head key> -> [M, ...] stacked heads
CLIENTS = "copa.clients"  # broadcast: the client id of each stacked head
OWN = "copa.client"  # client state: this client's id (predict is not told it)


@METHOD_REGISTRY.register("copa")
class COPA(Method):
    """COPA: FedAvg of the feature extractor, per-client heads, collaboration of frozen heads,
    prediction by the ensemble of every client's head (module docstring)."""

    name = "copa"
    defaults: ClassVar[dict[str, Any]] = {"collab_weight": 1.0}
    eval_modes = ("ensemble", "own")
    uses_prototypes = False
    shares_weights = True
    extra_uploads = (
        "classifier head: the client's trained head weights, kept out of the average and "
        "broadcast to every client for the ensemble",
    )

    def validate(self) -> None:
        """``collab_weight`` >= 0."""
        w = self.params["collab_weight"]
        if not is_number(w) or not float(w) >= 0:
            raise ValueError(f"copa.collab_weight={w!r} must be a number >= 0")

    # ----- client -------------------------------------------------------------------------------
    def upload_extras(
        self, model: ClientModel, z: torch.Tensor, y: torch.Tensor, state: ClientState, client: int
    ) -> dict[str, torch.Tensor]:
        """The client's current head (trained last round; heads are not averaged)."""
        state.tensors[OWN] = torch.tensor(int(client))
        return {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith(HEAD)}

    def weight_plan(self, clients: Sequence[int], counts: Sequence[float]) -> WeightPlan:
        """FedAvg of everything but the heads, which stay each client's own."""
        return WeightPlan(local=(HEAD,))

    def client_loss(
        self, batch: Batch, global_state: GlobalState, state: ClientState
    ) -> torch.Tensor:
        """``CE(h_k(f), y) + collab_weight * mean_j CE(h_j(f), y)`` over the other clients'
        frozen heads (module docstring)."""
        loss = F.cross_entropy(batch.logits, batch.y)
        weight = float(self.params["collab_weight"])
        others = other_heads(global_state, batch.client, batch.f.device)
        if weight == 0 or not others:
            return loss
        collab = torch.stack(
            [
                F.cross_entropy(functional_call(batch.model.head, h, (batch.f,)), batch.y)
                for h in others
            ]
        ).mean()
        return loss + weight * collab

    def predict(
        self,
        model: ClientModel,
        z: torch.Tensor,
        global_state: GlobalState,
        state: ClientState,
    ) -> torch.Tensor:
        """``eval: ensemble``: argmax of the mean softmax over the client's own head and the
        others' broadcast heads; ``own``: the client's head alone."""
        f, logits = model(z)
        if self.params["eval"] == "own":
            return logits.argmax(dim=1)
        own = int(state.tensors[OWN]) if OWN in state.tensors else -1
        others = other_heads(global_state, own, f.device)
        return ensemble_probs(model.head, f, logits, others).argmax(dim=1)

    # ----- server -------------------------------------------------------------------------------
    def aggregate(self, uploads: Sequence[Upload], round_index: int) -> GlobalState:
        """Keep every client's latest head; broadcast them stacked (client order)."""
        for up in uploads:
            for key, value in up.extras.items():
                if key.startswith(HEAD):
                    self.server_state[f"{BANK}{int(up.client)}.{key}"] = value.detach().clone()
        return self.ensemble()

    def ensemble(self) -> GlobalState:
        """The stacked heads of every client the server has heard from, and their ids."""
        by_client: dict[int, dict[str, torch.Tensor]] = {}
        for name, value in self.server_state.items():
            if name.startswith(BANK):
                client, key = name[len(BANK) :].split(".", 1)
                by_client.setdefault(int(client), {})[key] = value
        if not by_client:
            return {}
        clients = sorted(by_client)
        keys = sorted(by_client[clients[0]])
        out: GlobalState = {CLIENTS: torch.tensor(clients)}
        for key in keys:
            out[ENSEMBLE + key] = torch.stack([by_client[c][key] for c in clients])
        return out


def other_heads(
    global_state: GlobalState, client: int, device: torch.device | None = None
) -> list[dict[str, torch.Tensor]]:
    """The broadcast heads of every client but ``client``, as parameter dicts of the head
    module (``weight``, ``bias``, ...), on ``device``."""
    if CLIENTS not in global_state:
        return []
    keys = [k for k in global_state if k.startswith(ENSEMBLE)]
    out = []
    for i, c in enumerate(global_state[CLIENTS].tolist()):
        if int(c) == int(client):
            continue
        out.append({k[len(ENSEMBLE) + len(HEAD) :]: global_state[k][i].to(device) for k in keys})
    return out


def ensemble_probs(
    head: torch.nn.Module,
    f: torch.Tensor,
    own_logits: torch.Tensor,
    others: Sequence[dict[str, torch.Tensor]],
) -> torch.Tensor:
    """COPA's output ensemble: the mean over heads of ``softmax(h_j(f))`` (own head first)."""
    probs = F.softmax(own_logits, dim=1)
    for h in others:
        probs = probs + F.softmax(functional_call(head, h, (f,)), dim=1)
    return probs / (1 + len(others))
