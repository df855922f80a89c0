"""The trainable part of a client: residual adapter, projection to prototype space, head."""

from __future__ import annotations

import collections
import copy
import math
from abc import ABC, abstractmethod
from typing import Any, TypeVar

import torch
from torch import nn

from protofl.config import BackboneConfig

M = TypeVar("M", bound=nn.Module)


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


def copy_client_model(template: M) -> M:
    """An independent copy of a fresh client model (for clients that start identical): its own
    trainable parameters and buffers, and the template's frozen parameters themselves (never
    updated in place; :class:`~protofl.engine.store.FrozenParameterPool` holds one anyway).

    ``copy.deepcopy`` of the module tree, faster: a module's bookkeeping (empty hook dicts,
    flags) is copied shallowly where it is empty or immutable (deepcopy spends ~2 ms per client
    model on it); anything else is deep-copied as deepcopy would.
    """
    memo: dict[int, Any] = {id(p): p for p in template.parameters() if not p.requires_grad}

    def tensor(t: torch.Tensor) -> torch.Tensor:
        new = memo.get(id(t))
        if new is None:
            new = memo[id(t)] = copy.deepcopy(t, memo)
        return new  # type: ignore[no-any-return]

    def module(mod: nn.Module) -> nn.Module:
        new = memo.get(id(mod))
        if new is not None:
            return new  # type: ignore[no-any-return]
        new = memo[id(mod)] = object.__new__(type(mod))
        state: dict[str, Any] = {}
        for key, value in mod.__dict__.items():
            if key in ("_parameters", "_buffers"):
                state[key] = type(value)(
                    (n, None if t is None else tensor(t)) for n, t in value.items()
                )
            elif key == "_modules":
                state[key] = type(value)(
                    (n, None if m is None else module(m)) for n, m in value.items()
                )
            elif type(value) in _IMMUTABLE:
                state[key] = value
            elif type(value) in _CONTAINERS and not value:
                state[key] = type(value)()
            else:
                state[key] = copy.deepcopy(value, memo)
        new.__dict__.update(state)
        return new  # type: ignore[no-any-return]

    return module(template)  # type: ignore[return-value]


_IMMUTABLE = (bool, int, float, str, type(None))
_CONTAINERS = (dict, collections.OrderedDict, set, list)
