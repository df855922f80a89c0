"""A node's ledger per data partition, across runs: the budget the server cannot raise.

A client's per-run ledger starts empty with every run, and the server chooses the run's config:
three runs on the same deployed node, each calibrated to epsilon 1, release the same examples
six times (epsilon 1.835 composed) while each prints epsilon 1.  The node-side ledger closes
that: every release a node makes from one data partition is charged, before it leaves, to one
file per partition, **keyed by the data** (a digest of the partition's identity: data set,
domain, the indices of its training examples), not by the config, and composed with the
accountant at the node's own delta.  A release that would take the partition past the node's
budget is refused.

The budget and its delta come from the node's own configuration (a SuperNode's
``--node-config 'privacy-budget=2 privacy-budget-delta=1e-5'``): the server's run config cannot
set or raise them.  Without ``privacy-budget`` the node allows ``$PROTOFL_NODE_BUDGET`` (the
node's environment, also the operator's) or else :data:`DEFAULT_BUDGET`.

Files live in the node's ledger folder (``ledger-dir`` in the node config, else
``$PROTOFL_HOME/node-ledgers``), outside any run folder: the folder is created 0700, each file
written 0600 and replaced atomically.  The file holds DP events (what was released and
charged), never a noise key.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from protofl.privacy.ledger import PrivacyLedger

DEFAULT_BUDGET = 1.0
"""Epsilon a node allows per data partition, over all runs, without ``privacy-budget``."""
DEFAULT_DELTA = 1e-5
"""The node's delta without ``privacy-budget-delta``."""
BUDGET_KEY = "privacy-budget"
DELTA_KEY = "privacy-budget-delta"
DIR_KEY = "ledger-dir"
BUDGET_ENV = "PROTOFL_NODE_BUDGET"
"""Environment variable with the node's budget when its node config sets none."""


class BudgetExceeded(RuntimeError):
    """A release that would take a data partition past the node's budget."""


def data_fingerprint(dataset: str, domain: str, train_indices: np.ndarray) -> str:
    """A digest naming one client's training data: the data set, the domain and the indices
    of its training examples (the same examples give the same digest, whatever the config)."""
    h = hashlib.sha256()
    h.update(f"{dataset}\0{domain}\0".encode())
    h.update(np.ascontiguousarray(np.asarray(train_indices, dtype=np.int64)).tobytes())
    return h.hexdigest()[:32]


def _float(node_config: Mapping[str, Any], key: str, default: float) -> float:
    raw = node_config.get(key, default)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"node config {key}={raw!r} is not a number") from None
    if not value > 0 or (key == DELTA_KEY and not value < 1):
        allowed = "(0, 1)" if key == DELTA_KEY else "> 0"
        raise ValueError(f"node config {key}={raw!r} is out of range; allowed: {allowed}")
    return value


class NodeLedger:
    """The ledger of one data partition on one node, persisted in ``folder``."""

    def __init__(
        self, folder: Path, fingerprint: str, *, budget: float, delta: float, accountant: str
    ) -> None:
        self.path = Path(folder) / f"ledger-{fingerprint}.json"
        self.fingerprint = fingerprint
        self.budget = budget
        self.delta = delta
        self.accountant = accountant

    @classmethod
    def for_node(
        cls,
        node_config: Mapping[str, Any],
        fingerprint: str,
        *,
        accountant: str,
        default_folder: Path,
    ) -> NodeLedger:
        """The ledger named by the node's own config (budget, delta, folder)."""
        folder = Path(str(node_config.get(DIR_KEY, "") or default_folder))
        return cls(
            folder,
            fingerprint,
            budget=_float(
                node_config, BUDGET_KEY, float(os.environ.get(BUDGET_ENV) or DEFAULT_BUDGET)
            ),
            delta=_float(node_config, DELTA_KEY, DEFAULT_DELTA),
            accountant=accountant,
        )

    def entries(self) -> list[dict[str, Any]]:
        """Every charge so far: ``{"run", "round", "mechanism", "events"}``."""
        if not self.path.exists():
            return []
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{self.path}: the node ledger cannot be read ({exc})") from exc
        if data.get("data") != self.fingerprint:
            raise ValueError(f"{self.path}: the node ledger belongs to other data")
        return list(data["entries"])

    def _ledger(self, entries: Sequence[Mapping[str, Any]]) -> PrivacyLedger:
        ledger = PrivacyLedger(delta=self.delta, accountant=self.accountant)
        for e in entries:
            ledger.charge(int(e["round"]), str(e["mechanism"]), e["events"])
        return ledger

    def epsilon_spent(self) -> float:
        """Epsilon at the node's delta of every release charged to this partition."""
        eps = self._ledger(self.entries()).epsilon_spent()
        return 0.0 if eps is None else float(eps)

    def charge(
        self, run: str, round_index: int, mechanism: str, events: Sequence[Mapping[str, Any]]
    ) -> float:
        """Charge one release before it leaves; refuse (:class:`BudgetExceeded`, nothing
        written) if the partition's composed epsilon would pass the budget.  Returns the
        epsilon spent after it."""
        entries = self.entries()
        entry = {
            "run": run,
            "round": int(round_index),
            "mechanism": mechanism,
            "events": [dict(e) for e in events],
        }
        ledger = self._ledger([*entries, entry])
        eps = ledger.epsilon_spent()
        if eps is None:
            raise BudgetExceeded(
                f"node ledger {self.path.name}: a release without a guarantee ({mechanism}) "
                "is refused on a node that keeps a budget"
            )
        if eps > self.budget * (1 + 1e-9):
            before = self._ledger(entries).epsilon_spent() or 0.0
            raise BudgetExceeded(
                f"this node's budget for its data is epsilon {self.budget:g} at delta "
                f"{self.delta:g} (node config {BUDGET_KEY}); {len(entries)} earlier release(s) "
                f"of the same data spent {before:.4g}, this one would bring it to {eps:.4g}: "
                "refused (the server's config cannot raise a node's budget)"
            )
        self._write([*entries, entry])
        return float(eps)

    def _write(self, entries: list[dict[str, Any]]) -> None:
        folder = self.path.parent
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"data": self.fingerprint, "delta": self.delta, "entries": entries}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)


__all__ = [
    "BUDGET_ENV",
    "BUDGET_KEY",
    "DEFAULT_BUDGET",
    "DEFAULT_DELTA",
    "DELTA_KEY",
    "DIR_KEY",
    "BudgetExceeded",
    "NodeLedger",
    "data_fingerprint",
]
