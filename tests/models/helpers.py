"""Shared builders of the model tests: the papers' settings run through a preset on a PACS tree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from protofl.config import ExperimentConfig
from protofl.data.pacs import PACS_CLASSES
from protofl.models.backbones import backbone_class
from protofl.presets import preset_settings
from protofl.seeding import Stream, derive_seed
from tests.data.test_imagefolder import make_pacs

__all__ = [
    "assert_preset_landed",
    "client_states",
    "initial_client_state",
    "make_pacs",
    "paper_config",
]


def paper_config(
    preset: str, root: Path, backbone: dict[str, Any], **run_length: int
) -> ExperimentConfig:
    """``preset`` on the PACS tree at ``root`` with ``backbone``; ``run_length`` (rounds,
    local_epochs) is the only other value the test sets, besides keeping every round's
    checkpoint (the tests read the client states after each round)."""
    return ExperimentConfig.from_dict(
        {
            "preset": preset,
            "data": {"name": "pacs", "root": str(root)},
            "backbone": backbone,
            "federation": {**run_length, "keep_checkpoints": 0},
            "run": {"progress": False, "save_releases": False},
        }
    )


def assert_preset_landed(config: ExperimentConfig, *, overridden: set[str]) -> None:
    """Every value the config's preset sets for its data set and method is in the config,
    except the keys in ``overridden`` (set by the test: the user's values win)."""
    assert config.preset is not None
    settings = preset_settings(config.preset, config.data.name, config.method.name)
    assert overridden <= set(settings)
    resolved = config.to_dict()
    for key, value in settings.items():
        if key in overridden:
            continue
        node: Any = resolved
        for part in key.split("."):
            node = node[part]
        assert node == value, key


def initial_client_state(config: ExperimentConfig, feature_dim: int) -> dict[str, torch.Tensor]:
    """The state every client of a run of ``config`` starts from (the engine's init stream)."""
    model = backbone_class(config.backbone).client_model(
        feature_dim,
        len(PACS_CLASSES),
        config.backbone,
        torch.Generator().manual_seed(derive_seed(config.seed, Stream.INIT)),
    )
    return {k: v.clone() for k, v in model.state_dict().items()}


def client_states(run_dir: Path, round_index: int) -> list[dict[str, torch.Tensor]]:
    """Every client's model state after round ``round_index`` (from the run's checkpoint)."""
    state = torch.load(run_dir / f"checkpoint-{round_index:04d}.pt", weights_only=True)
    return [c["model"] for c in state["clients"]]
