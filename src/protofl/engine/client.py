"""One simulated client, and what an executor needs of the federation it trains.

:class:`Client` is everything one client of an in-process run owns: its data, model, optimiser,
method state, training generator and its private-release state
(:class:`~protofl.privacy.client.PrivateClient`: mechanism, noise key, ledger, DCR, release
limit).  :class:`Federation` is the part of a run an executor reads (the sequential loop of
:class:`~protofl.engine.simulation.Simulation`, the batched trainer of
:mod:`protofl.engine.batched`, the fused trainer): so an executor depends on this module, not on
the simulator that drives it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from protofl.config import ExperimentConfig
from protofl.engine.federated_data import ClientData, FederatedData
from protofl.methods.base import ClientState, GlobalState, Method
from protofl.models.client import ClientModel
from protofl.privacy.client import PrivateClient


@dataclass
class Client:
    """Everything one simulated client owns."""

    data: ClientData
    model: ClientModel
    optimizer: torch.optim.Optimizer
    state: ClientState
    train_gen: torch.Generator
    # its private-release state: mechanism, noise key, ledger, DCR, release limit
    privacy: PrivateClient

    @property
    def dcr(self) -> Any:
        """The client's DCR hooks (None without DCR): ``privacy.dcr``."""
        return self.privacy.dcr


class Federation(Protocol):
    """What an executor reads of the run it trains for (a
    :class:`~protofl.engine.simulation.Simulation` is one)."""

    config: ExperimentConfig
    data: FederatedData
    method: Method
    clients: list[Client]
    global_state: GlobalState
    round: int
    amp: str  # run.amp

    def test_set(self, c: Client, sample: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The test inputs and labels ``c`` is evaluated on."""
        ...


__all__ = ["Client", "Federation"]
