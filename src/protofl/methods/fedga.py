"""FedGA (Zhang et al., CVPR 2023): FedAvg with aggregation weights adjusted by generalisation gaps.

Federated Domain Generalization with Generalization Adjustment, as described in the paper
(Sec. 4, the generalisation-adjustment aggregation):

* **Aggregation.** ``w^{r+1} = sum_i a_i^r w_i^r`` over this round's members (the weights
  renormalised over them), where ``w_i^r`` is client i's model after local training.
* **Generalisation gap.** Once client i holds the aggregated model, it measures
  ``G_i = L_i(w^{r+1}) - L_i(w_i^r)``: the loss of the global model on its data minus that of
  its own last local model (cross-entropy over its training data, in eval mode).
* **Weight update.** With ``mu = mean_i G_i`` over the clients that reported a gap,
  ``a_i <- a_i + d_r (G_i - mu) / max_j |G_j - mu|`` (no change when every gap is equal), then
  every ``a_i`` is clipped to ``[0, 1]`` and the weights renormalised to sum 1: a client on
  whose data the global model generalises worse than average gains weight.
* **Step size.** ``d_r = d (1 - r / R)`` (``decay: linear``), decaying to 0 over the run's ``R``
  rounds, with ``r`` the 0-based round whose aggregation the gaps measure; ``d = step_size``
  = 0.05, the value the FedDAP paper uses for FedGA.  ``decay: none`` keeps ``d`` fixed.
* **Initial weights.** ``initial: uniform`` (``a_i = 1/M``) or ``counts`` (``n_i / n``, FedAvg's);
  a client first seen after the start enters with the mean weight of the others.

Timing in protofl's round: each client computes its gap at the start of the next round (from
the broadcast model and a snapshot of its local model taken in ``end_local``) and sends it with
its upload (``upload_extras``); ``aggregate`` updates the weights, and the engine's weight
averaging at the end of that round uses them (:meth:`FedGA.weight_plan`), i.e. the update after
round r's aggregation sets round r+1's weights, as in the paper.

Privacy: the weights and the gap (a function of two losses on the private training data) leave
every client without noise; FedGA releases no prototypes, so a run with it has no DP guarantee.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch.func import functional_call

from protofl.methods.base import (
    METHOD_REGISTRY,
    ClientState,
    GlobalState,
    Method,
    Upload,
    WeightPlan,
    model_snapshot,
)
from protofl.methods.fpl import is_number
from protofl.models.client import ClientModel

log = logging.getLogger(__name__)

LOCAL = "fedga.local."  # client state: the local model after training, before averaging
CLIENTS = "fedga.clients"  # server state: client ids
WEIGHTS = "fedga.weights"  # server state: their aggregation weights a_i (float64, sum 1)
GAP = "gap"  # the upload field


def adjust_weights(
    weights: torch.Tensor, gaps: torch.Tensor, step: float, members: torch.Tensor | None = None
) -> torch.Tensor:
    """One generalisation adjustment: ``a_i += step (G_i - mu) / max_j |G_j - mu|`` for the
    clients ``members`` (indices into ``weights``; all when None) whose ``gaps`` are given,
    then clip to [0, 1] and renormalise to sum 1 (float64)."""
    a = weights.double().clone()
    idx = torch.arange(len(a)) if members is None else members
    g = gaps.double()
    centred = g - g.mean()
    scale = float(centred.abs().max()) if len(g) else 0.0
    if scale > 0:
        a[idx] += step * centred / scale
    a = a.clamp(0.0, 1.0)
    total = float(a.sum())
    return a / total if total > 0 else torch.full_like(a, 1.0 / len(a))


def step_size(base: float, round_index: int, rounds: int | None, decay: str) -> float:
    """``d_r = d (1 - r/R)`` for ``decay: linear`` (``r``: the 0-based round whose aggregation
    the gaps measure), ``d`` for ``none``."""
    if decay == "none":
        return base
    if rounds is None:
        raise ValueError(
            "fedga.decay='linear' needs the run's number of rounds (the engine passes it; "
            "create_method(..., rounds=R))"
        )
    return base * max(0.0, 1.0 - round_index / rounds)


@METHOD_REGISTRY.register("fedga")
class FedGA(Method):
    """FedGA: FedAvg whose aggregation weights follow the clients' generalisation gaps (module
    docstring)."""

    name = "fedga"
    defaults: ClassVar[dict[str, Any]] = {
        "step_size": 0.05,
        "decay": "linear",
        "initial": "uniform",
    }
    uses_prototypes = False
    shares_weights = True
    extra_uploads = (
        "generalisation gap: the loss of the global model minus the loss of the client's last "
        "local model, on its training data",
    )

    def validate(self) -> None:
        """``step_size`` in [0, 1]; ``decay`` linear | none; ``initial`` uniform | counts."""
        d = self.params["step_size"]
        if not is_number(d) or not 0.0 <= float(d) <= 1.0:
            raise ValueError(f"fedga.step_size={d!r} must be a number in [0, 1]")
        if self.params["decay"] not in ("linear", "none"):
            raise ValueError(f"fedga.decay={self.params['decay']!r} must be linear or none")
        if self.params["initial"] not in ("uniform", "counts"):
            raise ValueError(f"fedga.initial={self.params['initial']!r} must be uniform or counts")

    # ----- client -------------------------------------------------------------------------------
    def end_local(
        self, model: ClientModel, state: ClientState, global_state: GlobalState, client: int
    ) -> None:
        """Snapshot the local model (before averaging): the reference of next round's gap
        (frozen parameters are left out: :func:`model_snapshot`)."""
        for name, w in model_snapshot(model).items():
            state.tensors[LOCAL + name] = w

    def upload_extras(
        self, model: ClientModel, z: torch.Tensor, y: torch.Tensor, state: ClientState, client: int
    ) -> dict[str, torch.Tensor]:
        """``G_i = L_i(global) - L_i(local)`` on the training data; nothing before the first
        local training."""
        local = {k[len(LOCAL) :]: v for k, v in state.tensors.items() if k.startswith(LOCAL)}
        if not local or len(y) == 0:
            return {}
        _, logits_global = model(z)
        _, logits_local = functional_call(model, local, (z,))
        gap = F.cross_entropy(logits_global, y) - F.cross_entropy(logits_local, y)
        return {GAP: gap.detach().double().cpu().reshape(())}

    # ----- server -------------------------------------------------------------------------------
    def aggregate(self, uploads: Sequence[Upload], round_index: int) -> GlobalState:
        """Register new clients, then adjust the weights by the gaps reported this round."""
        self._register(uploads)
        ids = self.server_state[CLIENTS].tolist()
        members, gaps = [], []
        for up in uploads:
            if GAP not in up.extras:
                continue
            g = float(up.extras[GAP])
            if not math.isfinite(g):
                log.warning("fedga: client %d sent a non-finite gap; ignored", up.client)
                continue
            members.append(ids.index(int(up.client)))
            gaps.append(g)
        if gaps:
            # the gaps measure the aggregation of round round_index - 1
            d = step_size(
                float(self.params["step_size"]),
                round_index - 1,
                self.rounds,
                str(self.params["decay"]),
            )
            self.server_state[WEIGHTS] = adjust_weights(
                self.server_state[WEIGHTS],
                torch.tensor(gaps, dtype=torch.float64),
                d,
                torch.tensor(members, dtype=torch.long),
            )
        return {}

    def _register(self, uploads: Sequence[Upload]) -> None:
        ids = self.server_state.get(CLIENTS, torch.zeros(0, dtype=torch.long)).tolist()
        a = self.server_state.get(WEIGHTS, torch.zeros(0, dtype=torch.float64)).tolist()
        new = [up for up in uploads if int(up.client) not in ids]
        if not new:
            return
        if not ids:  # the first clients: 1/M, or their share of the samples
            total = sum(up.num_samples for up in new)
            uniform = self.params["initial"] == "uniform" or total == 0
            a = [1.0 / len(new) if uniform else up.num_samples / total for up in new]
        else:  # late joiners enter with the others' mean weight
            a += [sum(a) / len(a)] * len(new)
        ids += [int(up.client) for up in new]
        w = torch.tensor(a, dtype=torch.float64)
        self.server_state[CLIENTS] = torch.tensor(ids, dtype=torch.long)
        self.server_state[WEIGHTS] = w / w.sum()

    def weights_of(self, clients: Sequence[int]) -> list[float]:
        """The current aggregation weights ``a_i`` of ``clients`` (a client the server has not
        seen: the mean weight)."""
        if CLIENTS not in self.server_state:
            return [1.0] * len(clients)
        ids = self.server_state[CLIENTS].tolist()
        a = self.server_state[WEIGHTS].tolist()
        mean = sum(a) / len(a)
        return [a[ids.index(int(c))] if int(c) in ids else mean for c in clients]

    def weight_plan(self, clients: Sequence[int], counts: Sequence[float]) -> WeightPlan:
        """The members' adjusted weights ``a_i`` (the engine renormalises them over the
        members)."""
        return WeightPlan(coefficients=tuple(self.weights_of(clients)))
