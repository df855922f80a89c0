"""FedTGP (Zhang et al., AAAI 2024): trainable global prototypes with an adaptive margin.

The server owns a generator ``TGP: class -> R^d`` (``Embedding(C, d) -> Linear + ReLU -> Linear``)
that persists across rounds. Each round it is trained on the uploaded (noisy) prototypes with the
adaptive-margin contrastive loss ``CE(-(dist + m * onehot), y)`` (FedTGP Eq. 5-7), where ``dist``
holds the L2 distances of an uploaded prototype to every class's generated prototype and
``m = min(max_c gap_c, margin_cap)``, ``gap_c`` being the smallest L2 distance between class c's
mean uploaded prototype and any other class's mean (FedTGP Eq. 6). The global prototypes are
``G_c = TGP(c)`` and clients add ``lam * MSE(f, G_y)`` to their cross-entropy (FedTGP Eq. 8).

Server budget presets (``budget``): ``upstream`` = the official FedTGP code (1000 epochs, SGD lr
0.005, batch 10); ``reference`` = the VPDR code (100 epochs, SGD lr 1e-3, batch 256, i.e. one
step per epoch with a few dozen prototypes). ``server_epochs``, ``server_lr`` and ``server_batch``
override the preset one by one.

The generator is trained only on released prototypes: post-processing, no extra privacy cost.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from protofl.methods.base import (
    METHOD_REGISTRY,
    GlobalState,
    Method,
    Upload,
)
from protofl.methods.objectives import LocalObjective, PrototypePull
from protofl.seeding import method_generator

BUDGETS: dict[str, dict[str, float]] = {
    "upstream": {"server_epochs": 1000, "server_lr": 0.005, "server_batch": 10},
    "reference": {"server_epochs": 100, "server_lr": 1e-3, "server_batch": 256},
}


@contextmanager
def single_thread() -> Iterator[None]:
    """Run tiny server-side training on one intra-op thread (restored afterwards).

    The server models here are a few thousand to a few hundred thousand parameters trained with
    batches of ~10 rows; intra-op threading only adds synchronisation (10-30x slower measured on
    a busy 2-core machine). Results do not depend on the thread count.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def stack_uploads(uploads: Sequence[Upload], dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All released prototype rows and their classes, in upload order."""
    rows = [u.release for u in uploads if u.release is not None and u.release.num_prototypes]
    if not rows:
        return torch.zeros(0, dim), torch.zeros(0, dtype=torch.long)
    x = torch.cat([r.prototypes.float() for r in rows])
    y = torch.cat([r.classes.long() for r in rows])
    return x, y


class TrainablePrototypes(nn.Module):
    """FedTGP's generator: ``Embedding(C, d) -> Linear(d, h) + ReLU -> Linear(h, d)``."""

    def __init__(self, num_classes: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_classes, dim)
        self.middle = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU())
        self.fc = nn.Linear(hidden, dim)

    def forward(self, classes: torch.Tensor) -> torch.Tensor:
        """Generated prototypes of ``classes`` ([k] -> [k, d])."""
        return self.fc(self.middle(self.embedding(classes)))

    def reset(self, generator: torch.Generator) -> None:
        """Seeded init: embedding N(0, 1) (torch's default), linears uniform(+-1/sqrt(fan_in))."""
        with torch.no_grad():
            self.embedding.weight.normal_(generator=generator)
            for lin in (self.middle[0], self.fc):
                assert isinstance(lin, nn.Linear)
                bound = 1.0 / math.sqrt(lin.in_features)
                lin.weight.uniform_(-bound, bound, generator=generator)
                lin.bias.uniform_(-bound, bound, generator=generator)


def adaptive_margin(x: torch.Tensor, y: torch.Tensor, num_classes: int, cap: float) -> float:
    """FedTGP Eq. (6): ``min(max_c gap_c, cap)``, gap_c = min_{c'!=c} ||mean_c - mean_c'||.

    ``mean_c`` is the unweighted mean of the uploaded prototypes of class c (as the official
    code's per-class average). Fewer than two classes present: no gap is defined, margin 0.
    """
    present = torch.unique(y)
    if len(present) < 2:
        return 0.0
    means = torch.stack([x[y == c].mean(dim=0) for c in present.tolist()])
    dist = torch.cdist(means.double(), means.double())
    dist.fill_diagonal_(math.inf)
    gap = dist.min(dim=1).values
    return float(min(float(gap.max()), cap))


def margin_loss(
    generator_out: torch.Tensor, x: torch.Tensor, y: torch.Tensor, margin: float
) -> torch.Tensor:
    """FedTGP Eq. (7): ``CE(-(||x - TGP(c)||_2 + m * 1[c = y]), y)`` over all classes c."""
    sq = (
        x.pow(2).sum(dim=1, keepdim=True)
        - 2 * x @ generator_out.T
        + generator_out.pow(2).sum(dim=1)[None, :]
    )
    dist = sq.clamp_min(1e-12).sqrt()
    onehot = F.one_hot(y, generator_out.shape[0]).to(dist.dtype)
    return F.cross_entropy(-(dist + margin * onehot), y)


