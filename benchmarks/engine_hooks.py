"""Timing instrumentation for the benchmarks.

The engine itself now does what this module used to wire in (``Simulation`` with
``federation.execution: batched`` uses the trainer's batched uploads and evaluation, pools
identical frozen parameters as it builds the clients, and accounts each distinct privacy ledger
once).  ``HookedSimulation`` only records the time of each round's upload (feature computation
and prototype release) and local-training phases.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from protofl.engine.simulation import Simulation
from protofl.methods.base import Upload


class HookedSimulation(Simulation):
    """:class:`Simulation` recording ``upload_s`` and ``train_s`` per round."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.upload_s: list[float] = []
        self.train_s: list[float] = []

    def collect_uploads(self, active: Sequence[bool] | None = None) -> list[Upload]:
        t0 = time.perf_counter()
        out = super().collect_uploads(active)
        self.upload_s.append(time.perf_counter() - t0)
        return out

    def train_active(self, clients: list[Any]) -> list[float]:
        t0 = time.perf_counter()
        out = super().train_active(clients)
        self.train_s.append(time.perf_counter() - t0)
        return out
