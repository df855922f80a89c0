"""Weight-averaging baselines without prototypes: FedAvg, FedProx and MOON.

All three set ``shares_weights``: after local training the engine replaces every client's
trainable weights by their sample-weighted average (McMahan et al., 2017). They release no
prototypes, so the configured privacy mechanism is never called; the averaged weights are
**outside** the prototype local-DP guarantee (a privacy run with these methods protects nothing).

Snapshots of the global and previous local weights are kept in :class:`ClientState` tensors
(``prox.global.<param>``, ``moon.global.<param>``, ``moon.prev.<param>``) so that they serialise.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    eval_mode,
)
from protofl.methods.objectives import LocalObjective, Proximal, proximal
from protofl.models.client import ClientModel


@METHOD_REGISTRY.register("fedavg")
class FedAvg(Method):
    """FedAvg (McMahan et al., AISTATS 2017): local cross-entropy, then weight averaging."""

    name = "fedavg"
    uses_prototypes = False
    shares_weights = True


def proximal_term(
    params: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """``sum_k ||w_k - w_k^global||^2`` over the named parameters (FedProx Eq. 2 without mu/2);
    the one-client form of :func:`protofl.methods.objectives.proximal`."""
    return proximal(
        {n: w.unsqueeze(0) for n, w in params.items()}, {n: anchor[n].unsqueeze(0) for n in params}
    )[0]


@METHOD_REGISTRY.register("fedprox")
class FedProx(Method):
    """FedProx (Li et al., MLSys 2020): CE + ``mu/2 * ||w - w_global||^2`` over trainable weights.

    ``w_global`` is the broadcast (averaged) model, snapshot when local training starts.
    """

    name = "fedprox"
    defaults: ClassVar[dict[str, Any]] = {"mu": 0.01}
    uses_prototypes = False
    shares_weights = True
    PREFIX: ClassVar[str] = "prox.global."

    def validate(self) -> None:
        """``mu`` >= 0."""
        if not float(self.params["mu"]) >= 0:
            raise ValueError(f"fedprox.mu={self.params['mu']!r} must be >= 0")

    def begin_local(
        self, model: ClientModel, state: ClientState, global_state: GlobalState, client: int
    ) -> None:
        """Snapshot the global (just averaged) trainable weights."""
        for k in [k for k in state.tensors if k.startswith(self.PREFIX)]:
            del state.tensors[k]
        for name, p in model.named_parameters():
            if p.requires_grad:
                state.tensors[self.PREFIX + name] = p.detach().clone()

    def objective(self) -> LocalObjective:
        """CE + mu/2 * ||w - w_global||^2 (FedProx Eq. 2)."""
        return LocalObjective(terms=(Proximal(float(self.params["mu"]), self.PREFIX),))


def moon_contrastive(
    z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, temperature: float
) -> torch.Tensor:
    """MOON Eq. (3), batch mean: ``-log(e^{cos(z,z_g)/t} / (e^{cos(z,z_g)/t} + e^{cos(z,z_p)/t}))``.

    ``z_g`` is the global model's feature (positive), ``z_p`` the previous local model's (negative).
    """
    pos = F.cosine_similarity(z, z_glob, dim=1) / temperature
    neg = F.cosine_similarity(z, z_prev, dim=1) / temperature
    logits = torch.stack([pos, neg], dim=1)
    target = torch.zeros(len(z), dtype=torch.long)
    return F.cross_entropy(logits, target)


@METHOD_REGISTRY.register("moon")
class Moon(Method):
    """MOON (Li et al., CVPR 2021): CE + ``mu * l_con`` (model-contrastive loss on the feature f).

    Positive: the global model's feature of the same input; negative: the previous round's
    local model's feature (before averaging). In the first round the previous local model is
    the initial global model, as in the original code. Cosine similarity is scale-free, so the
    DCR soft clip of ``f`` does not change the term.
    """

    name = "moon"
    defaults: ClassVar[dict[str, Any]] = {"mu": 1.0, "temperature": 0.5}
    uses_prototypes = False
    shares_weights = True
    GLOBAL: ClassVar[str] = "moon.global."
    PREV: ClassVar[str] = "moon.prev."

    def validate(self) -> None:
        """``mu`` >= 0, ``temperature`` > 0."""
        if not float(self.params["mu"]) >= 0:
            raise ValueError(f"moon.mu={self.params['mu']!r} must be >= 0")
        if not float(self.params["temperature"]) > 0:
            raise ValueError(f"moon.temperature={self.params['temperature']!r} must be > 0")

    def begin_local(
        self, model: ClientModel, state: ClientState, global_state: GlobalState, client: int
    ) -> None:
        """Snapshot the global model; the previous local model defaults to it in round one."""
        for name, w in model.state_dict().items():
            state.tensors[self.GLOBAL + name] = w.detach().clone()
            state.tensors.setdefault(self.PREV + name, w.detach().clone())

    def end_local(
        self, model: ClientModel, state: ClientState, global_state: GlobalState, client: int
    ) -> None:
        """Keep this round's local model (before averaging) as next round's negative."""
        for name, w in model.state_dict().items():
            state.tensors[self.PREV + name] = w.detach().clone()

    @staticmethod
    def _snapshot(state: ClientState, prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix) :]: v for k, v in state.tensors.items() if k.startswith(prefix)}

    def client_loss(
        self, batch: Batch, global_state: GlobalState, state: ClientState
    ) -> torch.Tensor:
        """CE + mu * l_con (MOON Eq. 3-4)."""
        loss = F.cross_entropy(batch.logits, batch.y)
        mu = float(self.params["mu"])
        if mu == 0:
            return loss
        # the reference features of the same input, in eval mode (no dropout or augmentation:
        # at identical weights z_glob equals the student's feature)
        with torch.no_grad(), eval_mode(batch.model):
            z_glob, _ = functional_call(batch.model, self._snapshot(state, self.GLOBAL), (batch.z,))
            z_prev, _ = functional_call(batch.model, self._snapshot(state, self.PREV), (batch.z,))
        l_con = moon_contrastive(batch.f, z_glob, z_prev, float(self.params["temperature"]))
        return loss + mu * l_con