@METHOD_REGISTRY.register("fedtgp")
class FedTGP(Method):
    """Trainable global prototypes (server generator) with the adaptive-margin loss.

    Parameters: ``lam`` (weight of the client MSE term, 1), ``margin_cap`` (100), ``budget``
    (upstream | reference), ``server_epochs`` / ``server_lr`` / ``server_batch`` (None: from
    the budget), ``server_hidden`` (None: d), ``seed`` (server init and shuffles), ``eval``
    (classifier | prototype: nearest generated prototype in L2, as the official code).
    """

    name = "fedtgp"
    defaults: ClassVar[dict[str, Any]] = {
        "lam": 1.0,
        "margin_cap": 100.0,
        "budget": "upstream",
        "server_epochs": None,
        "server_lr": None,
        "server_batch": None,
        "server_hidden": None,
        "seed": 0,
    }
    eval_modes = ("classifier", "prototype")
    PREFIX: ClassVar[str] = "tgp."

    def validate(self) -> None:
        """Check every parameter's range; the message names the parameter."""
        p = self.params
        if p["budget"] not in BUDGETS:
            raise ValueError(f"fedtgp.budget={p['budget']!r}; choose one of {', '.join(BUDGETS)}")
        if not float(p["lam"]) >= 0:
            raise ValueError(f"fedtgp.lam={p['lam']!r} must be >= 0")
        if not float(p["margin_cap"]) >= 0:
            raise ValueError(f"fedtgp.margin_cap={p['margin_cap']!r} must be >= 0")
        for key in ("server_epochs", "server_batch", "server_hidden"):
            v = p[key]
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"fedtgp.{key}={v!r} must be a positive integer (or null)")
        if p["server_lr"] is not None and not float(p["server_lr"]) > 0:
            raise ValueError(f"fedtgp.server_lr={p['server_lr']!r} must be > 0")
        if int(p["seed"]) < 0:
            raise ValueError(f"fedtgp.seed={p['seed']!r} must be >= 0")

    def server_setting(self, key: str) -> float:
        """An explicit ``server_*`` value, else the budget preset's."""
        value = self.params[key]
        return float(BUDGETS[self.params["budget"]][key] if value is None else value)

    # ----- server -------------------------------------------------------------------------
    def build_generator(self) -> TrainablePrototypes:
        """The generator from ``server_state`` (or freshly seeded when there is none yet)."""
        hidden = int(self.params["server_hidden"] or self.proto_dim)
        tgp = TrainablePrototypes(self.num_classes, self.proto_dim, hidden)
        if self.server_state:
            n = len(self.PREFIX)
            tgp.load_state_dict({k[n:]: v for k, v in self.server_state.items()})
        else:
            # the experiment seed and the method's own seed offset (FedTGP init stream 6)
            tgp.reset(method_generator(self.seed, int(self.params["seed"]), 6))
        return tgp

    def aggregate(self, uploads: Sequence[Upload], round_index: int) -> GlobalState:
        """Train the generator on the uploaded prototypes; broadcast ``G_c = TGP(c)``."""
        x, y = stack_uploads(uploads, self.proto_dim)
        if len(y) == 0:
            return {}
        margin = adaptive_margin(x, y, self.num_classes, float(self.params["margin_cap"]))
        # the server's training runs on run.device (the engine sets self.device); the batch
        # order is drawn on the CPU, so it is the same on every device
        device = self.device
        tgp = self.build_generator().to(device)
        x, y = x.to(device), y.to(device)
        epochs = int(self.server_setting("server_epochs"))
        batch = int(self.server_setting("server_batch"))
        opt = torch.optim.SGD(tgp.parameters(), lr=self.server_setting("server_lr"))
        gen = method_generator(self.seed, int(self.params["seed"]), 7, round_index)
        all_classes = torch.arange(self.num_classes, device=device)
        tgp.train()
        with single_thread():
            for _ in range(epochs):
                perm = torch.randperm(len(y), generator=gen)
                for start in range(0, len(y), batch):
                    idx = perm[start : start + batch].to(device)
                    loss = margin_loss(tgp(all_classes), x[idx], y[idx], margin)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
        self.server_state = {
            self.PREFIX + k: v.detach().cpu().clone() for k, v in tgp.state_dict().items()
        }
        classes = torch.unique(y)
        tgp.eval()
        with torch.no_grad():
            protos = tgp(classes)
        return {
            "prototypes": protos.cpu(),
            "classes": classes.cpu(),
            "margin": torch.tensor(margin),
        }

    # ----- client -------------------------------------------------------------------------
    def objective(self) -> LocalObjective:
        """CE + lam * MSE(f, G_y) over samples whose class has a global prototype (Eq. 8)."""
        return LocalObjective(terms=(PrototypePull(float(self.params["lam"])),))

    def prediction(self) -> str:
        """Classifier head, or nearest generated prototype (L2) with ``eval: prototype``."""
        return str(self.params["eval"])
