"""FedRDN: statistics, their exchange through the server and the random normalisation by hand."""

from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from protofl.methods import create_method
from protofl.methods.base import ClientState, Upload
from protofl.methods.fedrdn import CLIENTS, MEAN, STD, draw, input_statistics, normalise
from protofl.methods.objectives import Group


def fedrdn(params: dict | None = None, seed: int = 0):
    return create_method("fedrdn", params, num_classes=2, num_domains=2, proto_dim=2, seed=seed)


def stats_upload(client: int, mean: list[float], std: list[float]) -> Upload:
    extras = {"mean": torch.tensor(mean), "std": torch.tensor(std)}
    return Upload(client=client, domain=0, release=None, num_samples=1, extras=extras)


BANK = [stats_upload(1, [2.0, 4.0], [1.0, 2.0]), stats_upload(0, [0.0, 0.0], [1.0, 1.0])]


class Passthrough(nn.Module):
    """(f, logits) = (z, z): two classes whose logits are the input itself."""

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return z, z


def test_statistics_by_hand() -> None:
    z = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    mu, sd = input_statistics(z, "per_dimension", 1e-5)
    assert mu.tolist() == [2.0, 4.0] and sd.tolist() == [1.0, 2.0]
    mu, sd = input_statistics(z, "scalar", 1e-5)  # over 1, 2, 3, 6: mean 3, var 14/4
    assert mu.tolist() == [3.0, 3.0] and sd.tolist() == pytest.approx([math.sqrt(3.5)] * 2)
    mu, sd = input_statistics(torch.ones(3, 2), "per_dimension", 1e-3)
    assert sd.tolist() == pytest.approx([1e-3, 1e-3])  # a constant input: sigma floored


def test_normalise_by_hand() -> None:
    out = normalise(torch.tensor([[3.0, 6.0]]), torch.tensor([2.0, 4.0]), torch.tensor([1.0, 2.0]))
    assert out.tolist() == [[1.0, 1.0]]


def test_statistics_travel_through_the_server() -> None:
    m, state = fedrdn(), ClientState()
    extras = m.upload_extras(
        Passthrough(), torch.tensor([[1.0, 2.0], [3.0, 6.0]]), torch.zeros(2), state, 0
    )  # type: ignore[arg-type]
    assert extras["mean"].tolist() == [2.0, 4.0] and extras["std"].tolist() == [1.0, 2.0]
    assert state.tensors[MEAN].tolist() == [2.0, 4.0]  # kept for the client's own inference
    gs = m.aggregate([*BANK, stats_upload(2, [1.0, 1.0], [0.0, 3.0])], 0)
    assert gs[CLIENTS].tolist() == [0, 1, 2]
    assert gs[MEAN].tolist() == [[0.0, 0.0], [2.0, 4.0], [1.0, 1.0]]
    assert gs[STD][2].tolist() == pytest.approx([1e-5, 3.0])  # a zero std is floored
    gs = m.aggregate([stats_upload(1, [9.0, 9.0], [1.0, 1.0])], 1)  # later rounds update rows
    assert gs[CLIENTS].tolist() == [0, 1, 2] and gs[MEAN][1].tolist() == [9.0, 9.0]


def test_draws_cover_the_federation_and_repeat_under_a_seed() -> None:
    m = fedrdn()
    gs = m.aggregate(BANK, 0)
    mu, _ = draw(gs, 0, True, 0, 200, step=0)
    rows = {tuple(r) for r in mu.tolist()}
    assert rows == {(0.0, 0.0), (2.0, 4.0)}  # include_self: the client's own pair too
    assert torch.equal(mu, draw(gs, 0, True, 0, 200, step=0)[0])
    assert not torch.equal(mu, draw(gs, 0, True, 0, 200, step=1)[0])
    assert not torch.equal(mu, draw(gs, 1, True, 0, 200, step=0)[0])
    mu, sd = draw(gs, 0, False, 0, 50, step=0)
    assert {tuple(r) for r in mu.tolist()} == {(2.0, 4.0)} and sd[0].tolist() == [1.0, 2.0]


