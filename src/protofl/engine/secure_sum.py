"""The in-process secure sum of ``privacy.mechanism: ddg`` (:mod:`protofl.privacy.ddg`).

Under secure aggregation the server never sees a client's vector, only the sum; the simulator
computes the same sum in process (no cryptography, labelled as such in the guarantee) and hands
the method one upload per group (the whole federation for FedProto, one per domain for FedDAP)
instead of one per client.  These uploads carry a negative ``client`` id: they come from no
single client, so the server's per-client checks (:func:`~protofl.engine.round.validate_uploads`)
do not apply to them; the sum is checked when it is decoded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from protofl.methods.base import Method, Upload
from protofl.privacy.base import Mechanism, Release


def uses_secure_sum(mechanism: Mechanism) -> bool:
    """Whether ``mechanism`` releases shares of a secure sum (``ddg``)."""
    return bool(getattr(mechanism, "secure_sum_mechanism", False))


def bind_secure_sum(mechanism: Any, config: Any, method: Method, clients: Sequence[Any]) -> None:
    """Check the run (:meth:`DistributedDiscreteGaussian.check_run`) and calibrate the
    mechanism for this federation: each client's group (0, or its domain for a per-domain
    method), the clients of a round, the training examples (public counts)."""
    from protofl.privacy.ddg import Federation

    mechanism.check_run(config, method)
    if not method.uses_prototypes:
        return
    per_domain = method.secure_sum_groups() == "domain"
    domains = sorted({c.domain for c in clients})
    index = {d: i for i, d in enumerate(domains)}
    fed = config.federation
    per_round = len(clients)
    if fed.participation < 1:
        per_round = max(1, math.ceil(fed.participation * len(clients)))
    mechanism.bind(
        Federation(
            groups={c.name: index[c.domain] if per_domain else 0 for c in clients},
            num_groups=len(domains) if per_domain else 1,
            num_classes=method.num_classes,
            per_round=per_round,
            examples=sum(int(c.num_train) for c in clients),
        )
    )
    mechanism.group_domains = domains if per_domain else [-1]


def secure_uploads(mechanism: Any, shares: Sequence[Release]) -> list[Upload]:
    """The round's secure sum decoded, as one upload per group (``client`` -1 - group)."""
    out = []
    for group, release in mechanism.secure_sum(list(shares)):
        out.append(
            Upload(
                client=-1 - group,
                domain=int(mechanism.group_domains[group]),
                release=release,
                num_samples=int(release.counts.sum()),
            )
        )
    return out


__all__ = ["bind_secure_sum", "secure_uploads", "uses_secure_sum"]
