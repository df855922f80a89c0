"""The engine hooks the benchmarks wire in until ``Simulation`` calls them itself.

``HookedSimulation`` is :class:`~protofl.engine.simulation.Simulation` with, when
``federation.execution: batched`` and the :class:`~protofl.engine.batched.BatchedTrainer`
supports the run:

* ``collect_uploads`` -> ``BatchedTrainer.collect_uploads`` (batched features,
  ``release_many``; the same releases, ledger entries and diagnostics);
* ``evaluate`` / ``evaluate_holdout`` -> the trainer's batched versions (clients sharing a
  test set predicted together);
* ``privacy_status``: clients with identical privacy events are accounted once (the same
  figures; the PLD accountant costs ~20 ms per call, i.e. 20 s per round at 1000 clients);
* with ``share_frozen=True``, every client's frozen parameters (the projection with
  ``backbone.train_projection: false``) are pooled as each model is built
  (:class:`~protofl.engine.batched.FrozenParameterPool`), so 1000 clients hold one copy.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from protofl.config import ExperimentConfig
from protofl.engine.batched import BatchedTrainer, FrozenParameterPool
from protofl.engine.federated_data import FederatedData
from protofl.engine.simulation import Simulation
from protofl.methods.base import Upload
from protofl.models.backbones import BACKBONE_REGISTRY


@contextlib.contextmanager
def pooled_frozen_parameters(backbone: str) -> Iterator[FrozenParameterPool]:
    """While active, every client model the backbone builds has its frozen parameters pooled."""
    cls = BACKBONE_REGISTRY.get(backbone)
    own = cls.__dict__.get("client_model")
    build = cls.client_model  # bound to cls
    pool = FrozenParameterPool()

    def client_model(klass: Any, *args: Any, **kwargs: Any) -> Any:
        model = build(*args, **kwargs)
        pool.share(model)
        return model

    cls.client_model = classmethod(client_model)  # type: ignore[method-assign,assignment]
    try:
        yield pool
    finally:
        if own is None:
            del cls.client_model
        else:
            cls.client_model = own  # type: ignore[method-assign]


class HookedSimulation(Simulation):
    """Simulation with the batched upload/evaluation hooks wired (see module doc)."""

    def __init__(
        self, config: ExperimentConfig, data: FederatedData, *, share_frozen: bool = False
    ) -> None:
        if share_frozen:
            with pooled_frozen_parameters(config.backbone.name):
                super().__init__(config, data)
        else:
            super().__init__(config, data)
        self.upload_s: list[float] = []
        self.train_s: list[float] = []

    def _trainer(self) -> BatchedTrainer | None:
        if self.config.federation.execution != "batched":
            return None
        if self.batched is None:
            self.batched = BatchedTrainer(self)
        return self.batched if self.batched.supported else None

    def collect_uploads(self, active: Sequence[bool] | None = None) -> list[Upload]:
        t0 = time.perf_counter()
        bt = self._trainer()
        out = bt.collect_uploads(active) if bt else super().collect_uploads(active)
        self.upload_s.append(time.perf_counter() - t0)
        return out

    def train_active(self, clients: list[Any]) -> list[float]:
        t0 = time.perf_counter()
        out = super().train_active(clients)
        self.train_s.append(time.perf_counter() - t0)
        return out

    def evaluate(self) -> dict[str, float]:
        bt = self._trainer()
        return bt.evaluate() if bt else super().evaluate()

    def evaluate_holdout(self) -> float | None:
        bt = self._trainer()
        return bt.evaluate_holdout() if bt else super().evaluate_holdout()

    def privacy_status(self) -> dict[str, Any]:
        if not self.method.uses_prototypes:
            return super().privacy_status()
        memo: dict[str, float | None] = {}
        eps: dict[str, float | None] = {}
        for c in self.clients:
            key = json.dumps(c.ledger.events(), sort_keys=True)
            if key not in memo:
                memo[key] = c.ledger.epsilon_spent()
            eps[c.data.name] = memo[key]
        status: dict[str, Any] = {"epsilon_spent": eps}
        last = [r for r in self.releases[-1] if r is not None] if self.releases else []
        overlaps = [r.info["partition_overlap"] for r in last if "partition_overlap" in r.info]
        if overlaps:
            status["partition_overlap"] = float(np.mean(overlaps))
        return status
