"""``check_method`` for every registered method x mechanism, and proof that its meaning checks
fail on methods broken on purpose."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import protofl.methods  # noqa: F401  (registers every method)
from protofl.engine.method_checks import check_method
from protofl.methods.base import METHOD_REGISTRY, Batch, ClientState, GlobalState, Method, Upload
from protofl.methods.feddap import FedDAP
from protofl.methods.fedproto import FedProto
from protofl.methods.fpl import FPL
from protofl.privacy.base import MECHANISM_REGISTRY

FAST = {"fedtgp": {"server_epochs": 20}}  # fewer server epochs than the default, for speed
# the toy set's pixel features have constant dimensions whose standard deviation sits at
# FedRDN's floor (docs/methods.md, FedRDN): normalised with another client's per-dimension
# statistics they are ~1e5 too large, and with DCR's soft clip on the normalised forward pass
# (the model's input) three rounds do not bring the loss down; scalar statistics do
PARAMS = {("fedrdn", "vpdr"): {"statistics": "scalar"}}


@pytest.mark.parametrize("mechanism", MECHANISM_REGISTRY.names())
@pytest.mark.parametrize("name", METHOD_REGISTRY.names())
def test_every_registered_method_passes_with_every_mechanism(name: str, mechanism: str) -> None:
    params = PARAMS.get((name, mechanism), FAST.get(name))
    if mechanism == "ddg":
        method = METHOD_REGISTRY.get(name)
        params = {**(params or {}), **SECURE_SUM.get(name, {})}
        if method.uses_prototypes and name not in SECURE_SUM:
            # a server that needs each client's prototypes is refused, with the reason
            with pytest.raises(ValueError, match=r"privacy.mechanism=ddg.*"):
                check_method(name, mechanism, params)
            return
    report = check_method(name, mechanism, params)
    assert report.losses[-1] < report.losses[0]


# the methods whose server needs only sums (privacy.mechanism=ddg), with the settings that make
# it so; every other prototype method is refused
SECURE_SUM: dict[str, dict[str, Any]] = {"fedproto": {}, "feddap": {"fusion": "mean"}}


# ----- broken on purpose -----------------------------------------------------------------------
@contextmanager
def registered(name: str, cls: type[Method]) -> Iterator[None]:
    METHOD_REGISTRY.add(name, cls)
    try:
        yield
    finally:
        METHOD_REGISTRY._items.pop(name)


class IgnoresUploads(FedProto):
    """The server's state is a constant, whatever the clients sent."""

    def aggregate(self, uploads: Sequence[Upload], round_index: int) -> GlobalState:
        return {
            "prototypes": torch.zeros(self.num_classes, self.proto_dim),
            "classes": torch.arange(self.num_classes),
        }


class FPLWithoutPrototypeTerms(FPL):
    """FPL whose local objective lost its prototype terms (cross-entropy only)."""

    def client_loss(
        self, batch: Batch, global_state: GlobalState, state: ClientState
    ) -> torch.Tensor:
        return F.cross_entropy(batch.logits, batch.y)


class FedDAPWithoutDomains(FedDAP):
    """FedDAP whose server pools every domain's uploads into domain 0."""

    def aggregate(self, uploads: Sequence[Upload], round_index: int) -> GlobalState:
        from dataclasses import replace

        return super().aggregate([replace(u, domain=0) for u in uploads], round_index)


class FedDAPSwappedDomains(FedDAP):
    """FedDAP whose server files every upload under the next domain (the domain sets swapped)."""

    def aggregate(self, uploads: Sequence[Upload], round_index: int) -> GlobalState:
        from dataclasses import replace

        domains = sorted({u.domain for u in uploads})
        shift = {d: domains[(i + 1) % len(domains)] for i, d in enumerate(domains)}
        return super().aggregate([replace(u, domain=shift[u.domain]) for u in uploads], round_index)


class BatchedDisagrees(FedProto):
    """Declares FedProto's objective for the batched executor but trains with another one."""

    def objective(self) -> Any:
        return super().objective()

    def client_loss(
        self, batch: Batch, global_state: GlobalState, state: ClientState
    ) -> torch.Tensor:
        return 1.5 * super().client_loss(batch, global_state, state)


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (IgnoresUploads, "does not depend on the uploads"),
        (FPLWithoutPrototypeTerms, "do not pull features toward their targets"),
        (FedDAPWithoutDomains, "does not keep the uploads' domains"),
        (FedDAPSwappedDomains, "is not built from that domain's uploads"),
        (BatchedDisagrees, "batched and per-client training differ"),
    ],
)
def test_the_meaning_checks_fail_on_broken_methods(cls: type[Method], message: str) -> None:
    with registered("broken", cls), pytest.raises(AssertionError, match=message):
        check_method("broken", "none")


def test_a_subclass_that_changes_the_loss_does_not_inherit_a_batched_objective() -> None:
    m = FPLWithoutPrototypeTerms(None, num_classes=2, num_domains=1, proto_dim=2)
    assert not m.batchable
    assert BatchedDisagrees(None, num_classes=2, num_domains=1, proto_dim=2).batchable