def test_training_inputs_are_normalised_with_the_drawn_statistics() -> None:
    m = fedrdn({"include_self": False})
    gs = m.aggregate(BANK, 0)
    transform = m.objective().inputs
    assert transform is not None
    z = torch.tensor([[[3.0, 6.0]]])
    ok = torch.ones(1, 1, dtype=torch.bool)
    state = ClientState()
    prepared = transform.prepare(gs, Group([state], [0], 2, [0]))
    # client 0 draws client 1's (mu, sigma) = ((2, 4), (1, 2)): (3, 6) -> (1, 1)
    assert transform.train(z, ok, prepared, slice(0, 1), 0).tolist() == [[[1.0, 1.0]]]
    transform.finish(prepared, [3])
    assert int(state.tensors["fedrdn.step"]) == 3  # the draw counter advanced by the steps
    # the defining mechanism: before any statistics are shared the inputs are the raw ones
    prepared = transform.prepare({}, Group([ClientState()], [0], 2, [0]))
    assert torch.equal(transform.train(z, ok, prepared, slice(0, 1), 0), z)


def test_a_training_batch_draws_at_the_client_step_counter() -> None:
    m = fedrdn()
    gs = m.aggregate(BANK, 0)
    transform = m.objective().inputs
    state = ClientState()
    state.tensors["fedrdn.step"] = torch.tensor(7)
    z = torch.zeros(1, 40, 2)
    prepared = transform.prepare(gs, Group([state], [0], 2, [0]))
    out = transform.train(z, torch.ones(1, 40, dtype=torch.bool), prepared, slice(0, 1), 2)
    mu, sd = draw(gs, 0, True, 0, 40, step=9)
    assert torch.equal(out[0], (z[0] - mu) / sd)


def test_inference_normalises_with_own_or_federation_statistics() -> None:
    z = torch.tensor([[3.0, 5.0]])
    state = ClientState()
    state.tensors[MEAN], state.tensors[STD] = torch.tensor([0.0, 4.0]), torch.tensor([1.0, 1.0])
    gs = fedrdn().aggregate(BANK, 0)  # federation mean: mu (1, 2), sigma (1, 1.5)
    assert fedrdn().predict(Passthrough(), z, gs, state).tolist() == [0]  # (3, 1)
    fed = fedrdn({"eval_stats": "federation"})
    assert fed.predict(Passthrough(), z, gs, state).tolist() == [0]  # (2, 2): tie -> 0
    z = torch.tensor([[1.0, 8.0]])  # own: (1, 4) -> 1; federation: (0, 4) -> 1; raw -> 1
    assert fedrdn().predict(Passthrough(), z, gs, state).tolist() == [1]
    z = torch.tensor([[2.0, 5.5]])  # own: (2, 1.5) -> 0; federation: (1, 2.33) -> 1
    assert fedrdn().predict(Passthrough(), z, gs, state).tolist() == [0]
    assert fed.predict(Passthrough(), z, gs, state).tolist() == [1]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"include_self": "yes"}, "fedrdn.include_self='yes' must be true or false"),
        ({"eval_stats": "test"}, "fedrdn.eval_stats='test' must be local or federation"),
        ({"statistics": "channel"}, "fedrdn.statistics='channel' must be per_dimension or"),
        ({"eps": 0}, "fedrdn.eps=0 must be a number > 0"),
    ],
)
def test_bad_parameters_name_themselves(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        fedrdn(params)


def test_privacy_statement_names_the_statistics() -> None:
    from protofl.engine.federated_data import build_federated_data
    from protofl.engine.simulation import Simulation
    from protofl.methods.checks import tiny_config

    config = tiny_config("fedrdn", "vpdr", rounds=1)
    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulation(config, build_federated_data(config, Path(tmp)))
    sim.run()
    assert sim.global_state[CLIENTS].tolist() == [0, 1]  # both clients' statistics shared
    g = sim.guarantee()
    assert g["epsilon"] is None and not g["holds_against_server"]
    assert any(gap.startswith("input statistics") for gap in g["not_covered"])
