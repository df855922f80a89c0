"""FedRDN (Yan et al., CVPR 2025; arXiv 2306.09363): random domain normalisation, on FedAvg.

"A Simple Data Augmentation for Feature Distribution Skewed Federated Learning", as described
in the paper and carried onto protofl's cached frozen features:

* **Statistics.** Client k computes the statistics of its training inputs,
  ``mu^k = mean_i x_i^k`` and ``sigma^k = std_i x_i^k`` (the paper: per image channel), and
  sends them to the server, which shares the set ``{(mu^j, sigma^j)}_{j=1..K}`` with every
  client (``upload_extras`` -> ``aggregate`` -> the broadcast; never another client's data).
* **Training (the augmentation).** Every training input is normalised with a pair drawn
  uniformly at random from that set: ``x_hat = (x - mu^j) / sigma^j``, a fresh ``j`` per
  sample and step (``include_self: true``: the draw is over all clients, the client's own
  included, as in the paper; ``false``: over the other clients only).
* **Inference.** A client normalises its test inputs with its own statistics (``eval_stats:
  local``); ``federation`` uses the mean of the shared means and standard deviations.
* The rest is FedAvg: local cross-entropy, sample-weighted weight averaging.

Where the normalisation applies (docs/methods.md, "FedRDN"): protofl caches the frozen
backbone's output, so here ``x`` is the cached feature ``z`` and the statistics are its
per-dimension mean and standard deviation (``statistics: per_dimension``), or one mean and
standard deviation over all its coordinates (``scalar``, as few numbers as the paper's per-channel
pair allows a client to reveal).  The paper normalises images before the CNN; with a frozen,
cached backbone that would recompute the backbone on every augmented image (or cache one copy of
every client's features per client's statistics), so it is not offered.

Every draw comes from a generator seeded by (experiment seed, client, local step counter), the
counter kept in the client state, so runs and resumed runs repeat.  The normalisation is the
objective's input transform (:class:`RandomDomainNormalisation`), which every executor applies
before the model's forward pass, so with DCR on the soft clip and the teacher see the normalised
inputs too.

Privacy: the weights and the statistics leave every client without noise; FedRDN releases no
prototypes, so a run with it has no DP guarantee (the statement names both).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from protofl.methods.base import (
    METHOD_REGISTRY,
    ClientState,
    GlobalState,
    Method,
    Upload,
)
from protofl.methods.fpl import is_number
from protofl.methods.objectives import Group, InputTransform, LocalObjective
from protofl.models.client import ClientModel
from protofl.seeding import method_generator

MEAN, STD = "fedrdn.mean", "fedrdn.std"  # [K, D] broadcast bank; [D] in a client's own state
CLIENTS = "fedrdn.clients"  # [K] the client id of each bank row
STEP = "fedrdn.step"  # client state: local steps taken (the draw counter)
STREAM = 0xFED4D  # this method's key under the experiment seed


def input_statistics(
    z: torch.Tensor, statistics: str, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mu, sigma)`` of the rows of ``z``: per dimension, or one pair over all coordinates
    broadcast to every dimension (``scalar``); ``sigma`` floored at ``eps``."""
    z = z.double()
    if statistics == "scalar":
        mu = z.mean().expand(z.shape[1])
        sd = z.std(unbiased=False).expand(z.shape[1])
    else:
        mu, sd = z.mean(dim=0), z.std(dim=0, unbiased=False)
    return mu.float().clone(), sd.clamp_min(eps).float().clone()


