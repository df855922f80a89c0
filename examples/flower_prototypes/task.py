"""Data and model of the Flower example: every client is one "domain" of a shifted toy task."""

from __future__ import annotations

import torch
from torch import nn

CLASSES, DIM, FEAT = 4, 16, 8
DEFAULTS = {"num-rounds": 5, "num-clients": 3, "epsilon": 4.0}
"""Run config (``[tool.flwr.app.config]`` in pyproject.toml); these values when it is empty."""


def setting(run_config: object, key: str) -> float:
    """A run-config value, or its default (``run_simulation`` passes no run config)."""
    value = run_config.get(key) if hasattr(run_config, "get") else None  # type: ignore[union-attr]
    return float(DEFAULTS[key] if value is None else value)


def load_partition(partition_id: int, n: int = 400) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test) of one client: shared class means, its own shift."""
    g = torch.Generator().manual_seed(100 + partition_id)
    means = torch.randn(CLASSES, DIM, generator=torch.Generator().manual_seed(7)) * 1.2
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = (means[y] + torch.randn(n, DIM, generator=g)) * (1.0 + 0.5 * partition_id) + partition_id
    split = int(0.75 * n)
    return x[:split], y[:split], x[split:], y[split:]


class Net(nn.Module):
    """An adapter (features f) and a linear classifier head."""

    def __init__(self) -> None:
        super().__init__()
        self.adapter = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, FEAT))
        self.head = nn.Linear(FEAT, CLASSES)
