"""The clients' local optimiser, built from ``federation`` (``optimizer``, ``lr``,
``weight_decay``, ``momentum``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from protofl.config import FederationConfig


def make_optimizer(
    params: Iterable[torch.nn.Parameter], fed: FederationConfig
) -> torch.optim.Optimizer:
    """AdamW (``momentum`` is its beta1; the default 0.9 is torch's) or SGD with momentum.

    Both apply ``weight_decay`` as torch does: decoupled for AdamW, added to the gradient for
    SGD (FedDAP's reference code: SGD lr 0.01, momentum 0.9, weight decay 1e-5).
    """
    if fed.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=fed.lr, momentum=fed.momentum, weight_decay=fed.weight_decay
        )
    if fed.optimizer == "adamw":
        return torch.optim.AdamW(
            params, lr=fed.lr, betas=(fed.momentum, 0.999), weight_decay=fed.weight_decay
        )
    raise ValueError(f"federation.optimizer={fed.optimizer!r}; choose adamw or sgd")
