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
counter kept in the client state, so runs and resumed runs repeat.

Privacy: the weights and the statistics leave every client without noise; FedRDN releases no
prototypes, so a run with it has no DP guarantee (the statement names both).
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
)
from protofl.methods.fpl import is_number
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

    def draw(
        self, global_state: GlobalState, client: int, n: int, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample ``(mu^j, sigma^j)`` rows, ``j`` uniform over the shared set (without the
        client's own row when ``include_self`` is false and another exists)."""
        ids = global_state[CLIENTS].tolist()
        rows = [i for i, c in enumerate(ids) if self.params["include_self"] or int(c) != client]
        rows = rows or list(range(len(ids)))
        gen = method_generator(self.seed, STREAM, client, step)
        pick = torch.tensor(rows)[torch.randint(len(rows), (n,), generator=gen)]
        return global_state[MEAN][pick], global_state[STD][pick]

    def client_loss(
        self, batch: Batch, global_state: GlobalState, state: ClientState
    ) -> torch.Tensor:
        """Cross-entropy on the batch normalised with randomly drawn client statistics."""
        step = int(state.tensors.get(STEP, torch.tensor(0)))
        state.tensors[STEP] = torch.tensor(step + 1)
        if CLIENTS not in global_state:  # nothing shared yet: the plain batch
            return F.cross_entropy(batch.logits, batch.y)
        mu, sd = self.draw(global_state, batch.client, len(batch.y), step)
        _, logits = batch.model(normalise(batch.z, mu, sd))
        return F.cross_entropy(logits, batch.y)

    def predict(
        self,
        model: ClientModel,
        z: torch.Tensor,
        global_state: GlobalState,
        state: ClientState,
    ) -> torch.Tensor:
        """The head's argmax on ``z`` normalised with the client's own statistics (``local``)
        or the mean of the shared ones (``federation``)."""
        if self.params["eval_stats"] == "federation" and CLIENTS in global_state:
            mu, sd = global_state[MEAN].mean(dim=0), global_state[STD].mean(dim=0)
        elif MEAN in state.tensors:
            mu, sd = state.tensors[MEAN], state.tensors[STD]
        else:  # no statistics yet (before the first upload): the plain input
            return model(z)[1].argmax(dim=1)
        return model(normalise(z, mu, sd))[1].argmax(dim=1)

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
