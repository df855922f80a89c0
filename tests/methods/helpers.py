"""Shared builders of the method tests: releases, uploads, batches, methods."""

from __future__ import annotations

import math
from typing import Any

import torch

from protofl.methods import create_method
from protofl.methods.base import Batch, GlobalState, Upload
from protofl.privacy.base import Release

LOG1P_E2 = math.log1p(math.exp(-2.0))  # -log(e^2 / (e^2 + e^0)) = 0.126928...


def release(protos: list[list[float]], classes: list[int]) -> Release:
    p = torch.tensor(protos, dtype=torch.float32)
    return Release(
        prototypes=p,
        classes=torch.tensor(classes),
        counts=torch.ones(len(classes), dtype=torch.long),
        sensitivity=torch.full((len(classes),), math.inf),
        noise_std=torch.zeros_like(p),
        mechanism="none",
    )


def upload(client: int, domain: int, protos: list[list[float]], classes: list[int]) -> Upload:
    return Upload(client=client, domain=domain, release=release(protos, classes), num_samples=1)


def make(name: str, params: dict | None = None, *, num_classes: int = 3, dim: int = 2):
    return create_method(name, params, num_classes=num_classes, num_domains=2, proto_dim=dim)


def _release(protos: list[list[float]], classes: list[int], counts: list[int]) -> Release:
    p = torch.tensor(protos)
    return Release(
        p,
        torch.tensor(classes),
        torch.tensor(counts),
        torch.zeros(len(classes)),
        torch.zeros_like(p),
        "none",
    )


class Identity:
    """A stand-in model whose feature is its input and whose head's logits are zero (no class
    preferred): prototype rules decide alone."""

    def features(self, z: torch.Tensor) -> torch.Tensor:
        return z

    def __call__(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return z, torch.zeros(len(z), 1)


IDENTITY: Any = Identity()


def _batch(f: list[list[float]], y: list[int], num_classes: int) -> Batch:
    ft = torch.tensor(f, requires_grad=True)
    return Batch(
        z=ft,
        y=torch.tensor(y),
        f=ft,
        f_raw=ft,
        logits=torch.zeros(len(y), num_classes),
        model=IDENTITY,
        client=0,
        domain=0,
    )


def _lse(*xs: float) -> float:
    return math.log(sum(math.exp(x) for x in xs))


def _fpl_state() -> GlobalState:
    return {
        "cluster_prototypes": torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]),
        "cluster_classes": torch.tensor([0, 0, 1]),
        "prototypes": torch.tensor([[0.5, 0.5], [-1.0, 0.0]]),
        "classes": torch.tensor([0, 1]),
    }
