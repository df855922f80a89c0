"""The simulator's in-process secure sum (``privacy.mechanism: ddg``): the method sees one
decoded sum per group and never a client's release; the run's refusals come before anything
is made."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from protofl.engine.federated_data import build_federated_data
from protofl.engine.runner import run_experiment
from protofl.engine.simulation import Simulation
from protofl.methods.checks import tiny_config
from protofl.privacy.prototype import clip_l2


def _sim(method: str = "fedproto", *overrides: str, **params: Any) -> Simulation:
    cfg = tiny_config(method, "ddg", params, rounds=2, clients_per_domain=3)
    cfg = cfg.with_overrides(list(overrides))
    with tempfile.TemporaryDirectory() as tmp:
        data = build_federated_data(cfg, Path(tmp))
    return Simulation(cfg, data)


def _spy(sim: Simulation) -> list[list[Any]]:
    seen: list[list[Any]] = []
    aggregate = sim.method.aggregate

    def spy(uploads: Any, round_index: int) -> Any:
        seen.append(list(uploads))
        return aggregate(uploads, round_index)

    sim.method.aggregate = spy  # type: ignore[method-assign]
    return seen


def _true_means(sim: Simulation, clients: list[Any]) -> torch.Tensor:
    feats, labels = [], []
    for c in clients:
        c.model.eval()
        with torch.no_grad():
            f = sim.method.upload_features(c.model, c.data.train_z.float())
        feats.append(clip_l2(f.double(), sim.config.privacy.clip))
        labels.append(c.data.train_y)
    x, y = torch.cat(feats), torch.cat(labels)
    return torch.stack([x[y == k].mean(dim=0) for k in range(sim.data.num_classes)])


def test_fedproto_sees_one_decoded_sum_and_no_client_release() -> None:
    sim = _sim("fedproto", "privacy.epsilon=100000")  # noise at its floor
    seen = _spy(sim)
    truth = _true_means(sim, sim.clients)  # the first release is of the initial models
    sim.run_round()
    (uploads,) = seen
    with_release = [u for u in uploads if u.release is not None]
    assert [u.client for u in with_release] == [-1]  # the sum, from no single client
    assert all(r is None for r in sim.releases[0])  # the server kept no client's release
    got = sim.global_state["prototypes"].double()
    assert float((got - truth).abs().max()) < 1e-3
    eps = sim.privacy_status()["epsilon_spent"]
    assert len(eps) == 6 and all(0 < e < 100000 for e in eps.values())


def test_feddap_sums_each_domain_on_its_own() -> None:
    sim = _sim("feddap", "privacy.epsilon=100000", fusion="mean")
    seen = _spy(sim)
    by_domain = {d: [c for c in sim.clients if c.data.domain == d] for d in (0, 1)}
    truth = {d: _true_means(sim, cs) for d, cs in by_domain.items()}
    sim.run_round()
    sums = [u for u in seen[0] if u.release is not None]
    assert sorted(u.domain for u in sums) == [0, 1]
    gs = sim.global_state
    for d in (0, 1):
        rows = gs["domains"] == d
        got = gs["prototypes"][rows].double()
        assert float((got - truth[d][gs["classes"][rows]]).abs().max()) < 1e-3


def test_the_ledgers_spend_the_budget_over_the_run() -> None:
    sim = _sim("fedproto", "privacy.epsilon=2")
    sim.run()
    spent = sim.privacy_status()["epsilon_spent"]
    assert all(1.99 < e <= 2.0 for e in spent.values())
    assert "distributed DP (secure sums)" in sim.guarantee()["statement"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["method.name=fedpcl"], r"method 'fedpcl' needs each client's prototypes"),
        (["method.name=feddap"], r"feddap.s fusion: similarity .* set method.params.fusion=mean"),
        (["method.params.weighting=uniform"], r"fedproto needs aggregation: mean and weighting"),
        (["run.engine=flower"], r"run.engine=sim only .* SecAgg\+ is not built"),
        (["federation.dropout=0.2"], r"federation.dropout=0.2 .* federation.dropout=0"),
        (
            ["federation.participation=0.5", "privacy.release_schedule=once"],
            r"participation=0.5 with release_schedule=once",
        ),
    ],
)
def test_a_run_ddg_cannot_protect_is_refused_before_anything_is_made(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    cfg = tiny_config("fedproto", "ddg", rounds=1).with_overrides(overrides)
    out = tmp_path / "runs"
    with pytest.raises(ValueError, match=message):
        run_experiment(cfg, out=out, home=tmp_path)
    assert not out.exists() or not any(out.iterdir())


def test_a_dropout_threshold_the_federation_cannot_meet_is_refused(tmp_path: Path) -> None:
    cfg = tiny_config("fedproto", "ddg", rounds=1, clients_per_domain=2)
    cfg = cfg.with_overrides(["privacy.ddg_max_dropped=4"])
    out = tmp_path / "runs"
    with pytest.raises(ValueError, match=r"privacy.ddg_max_dropped=4 leaves no honest client"):
        run_experiment(cfg, out=out, home=tmp_path)
    assert not out.exists() or not any(out.iterdir())


def test_an_extended_ddg_run_composes_every_sum_at_the_recorded_calibration(
    tmp_path: Path,
) -> None:
    from protofl.engine.runner import extend_experiment
    from protofl.privacy.ddg_accounting import ddg_epsilon

    cfg = tiny_config("fedproto", "ddg", rounds=2, clients_per_domain=2)
    cfg = cfg.with_overrides(["privacy.epsilon=1", "run.progress=false"])
    first = run_experiment(cfg, out=tmp_path, home=tmp_path)
    facts = first.summary["privacy"]
    event = {
        "kind": "ddg",
        "l2": facts["l2_sensitivity"],
        "l1": facts["l1_sensitivity"],
        "sigma": facts["sigma_per_client"],
        "clients": facts["honest_clients"],
        "dim": facts["coords"],
    }
    assert ddg_epsilon([event] * 2, delta=1e-5) <= 1.0
    result = extend_experiment(first.run_dir, 2, progress=False)
    privacy = result.summary["privacy"]
    total = ddg_epsilon([event] * 4, delta=1e-5)
    assert privacy["epsilon"] == pytest.approx(total, rel=1e-9) and total > 1.0
    assert all(e == pytest.approx(total, rel=1e-9) for e in privacy["epsilon_spent"].values())
    statement = privacy["guarantee"]["statement"]
    assert statement.startswith(f"({total:g}, 1e-05)-distributed DP (secure sums)")
    assert "EXTENDED" in statement and "honest-but-curious" in statement
