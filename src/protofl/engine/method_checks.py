"""``check_method``: the conformance suite every registered method passes with every mechanism.

Mechanics (finite and falling loss, determinism, state round-trips, upload shapes) and meaning:

* the server's state depends on the uploads (a server that ignores them fails);
* a method whose global state is keyed by domain keeps the uploads' domains (permuting the
  domains of the uploads changes the global state, and every (class, domain) row published
  under ``domains`` points along what that domain uploaded);
* the prototype terms pull a client's features toward the targets the server sent: the part of
  the loss gradient that the global prototypes cause points from the features to them;
* a method that declares a batched objective gives the same run batched and client by client.

The set-up has several domains and several clients per domain
(:func:`protofl.methods.checks.tiny_config`).
"""

from __future__ import annotations

import copy
import io
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from protofl.config import ExperimentConfig
from protofl.engine.federated_data import build_federated_data
from protofl.engine.secure_sum import uses_secure_sum
from protofl.engine.simulation import RoundMetrics, Simulation
from protofl.methods.base import Batch, Upload
from protofl.methods.checks import tiny_config
from protofl.privacy.base import Release


@dataclass
class CheckReport:
    """What ``check_method`` measured (it raises AssertionError on the first failure)."""

    method: str
    mechanism: str
    losses: list[float]
    avg_acc: list[float]


def run_tiny(config: ExperimentConfig) -> tuple[Simulation, list[RoundMetrics]]:
    """Build and run ``config`` in process; (simulation, history)."""
    with tempfile.TemporaryDirectory() as tmp:
        data = build_federated_data(config, Path(tmp))
    sim = Simulation(config, data)
    return sim, sim.run()


def check_method(
    name: str, mechanism: str = "none", params: dict[str, Any] | None = None
) -> CheckReport:
    """Run a method for a few tiny rounds and assert the contract.

    Finite losses; training loss lower at the end than in the first round; identical metrics
    for the same seed; server and client state round-trip through ``torch.save``; every
    upload carries prototypes, classes and counts consistent with the client's data.
    """
    config = tiny_config(name, mechanism, params, clients_per_domain=2)
    sim, hist = run_tiny(config)
    losses = [h.train_loss for h in hist]
    assert all(math.isfinite(v) for v in losses), f"{name}/{mechanism}: non-finite loss {losses}"
    assert losses[-1] < losses[0], f"{name}/{mechanism}: training loss did not go down {losses}"
    assert all(0.0 <= h.avg_acc <= 1.0 for h in hist)

    _, hist2 = run_tiny(config)
    a = [h.to_json() | {"wall_s": 0} for h in hist]
    b = [h.to_json() | {"wall_s": 0} for h in hist2]
    assert a == b, f"{name}/{mechanism}: two runs with the same seed differ"

    # uploads carry exactly the declared prototypes and counts
    for round_releases in sim.releases:
        for client, release in zip(sim.clients, round_releases):
            if not sim.method.uses_prototypes or uses_secure_sum(sim.mechanism):
                # ddg: the server sees only the secure sum, never one client's release
                assert release is None
                continue
            assert release is not None
            k = release.num_prototypes
            assert release.prototypes.shape[1] == config.backbone.proto_dim
            assert release.classes.shape == (k,) and release.counts.shape == (k,)
            labels = client.data.train_y
            for c in torch.unique(release.classes).tolist():
                got = int(release.counts[release.classes == c].sum())
                assert got == int((labels == c).sum()), f"{name}: class {c} count mismatch"
            assert set(release.classes.tolist()) == set(labels.unique().tolist())
            assert torch.isfinite(release.prototypes).all()

    # server and client state round-trip
    buf = io.BytesIO()
    torch.save(
        {
            "server": sim.method.state_dict(),
            "clients": [c.state.tensors for c in sim.clients],
            "global": sim.global_state,
        },
        buf,
    )
    buf.seek(0)
    restored = torch.load(buf, weights_only=True)
    fresh = type(sim.method)(
        config.method.params,
        num_classes=sim.method.num_classes,
        num_domains=sim.method.num_domains,
        proto_dim=sim.method.proto_dim,
    )
    fresh.load_state_dict(restored["server"])
    _assert_same(fresh.state_dict(), sim.method.state_dict(), f"{name}: server state")
    for saved, c in zip(restored["clients"], sim.clients):
        _assert_same(saved, c.state.tensors, f"{name}: client state")
    _assert_same(restored["global"], sim.global_state, f"{name}: global state")
    check_semantics(sim, f"{name}/{mechanism}")
    if sim.method.batchable:
        check_batched_agrees(config, hist, f"{name}/{mechanism}")
    return CheckReport(name, mechanism, losses, [h.avg_acc for h in hist])


# ----- meaning -----------------------------------------------------------------------------------
def _uploads(sim: Any, targets: torch.Tensor, domain_sign: dict[int, float]) -> list[Any]:
    """One synthetic noiseless upload per client: class c's prototype is ``targets[c]`` times
    the sign given for the client's domain (1 for domains not named)."""
    k = targets.shape[0]
    out = []
    for c in sim.clients:
        sign = domain_sign.get(c.data.domain, 1.0)
        release = Release(
            prototypes=sign * targets,
            classes=torch.arange(k),
            counts=torch.full((k,), 10),
            sensitivity=torch.full((k,), math.inf),
            noise_std=torch.zeros_like(targets),
            mechanism="none",
        )
        out.append(Upload(c.data.client, c.data.domain, release, num_samples=10 * k))
    return out


