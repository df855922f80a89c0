"""The trainable part of a client: residual adapter, projection to prototype space, head."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
from torch import nn

from protofl.config import BackboneConfig


class ResidualAdapter(nn.Module):
    """``z + W_up relu(W_down z)`` with a zero-initialised up-projection (starts as identity)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.down = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(hidden, dim, bias=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Residual bottleneck."""
        return z + self.up(torch.relu(self.down(z)))


class ClientModelBase(nn.Module, ABC):
    """The interface every client model shares: ``features(z)`` (each subclass's own),
    ``forward(z) -> (f, logits)`` through ``self.head``, and ``trainable_parameters()``.
    """

    head: nn.Module

    @abstractmethod
    def features(self, z: torch.Tensor) -> torch.Tensor:
        """The prototype-space feature f of a cached representation z."""

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(f, logits)``."""
        f = self.features(z)
        return f, self.head(f)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters the local optimiser updates: every one with ``requires_grad``."""
        return [p for p in self.parameters() if p.requires_grad]


class ClientModel(ClientModelBase):
    """Cached frozen representation -> adapter -> projection (feature f) -> classifier head."""

    def __init__(self, in_dim: int, num_classes: int, config: BackboneConfig) -> None:
        super().__init__()
        self.adapter = ResidualAdapter(in_dim, config.adapter_hidden)
        self.proj = nn.Linear(in_dim, config.proto_dim)
        if config.head == "mlp":
            self.head: nn.Module = nn.Sequential(
                nn.Linear(config.proto_dim, config.proto_dim),
                nn.ReLU(),
                nn.Linear(config.proto_dim, num_classes),
            )
        else:
            self.head = nn.Linear(config.proto_dim, num_classes)
        if not config.train_projection:
            for p in self.proj.parameters():
                p.requires_grad_(False)

    def features(self, z: torch.Tensor) -> torch.Tensor:
        """The prototype-space feature f of a cached representation z."""
        return self.proj(self.adapter(z))


def init_parameters(module: nn.Module, generator: torch.Generator) -> None:
    """Seeded initialisation (no global RNG): uniform(+-1/sqrt(fan_in)); adapters' up is zero."""
    for name, mod in module.named_modules():
        if isinstance(mod, nn.Linear):
            if name.endswith("adapter.up") or name == "up":
                nn.init.zeros_(mod.weight)
                continue
            bound = 1.0 / math.sqrt(mod.in_features)
            with torch.no_grad():
                mod.weight.uniform_(-bound, bound, generator=generator)
                if mod.bias is not None:
                    mod.bias.uniform_(-bound, bound, generator=generator)


def build_client_model(
    in_dim: int, num_classes: int, config: BackboneConfig, generator: torch.Generator
) -> ClientModel:
    """A freshly initialised client model; the same generator state gives the same weights."""
    model = ClientModel(in_dim, num_classes, config)
    init_parameters(model, generator)
    return model
