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
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from protofl.methods.base import (
    METHOD_REGISTRY,
    ClientState,
    GlobalState,
    Method,
    model_snapshot,
)
from protofl.methods.objectives import (
    Group,
    LocalObjective,
    Proximal,
    Step,
    Term,
    masked_mean,
    proximal,
)
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
    z: torch.Tensor,
    z_glob: torch.Tensor,
    z_prev: torch.Tensor,
    temperature: float,
    ok: torch.Tensor | None = None,
) -> torch.Tensor:
    """MOON Eq. (3): ``-log(e^{cos(z,z_g)/t} / (e^{cos(z,z_g)/t} + e^{cos(z,z_p)/t}))``, the mean
    over the batch: [b, d] -> scalar, or per client over the valid rows ``ok`` [k, b] of
    [k, b, d] -> [k].

    ``z_g`` is the global model's feature (positive), ``z_p`` the previous local model's (negative).
    """
    pos = F.cosine_similarity(z, z_glob, dim=-1) / temperature
    neg = F.cosine_similarity(z, z_prev, dim=-1) / temperature
    per = torch.logaddexp(pos, neg) - pos
    return per.mean(dim=-1) if ok is None else masked_mean(per, ok)


@dataclass(frozen=True)
class ModelContrast(Term):
    """``mu * l_con`` (MOON Eq. 3-4) on the feature f: the reference features of the same
    inputs under the client's snapshots ``prefix_global`` (positive) and ``prefix_prev``
    (negative), computed without gradient in eval mode."""

    mu: float
    temperature: float
    prefix_global: str
    prefix_prev: str

    def prepare(self, global_state: GlobalState, group: Group) -> Any:
        if self.mu == 0:
            return None

        def stacked(prefix: str) -> dict[str, torch.Tensor]:
            states = group.states
            names = [n[len(prefix) :] for n in states[0].tensors if n.startswith(prefix)]
            if len(states) == 1:  # the per-client loop: views, no copies
                return {n: states[0].tensors[prefix + n].unsqueeze(0) for n in names}
            return {n: torch.stack([s.tensors[prefix + n] for s in states]) for n in names}

        return stacked(self.prefix_global), stacked(self.prefix_prev)

    def value(self, step: Step, prepared: Any, rows: slice) -> torch.Tensor:
        if prepared is None:
            return step.zeros()
        if step.model is None or step.z is None:
            raise ValueError("moon: the executor gave the step no model view or inputs")
        glob, prev = ({n: t[rows] for n, t in snap.items()} for snap in prepared)
        z_glob = step.model.features(step.z, glob)
        z_prev = step.model.features(step.z, prev)
        return self.mu * moon_contrastive(step.f, z_glob, z_prev, self.temperature, step.ok)


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
        """Snapshot the global model; the previous local model defaults to it in round one
        (frozen parameters are left out of both: :func:`model_snapshot`)."""
        for name, w in model_snapshot(model).items():
            state.tensors[self.GLOBAL + name] = w
            state.tensors.setdefault(self.PREV + name, w.clone())

    def end_local(
        self, model: ClientModel, state: ClientState, global_state: GlobalState, client: int
    ) -> None:
        """Keep this round's local model (before averaging) as next round's negative."""
        for name, w in model_snapshot(model).items():
            state.tensors[self.PREV + name] = w

    def objective(self) -> LocalObjective:
        """CE + mu * l_con (MOON Eq. 3-4)."""
        p = self.params
        return LocalObjective(
            terms=(ModelContrast(float(p["mu"]), float(p["temperature"]), self.GLOBAL, self.PREV),)
        )