def _aggregate(sim: Any, uploads: list[Any]) -> dict[str, torch.Tensor]:
    method = copy.deepcopy(sim.method)  # aggregation may train server state (FedTGP, MPFT)
    return dict(method.aggregate(uploads, sim.round))


def _differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if set(a) != set(b):
        return True
    return any(
        a[k].shape != b[k].shape or not torch.allclose(a[k].double(), b[k].double(), atol=1e-6)
        for k in a
        if isinstance(a[k], torch.Tensor)
    )


def _feature_grad(sim: Any, client: Any, gs: dict[str, torch.Tensor]) -> torch.Tensor:
    """d(client_loss)/d(f) on a batch of the client's data, with global state ``gs``."""
    method = copy.deepcopy(sim.method)
    model = copy.deepcopy(client.model)
    state = copy.deepcopy(client.state)
    method.begin_local(model, state, gs, client.data.client)
    z, y = client.data.train_z[:64].float(), client.data.train_y[:64]
    f = model.features(z).detach().requires_grad_(True)
    batch = Batch(z, y, f, f, model.head(f), model, client.data.client, client.data.domain)
    (g,) = torch.autograd.grad(method.client_loss(batch, gs, state), f)
    return g


def _targets(sim: Any) -> torch.Tensor:
    """Per-class target prototypes far from the features, in random directions."""
    c = sim.clients[0]
    with torch.no_grad():
        scale = 3.0 * float(c.model.features(c.data.train_z.float()).norm(dim=1).mean())
    gen = torch.Generator().manual_seed(1234)
    t = torch.randn(sim.data.num_classes, sim.config.backbone.proto_dim, generator=gen)
    return scale * t / t.norm(dim=1, keepdim=True)


def check_semantics(sim: Any, what: str) -> None:
    """The meaning checks of the module doc, on a finished tiny run ``sim``."""
    method = sim.method
    if not method.uses_prototypes:
        return
    t = _targets(sim)
    plus, minus = _aggregate(sim, _uploads(sim, t, {})), _aggregate(sim, _uploads(sim, -t, {}))
    assert _differs(plus, minus), f"{what}: the server state does not depend on the uploads"
    domains = sorted({c.data.domain for c in sim.clients})
    if method.needs_domain and len(domains) > 1:
        split = _aggregate(sim, _uploads(sim, t, {domains[0]: -1.0}))
        swapped = _aggregate(sim, _uploads(sim, t, {domains[1]: -1.0}))
        assert _differs(split, swapped), (
            f"{what}: the global state does not keep the uploads' domains"
        )
        if "domains" in split:  # a state keyed by domain says which domain each row came from
            _assert_domains_kept(split, t, domains[0], what)
    # the prototype terms: the gradient the targets cause points from the features to them
    client = sim.clients[0]
    y = client.data.train_y[:64]
    pulled = _feature_grad(sim, client, minus) - _feature_grad(sim, client, plus)
    toward = (pulled * (t[y] - (-t[y]))).sum()
    assert float(toward) > 0, (
        f"{what}: the prototype terms do not pull features toward their targets "
        f"(alignment {float(toward):.3g})"
    )


def _assert_domains_kept(
    state: dict[str, torch.Tensor], t: torch.Tensor, flipped: int, what: str
) -> None:
    """Every (class, domain) row of ``state`` points along what that domain uploaded for that
    class: ``-t[c]`` from domain ``flipped``, ``+t[c]`` from the others."""
    for proto, c, d in zip(state["prototypes"], state["classes"].tolist(), state["domains"]):
        sign = -1.0 if int(d) == flipped else 1.0
        assert float(proto.double() @ (sign * t[c]).double()) > 0, (
            f"{what}: the global prototype of class {c}, domain {int(d)} is not built from "
            "that domain's uploads"
        )


def check_batched_agrees(config: ExperimentConfig, sequential: list[Any], what: str) -> None:
    """The batched executor runs the method's declared objective: the same run as client by
    client (accuracies equal, training losses within float rounding)."""
    batched_cfg = config.with_overrides(["federation.execution=batched"])
    sim, hist = run_tiny(batched_cfg)
    assert sim.batched is not None and sim.batched.supported, (
        f"{what}: the method declares a batched objective but the batched executor refused it"
    )
    # float-rounding differences of the batched products grow through the rounds where the
    # server's aggregation is discontinuous (FPL's FINCH on noisy VPP uploads: 1.5e-4 after
    # two rounds with some noise draws); an objective that differs is off by far more
    for a, b in zip(sequential, hist):
        assert abs(a.train_loss - b.train_loss) < 5e-4 * max(1.0, abs(a.train_loss)), (
            f"{what}: batched and per-client training differ in round {a.round} "
            f"({a.train_loss!r} vs {b.train_loss!r})"
        )
        assert abs(a.avg_acc - b.avg_acc) < 0.02, (
            f"{what}: batched and per-client accuracy differ in round {a.round}"
        )


def _assert_same(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert set(a) == set(b), f"{what}: keys differ"
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f"{what}: {k} differs after round-trip"
        elif isinstance(x, dict):
            _assert_same(x, y, f"{what}.{k}")
        else:
            assert x == y, f"{what}: {k} differs after round-trip"