def normalise(z: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``(z - mu) / sigma`` (FedRDN's normalisation; row-wise when ``mu`` has one row per z)."""
    return (z - mu.to(z.device, z.dtype)) / sigma.to(z.device, z.dtype)


def draw(
    global_state: GlobalState, seed: int, include_self: bool, client: int, n: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample ``(mu^j, sigma^j)`` rows, ``j`` uniform over the shared set (without the
    client's own row when ``include_self`` is false and another exists), from the generator of
    (``seed``, client, step)."""
    ids = global_state[CLIENTS].tolist()
    rows = [i for i, c in enumerate(ids) if include_self or int(c) != client]
    rows = rows or list(range(len(ids)))
    gen = method_generator(seed, STREAM, client, step)
    pick = torch.tensor(rows)[torch.randint(len(rows), (n,), generator=gen)]
    return global_state[MEAN][pick], global_state[STD][pick]


@dataclass
class _Draws:
    """A group's per-round inputs of :class:`RandomDomainNormalisation`."""

    global_state: GlobalState
    states: list[ClientState]
    clients: list[int]
    first_step: list[int]


@dataclass(frozen=True)
class RandomDomainNormalisation(InputTransform):
    """FedRDN's augmentation: each training input normalised with a randomly drawn client's
    statistics (a fresh draw per sample and step); evaluation with the client's own statistics
    (``local``) or the mean of the shared ones (``federation``)."""

    # the run's seed keys the draws; runs that differ only in it share one objective (fused)
    seed: int = field(compare=False)
    include_self: bool = True
    eval_stats: str = "local"

    def prepare(self, global_state: GlobalState, group: Group) -> Any:
        if len(group.clients) != len(group.states):
            raise ValueError("fedrdn: the executor did not say which clients it trains")
        states = list(group.states)
        first = [int(s.tensors.get(STEP, torch.tensor(0))) for s in states]
        return _Draws(global_state, states, [int(c) for c in group.clients], first)

    def train(
        self, z: torch.Tensor, ok: torch.Tensor, prepared: Any, rows: slice, step: int
    ) -> torch.Tensor:
        gs = prepared.global_state
        if CLIENTS not in gs:  # nothing shared yet: the plain inputs
            return z
        k, b, d = z.shape
        mu = torch.zeros(k, b, d, dtype=z.dtype, device=z.device)
        sd = torch.ones(k, b, d, dtype=z.dtype, device=z.device)
        counts = ok.sum(dim=1).tolist()  # valid rows come first
        start = rows.start or 0
        for i in range(k):
            client = prepared.clients[start + i]
            m, s = draw(
                gs,
                self.seed,
                self.include_self,
                client,
                int(counts[i]),
                prepared.first_step[start + i] + step,
            )
            mu[i, : len(m)] = m.to(z.device, z.dtype)
            sd[i, : len(s)] = s.to(z.device, z.dtype)
        return (z - mu) / sd

    def finish(self, prepared: Any, steps: Sequence[int]) -> None:
        for state, first, n in zip(prepared.states, prepared.first_step, steps, strict=True):
            state.tensors[STEP] = torch.tensor(first + int(n))

    def evaluate(
        self, z: torch.Tensor, global_state: GlobalState, states: Sequence[Any]
    ) -> torch.Tensor | None:
        if self.eval_stats == "federation" and CLIENTS in global_state:
            mu, sd = global_state[MEAN].mean(dim=0), global_state[STD].mean(dim=0)
            return normalise(z, mu, sd).unsqueeze(0).expand(len(states), -1, -1)
        if not any(MEAN in s.tensors for s in states):
            return None
        # a client without statistics yet (before its first upload) keeps the plain input
        return torch.stack(
            [
                normalise(z, s.tensors[MEAN], s.tensors[STD]) if MEAN in s.tensors else z
                for s in states
            ]
        )


@METHOD_REGISTRY.register("fedrdn")
class FedRDN(Method):
    """FedRDN on FedAvg: inputs normalised with a random client's statistics (module docstring)."""

    name = "fedrdn"
    defaults: ClassVar[dict[str, Any]] = {
        "include_self": True,
        "eval_stats": "local",
        "statistics": "per_dimension",
        "eps": 1e-5,
    }
    uses_prototypes = False
    shares_weights = True
    extra_uploads = (
        "input statistics: the mean and standard deviation of the client's cached training "
        "features, shared with every client",
    )

    def validate(self) -> None:
        """Booleans and choices as listed; ``eps`` > 0."""
        if not isinstance(self.params["include_self"], bool):
            raise ValueError(
                f"fedrdn.include_self={self.params['include_self']!r} must be true or false"
            )
        if self.params["eval_stats"] not in ("local", "federation"):
            raise ValueError(
                f"fedrdn.eval_stats={self.params['eval_stats']!r} must be local or federation"
            )
        if self.params["statistics"] not in ("per_dimension", "scalar"):
            raise ValueError(
                f"fedrdn.statistics={self.params['statistics']!r} must be per_dimension or scalar"
            )
        eps = self.params["eps"]
        if not is_number(eps) or not float(eps) > 0:
            raise ValueError(f"fedrdn.eps={eps!r} must be a number > 0")

    # ----- client -------------------------------------------------------------------------------
    def upload_extras(
        self, model: ClientModel, z: torch.Tensor, y: torch.Tensor, state: ClientState, client: int
    ) -> dict[str, torch.Tensor]:
        """The client's input statistics (kept for its own inference too)."""
        mu, sd = input_statistics(z, str(self.params["statistics"]), float(self.params["eps"]))
        state.tensors[MEAN], state.tensors[STD] = mu.cpu(), sd.cpu()
        return {"mean": mu.cpu(), "std": sd.cpu()}

    def objective(self) -> LocalObjective:
        """Cross-entropy on inputs normalised with randomly drawn client statistics."""
        p = self.params
        return LocalObjective(
            inputs=RandomDomainNormalisation(
                self.seed, bool(p["include_self"]), str(p["eval_stats"])
            )
        )

    # ----- server -------------------------------------------------------------------------------
    def aggregate(self, uploads: Sequence[Upload], round_index: int) -> GlobalState:
        """Keep every client's latest statistics; share the whole set (client order)."""
        bank: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if CLIENTS in self.server_state:
            for i, c in enumerate(self.server_state[CLIENTS].tolist()):
                bank[int(c)] = (self.server_state[MEAN][i], self.server_state[STD][i])
        for up in uploads:
            if "mean" in up.extras and "std" in up.extras:
                # a standard deviation below eps (a hostile 0) would divide by zero
                sd = up.extras["std"].float().clamp_min(float(self.params["eps"]))
                bank[int(up.client)] = (up.extras["mean"].float(), sd)
        if not bank:
            return {}
        clients = sorted(bank)
        self.server_state = {
            CLIENTS: torch.tensor(clients, dtype=torch.long),
            MEAN: torch.stack([bank[c][0] for c in clients]),
            STD: torch.stack([bank[c][1] for c in clients]),
        }
        return {k: v.clone() for k, v in self.server_state.items()}
