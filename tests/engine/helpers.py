"""Helpers shared by the engine tests."""

from __future__ import annotations

import pytest


def stop_in_round(patch: pytest.MonkeyPatch, stop: int) -> None:
    """Make every Simulation raise KeyboardInterrupt (a Ctrl-C) as round ``stop`` (1-based)
    starts, under ``patch`` (a ``monkeypatch.context()``)."""
    from protofl.engine import simulation

    original = simulation.Simulation.run_round

    def interrupted(self: simulation.Simulation) -> simulation.RoundMetrics:
        if self.round == stop - 1:
            raise KeyboardInterrupt
        return original(self)

    patch.setattr(simulation.Simulation, "run_round", interrupted)
