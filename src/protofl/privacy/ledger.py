"""Per-client privacy ledger: what a client has released so far, and the epsilon it has spent."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from protofl.privacy.accounting import check_accountant, split_events
from protofl.privacy.base import Release


class PrivacyLedger:
    """Records every release's DP events; ``epsilon_spent`` composes them (None if no guarantee).

    One ledger belongs to one client.  Events are JSON-safe dicts (see
    :mod:`protofl.privacy.accounting`); all recorded events are composed with the ledger's
    accountant at its delta.
    """

    def __init__(self, *, delta: float, accountant: str = "pld") -> None:
        if not 0 < delta < 1:
            raise ValueError(f"delta={delta!r} is out of range; allowed: (0, 1)")
        check_accountant(accountant)
        self.delta = delta
        self.accountant = accountant
        self.entries: list[dict[str, Any]] = []
        self.private = True
        self._cache: tuple[int, float] | None = None

    def record(self, round_index: int, release: Release) -> None:
        """Charge one release made in ``round_index`` (the events it carries)."""
        self.charge(round_index, release.mechanism, release.events)

    def charge(self, round_index: int, mechanism: str, events: Sequence[Mapping[str, Any]]) -> None:
        """Charge ``events`` of a ``mechanism`` release in ``round_index`` (a server charges the
        events its own mechanism says a release costs, whatever the client declared)."""
        if mechanism == "none":
            self.private = False
        copied = [dict(e) for e in events]
        split_events(copied)  # validate now, not at the end of the run
        self.entries.append({"round": round_index, "events": copied})

    def events(self) -> list[dict[str, Any]]:
        """Every recorded event, in order."""
        return [e for entry in self.entries for e in entry["events"]]

    def epsilon_spent(self) -> float | None:
        """Epsilon at ``delta`` for everything recorded; None when a release had no guarantee."""
        if not self.private:
            return None
        events = self.events()
        if not events:
            return 0.0
        if self._cache is not None and self._cache[0] == len(events):
            return self._cache[1]
        from protofl.privacy.accounting import epsilon_spent

        eps = epsilon_spent(events, delta=self.delta, accountant=self.accountant)
        self._cache = (len(events), eps)
        return eps

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state: a copy (later releases do not change a saved state)."""
        return {
            "delta": self.delta,
            "accountant": self.accountant,
            "entries": copy.deepcopy(self.entries),
            "private": self.private,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict``."""
        self.delta = state["delta"]
        self.accountant = state["accountant"]
        self.entries = copy.deepcopy(list(state["entries"]))
        self.private = state["private"]
        self._cache = None
