"""``PrivateClient``: one client's private-release state, the one home of its privacy assembly.

Every place a client releases prototypes builds one: the in-process simulator
(:class:`protofl.engine.simulation.Client`), the Flower client app (one per partition it
serves) and the plug-in facade (:class:`protofl.privacy.facade.PrototypePrivacy` is a thin
constructor over it).  It holds:

* the calibrated mechanism it releases through (calibration is per run, so a simulation's
  clients share one instance; what the mechanism remembers per client, its release counter and
  VPP's cached partition or release history, is keyed by the client's name and read and
  restored through :meth:`mechanism_state` / :meth:`load_mechanism_state`);
* its noise key (:class:`~protofl.privacy.noise.NoiseKey`): a secret key never leaves the
  object, :meth:`state_dict` records only its mode and draw count;
* its ledger (:class:`~protofl.privacy.ledger.PrivacyLedger`), charged with every release
  before the release is returned;
* its DCR hooks (:class:`~protofl.privacy.dcr.DCR`, no privacy cost) when the mechanism uses
  them;
* its release limit: the mechanism refuses a release past the ``rounds`` it was calibrated for
  (:meth:`releases_left`);
* its release schedule (``privacy.release_schedule``): with ``once`` the first release is the
  only one charged and drawn, and every later call returns that same release (re-sending a
  released value is post-processing: it costs nothing and draws nothing).

:func:`release_many` releases several clients that share a mechanism at once (the vectorised
path of batched execution), with the same draws and the same ledger entries as one
:meth:`PrivateClient.release` each.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from protofl.privacy.base import ClusterFn, Mechanism, Release
from protofl.privacy.config import PrivacyConfig
from protofl.privacy.dcr import DCR
from protofl.privacy.ledger import PrivacyLedger
from protofl.privacy.noise import NoiseKey, restore_noise_key


class PrivateClient:
    """The mechanism, noise key, ledger, DCR and release limit of ONE client named ``name``.

    ``mechanism`` is the run's calibrated mechanism (shared by the clients of one process);
    ``key`` the client's noise key (:func:`~protofl.privacy.noise.noise_key`); ``head``, when
    the mechanism uses DCR, the classifier head the DCR teacher starts from (None: no DCR, or
    :meth:`attach_dcr` later).
    """

    def __init__(
        self,
        config: PrivacyConfig,
        *,
        mechanism: Mechanism,
        key: NoiseKey,
        name: str,
        head: nn.Module | None = None,
    ) -> None:
        self.config = config
        self.mechanism = mechanism
        self.key = key
        self.name = name
        self.ledger = PrivacyLedger(delta=config.delta, accountant=config.accountant)
        self.dcr: DCR | None = None
        # release_schedule=once: the one release made, re-sent by every later call
        self.sent: Release | None = None
        if head is not None:
            self.attach_dcr(head)

    # ----- DCR ------------------------------------------------------------------------------------
    def attach_dcr(self, head: nn.Module) -> DCR | None:
        """The DCR hooks for ``head`` (made once; None unless the mechanism uses DCR)."""
        if self.config.use_dcr and self.dcr is None:
            self.dcr = DCR(self.config, head)
        return self.dcr

    # ----- releasing ------------------------------------------------------------------------------
    @property
    def is_private(self) -> bool:
        """Whether the releases carry a guarantee (not ``privacy.mechanism: none``)."""
        return self.mechanism.is_private

    def releases_left(self) -> int | None:
        """How many more releases the calibrated budget covers (None: no limit, the mechanism
        carries no guarantee)."""
        left = getattr(self.mechanism, "releases_left", None)
        return None if left is None else int(left(self.name))

    def release(
        self,
        features: torch.Tensor,
        labels: torch.Tensor,
        *,
        num_classes: int,
        round_index: int | None = None,
        cluster_fn: ClusterFn | None = None,
    ) -> Release:
        """Clip, average per class, add the calibrated noise from this client's key; the ledger
        is charged (entry ``round_index``, default the release's index) before it is returned.
        Past the release limit the mechanism refuses, before any draw.  With
        ``release_schedule: once``, a client that has released returns that release again
        (nothing drawn, nothing charged)."""
        if self.sent is not None:
            return self.sent
        index = len(self.ledger.entries) if round_index is None else round_index
        out = self.mechanism.release(
            features,
            labels,
            num_classes=num_classes,
            generator=self.key,
            client=self.name,
            cluster_fn=cluster_fn,
        )
        self.ledger.record(index, out)
        self._keep(out)
        return out

    def _keep(self, release: Release) -> None:
        if self.config.release_schedule == "once":
            self.sent = release

    def epsilon_spent(self) -> float | None:
        """Epsilon at the configured delta of every release so far (None without a
        guarantee)."""
        return self.ledger.epsilon_spent()

    # ----- state ----------------------------------------------------------------------------------
    def mechanism_state(self) -> Any:
        """The mechanism's state restricted to this client's entries (keyed by its name)."""
        return own_entries(self.mechanism.state_dict(), self.name)

    def load_mechanism_state(self, state: Any, *, alone: bool = False) -> None:
        """Restore this client's entries of the mechanism from :meth:`mechanism_state`; the
        other clients' entries stay, unless ``alone`` (a process that serves one client at a
        time keeps only the one it serves)."""
        if alone or not isinstance(state, dict):
            self.mechanism.load_state_dict(state)
            return
        merged = self.mechanism.state_dict()
        for k, v in state.items():
            if isinstance(v, dict):
                entries = {c: e for c, e in dict(merged.get(k, {})).items() if c != self.name}
                merged[k] = {**entries, **v}
            else:
                merged[k] = v
        self.mechanism.load_state_dict(merged)

    def state_dict(self, *, mechanism: bool = False) -> dict[str, Any]:
        """``ledger``, ``noise_gen`` (the key's mode and draw count; never a secret key),
        ``dcr`` (the teacher) and, with ``mechanism``, this client's mechanism entries.  A
        copy: later releases do not change it."""
        state: dict[str, Any] = {
            "ledger": self.ledger.state_dict(),
            "noise_gen": self.key.state_dict(),
            "dcr": None if self.dcr is None else self.dcr.state_dict(),
            "sent": None if self.sent is None else dataclasses.asdict(self.sent),
        }
        if mechanism:
            state["mechanism"] = copy.deepcopy(self.mechanism_state())
        return state

    def load_state_dict(
        self, state: dict[str, Any], *, where: str = "the saved state", alone: bool = False
    ) -> None:
        """Inverse of :meth:`state_dict`.  A secret key is never read back: the client keeps
        its own key (or draws a fresh one), so restored noise is never replayed."""
        self.ledger.load_state_dict(state["ledger"])
        self.key = restore_noise_key(self.key, state["noise_gen"], where=where)
        if self.dcr is not None:
            if state.get("dcr") is None:
                raise ValueError(f"{where}: client {self.name!r} has DCR but the state has none")
            self.dcr.load_state_dict(state["dcr"])
        sent = state.get("sent")
        self.sent = None if sent is None else Release(**sent)
        if "mechanism" in state:
            self.load_mechanism_state(state["mechanism"], alone=alone)


def own_entries(state: Any, name: str) -> Any:
    """A mechanism state restricted to one client's entries (its state is keyed by name)."""
    if not isinstance(state, dict):
        return state
    return {
        k: ({name: v[name]} if name in v else {}) if isinstance(v, dict) else v
        for k, v in state.items()
    }


def release_many(
    clients: Sequence[PrivateClient],
    features: Sequence[torch.Tensor],
    labels: Sequence[torch.Tensor],
    *,
    num_classes: int,
    round_index: int,
    cluster_fn: ClusterFn | None = None,
    vectorise: bool = True,
) -> list[Release]:
    """One release of each of ``clients`` (which share one mechanism), vectorised when the
    mechanism can (:meth:`~protofl.privacy.base.Mechanism.release_many`): the same draws from
    each client's key and the same ledger entries as :meth:`PrivateClient.release` each
    (with ``release_schedule: once``, a client that has released re-sends that release)."""
    if not clients:
        return []
    mechanism = clients[0].mechanism
    if any(c.mechanism is not mechanism for c in clients):
        raise ValueError("release_many needs clients that share one calibrated mechanism")
    fresh = [i for i, c in enumerate(clients) if c.sent is None]
    released = (
        mechanism.release_many(
            [features[i] for i in fresh],
            [labels[i] for i in fresh],
            num_classes=num_classes,
            generators=[clients[i].key for i in fresh],
            clients=[clients[i].name for i in fresh],
            cluster_fn=cluster_fn,
            vectorise=vectorise,
        )
        if fresh
        else []
    )
    out: list[Release | None] = [c.sent for c in clients]
    for i, release in zip(fresh, released):
        clients[i].ledger.record(round_index, release)
        clients[i]._keep(release)
        out[i] = release
    return [r for r in out if r is not None]


__all__ = ["PrivateClient", "own_entries", "release_many"]
