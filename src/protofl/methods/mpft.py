"""MPFT (Zhang et al., ICLR 2025) as used as a prototype framework in VPDR.

Clients release class prototypes of the *pretrained* representation (``prototype_source:
projection``: ``proj(z)``, the frozen backbone feature mapped into prototype space without the
client's adapter; VPDR's ``return_backbone`` features, MPFT's raw encoder features). The server
fine-tunes a residual server adapter (zero-initialised up-projection) and a linear server head on
the released prototypes with cross-entropy, persistent across rounds, and broadcasts their weights.
Clients distil from that server model: ``L = CE + beta * T^2 * KL(softmax(t/T) || softmax(s/T))``
with student logits ``s = h(f)`` and teacher logits ``t = h_s(A_s(u))``, ``u`` being the same
kind of feature the prototypes were made of (the teacher input is computed without gradient).

Choices (see docs): the default teacher includes the trained server adapter (``teacher:
server``), as MPFT's global model does; ``teacher: head`` reproduces the VPDR code, whose teacher
forward skips the prototype adapter. ``prototype_source: feature`` releases prototypes of the
adapter feature f instead (the teacher then reads the raw f of the batch).

The server trains on released prototypes only: post-processing, no extra privacy cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from protofl.methods.base import METHOD_REGISTRY, GlobalState, Method, Upload
from protofl.methods.fedtgp import single_thread, stack_uploads
from protofl.methods.objectives import Group, LocalObjective, Step, Term
from protofl.models.client import ClientModel, ResidualAdapter, init_parameters
from protofl.privacy.dcr import distillation
from protofl.seeding import method_generator

PREFIX = "mpft."


class ServerModel(nn.Module):
    """The server's adapter (residual, zero-init up) and linear head in prototype space."""

    def __init__(self, dim: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.adapter = ResidualAdapter(dim, hidden)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """Logits ``h_s(A_s(u))``."""
        return self.head(self.adapter(u))


def teacher_logits(u: torch.Tensor, gs: GlobalState, *, use_adapter: bool) -> torch.Tensor:
    """The broadcast server model applied to ``u`` [..., d] (with or without its adapter)."""
    if use_adapter:
        hid = torch.relu(u @ gs[PREFIX + "adapter.down.weight"].T)
        u = u + hid @ gs[PREFIX + "adapter.up.weight"].T
    return u @ gs[PREFIX + "head.weight"].T + gs[PREFIX + "head.bias"]


@dataclass(frozen=True)
class ServerDistillation(Term):
    """``beta * T^2 * KL(softmax(t/T) || softmax(s/T))`` (VPDR's MPFT objective): student logits
    ``s = h(f)``, teacher logits ``t`` of the broadcast server model on the feature the
    prototypes were made of (``proj(z)``, or the raw ``f``), computed without gradient."""

    beta: float
    temperature: float
    use_adapter: bool
    source: str = "projection"

    def prepare(self, global_state: GlobalState, group: Group) -> Any:
        if self.beta == 0 or PREFIX + "head.weight" not in global_state:
            return None
        return {k: v for k, v in global_state.items() if k.startswith(PREFIX)}

    def value(self, step: Step, prepared: Any, rows: slice) -> torch.Tensor:
        if prepared is None:
            return step.zeros()
        with torch.no_grad():
            if self.source == "projection":
                if step.model is None or step.z is None:
                    raise ValueError("mpft: the executor gave the step no model view or inputs")
                u = step.model.project(step.z)
            else:
                u = (step.f_raw if step.f_raw is not None else step.f).detach()
            t = teacher_logits(u, prepared, use_adapter=self.use_adapter)
        kd = distillation(step.logits, t, self.temperature, step.ok)
        return self.beta * self.temperature**2 * kd


@METHOD_REGISTRY.register("mpft")
class MPFT(Method):
    """Server-side fine-tuning on released prototypes, then client distillation from it."""

    name = "mpft"
    defaults: ClassVar[dict[str, Any]] = {
        "beta": 0.3,
        "temperature": 4.0,
        "teacher": "server",
        "prototype_source": "projection",
        "server_epochs": 20,
        "server_lr": 1e-3,
        "server_batch": 64,
        "server_momentum": 0.9,
        "server_weight_decay": 5e-4,
        "adapter_reduction": 8,
        "seed": 0,
    }

    def validate(self) -> None:
        """Check every parameter; the message names the parameter."""
        p = self.params
        if p["teacher"] not in ("server", "head"):
            raise ValueError(f"mpft.teacher={p['teacher']!r}; choose server or head")
        if p["prototype_source"] not in ("projection", "feature"):
            raise ValueError(
                f"mpft.prototype_source={p['prototype_source']!r}; choose projection or feature"
            )
        for key in ("beta", "server_momentum", "server_weight_decay"):
            if not float(p[key]) >= 0:
                raise ValueError(f"mpft.{key}={p[key]!r} must be >= 0")
        for key in ("temperature", "server_lr"):
            if not float(p[key]) > 0:
                raise ValueError(f"mpft.{key}={p[key]!r} must be > 0")
        for key in ("server_epochs", "server_batch", "adapter_reduction"):
            v = p[key]
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"mpft.{key}={v!r} must be a positive integer")
        if int(p["seed"]) < 0:
            raise ValueError(f"mpft.seed={p['seed']!r} must be >= 0")

    # ----- client side ----------------------------------------------------------------------
    def upload_features(self, model: ClientModel, z: torch.Tensor) -> torch.Tensor:
        """``proj(z)`` (pretrained feature, no client adapter) or the adapter feature ``f``."""
        if self.params["prototype_source"] == "projection":
            return model.proj(z)
        return model.features(z)

    def objective(self) -> LocalObjective:
        """CE + beta * T^2 * KL(teacher || student) (VPDR's MPFT objective)."""
        p = self.params
        return LocalObjective(
            terms=(
                ServerDistillation(
                    float(p["beta"]),
                    float(p["temperature"]),
                    p["teacher"] == "server",
                    str(p["prototype_source"]),
                ),
            )
        )

    # ----- server side ----------------------------------------------------------------------
    def build_server_model(self) -> ServerModel:
        """The server model from ``server_state`` (seeded init in the first round)."""
        hidden = max(1, self.proto_dim // int(self.params["adapter_reduction"]))
        model = ServerModel(self.proto_dim, hidden, self.num_classes)
        if self.server_state:
            model.load_state_dict({k[len(PREFIX) :]: v for k, v in self.server_state.items()})
        else:
            # the experiment seed and the method's own seed offset (MPFT init stream 10)
            init_parameters(model, method_generator(self.seed, int(self.params["seed"]), 10))
        return model

    def aggregate(self, uploads: Sequence[Upload], round_index: int) -> GlobalState:
        """Fine-tune the server adapter and head on the released prototypes with CE; broadcast."""
        x, y = stack_uploads(uploads, self.proto_dim)
        if len(y) == 0:
            return {}
        # the server's fine-tuning runs on run.device (the engine sets self.device); the
        # batch order is drawn on the CPU, so it is the same on every device
        device = self.device
        model = self.build_server_model().to(device)
        x, y = x.to(device), y.to(device)
        p = self.params
        opt = torch.optim.SGD(
            model.parameters(),
            lr=float(p["server_lr"]),
            momentum=float(p["server_momentum"]),
            weight_decay=float(p["server_weight_decay"]),
        )
        gen = method_generator(self.seed, int(p["seed"]), 11, round_index)
        batch = int(p["server_batch"])
        model.train()
        with single_thread():
            for _ in range(int(p["server_epochs"])):
                perm = torch.randperm(len(y), generator=gen)
                for start in range(0, len(y), batch):
                    idx = perm[start : start + batch].to(device)
                    loss = F.cross_entropy(model(x[idx]), y[idx])
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
        self.server_state = {
            PREFIX + k: v.detach().cpu().clone() for k, v in model.state_dict().items()
        }
        out: GlobalState = {k: v.clone() for k, v in self.server_state.items()}
        out["classes"] = torch.unique(y).cpu()
        return out
