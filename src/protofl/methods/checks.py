"""``tiny_config``: the tiny set-up the conformance suite runs every method on.

Several domains and several clients per domain of the generated ``toy`` set with the fast
``pixels`` backbone.  The suite itself (``check_method``: it runs the simulation) is
:mod:`protofl.engine.method_checks`.
"""

from __future__ import annotations

from typing import Any

from protofl.config import ExperimentConfig


def tiny_config(
    method: str,
    mechanism: str,
    params: dict[str, Any] | None = None,
    rounds: int = 3,
    seed: int = 0,
    clients_per_domain: int = 1,
) -> ExperimentConfig:
    """Two domains (x ``clients_per_domain`` clients) of the generated ``toy`` set with the fast
    ``pixels`` backbone."""
    return ExperimentConfig.from_dict(
        {
            "name": f"check-{method}-{mechanism}",
            "seed": seed,
            "data": {
                "name": "toy",
                "train_fraction": 1.0,
                "domains": ["red", "blue"],
                "clients_per_domain": clients_per_domain,
            },
            "backbone": {
                "name": "pixels",
                "image_size": 16,
                "proto_dim": 32,
                "adapter_hidden": 8,
                "feature_cache": False,
            },
            "federation": {"rounds": rounds, "local_epochs": 2, "batch_size": 32, "lr": 3e-3},
            "method": {"name": method, "params": params or {}},
            "privacy": {"mechanism": mechanism, "epsilon": 8.0, "clip": 1.0},
            "run": {"progress": False, "save_releases": False},
        }
    )
