"""``protofl.engine.round``: the server side of a round, shared by every engine."""

from __future__ import annotations

import pytest
import torch

from protofl.config import ConfigError, ExperimentConfig
from protofl.engine.round import average_weights, round_metrics, select_participants


def test_mean_is_sample_weighted_and_robust_rules_ignore_counts() -> None:
    states = [
        {"w": torch.tensor([1.0, 0.0])},
        {"w": torch.tensor([3.0, 2.0])},
        {"w": torch.tensor([100.0, -50.0])},
    ]
    mean = average_weights(states, [1, 1, 2])
    assert torch.allclose(mean["w"], torch.tensor([51.0, -24.5]))
    # a hostile client with a huge claimed count owns the mean, not the median or trimmed mean
    hostile = average_weights(states, [1, 1, 10**9])
    assert torch.allclose(hostile["w"], torch.tensor([100.0, -50.0]), atol=1e-6)
    assert torch.equal(
        average_weights(states, [1, 1, 10**9], rule="median")["w"], torch.tensor([3.0, 0.0])
    )
    trimmed = average_weights(states, [1, 1, 1], rule="trimmed_mean", trim_ratio=0.34)
    assert torch.equal(trimmed["w"], torch.tensor([3.0, 0.0]))


def test_unknown_weight_rule_is_named() -> None:
    with pytest.raises(ValueError, match="weight_aggregation='mode'"):
        average_weights([{"w": torch.ones(1)}], [1], rule="mode")
    with pytest.raises(ConfigError, match=r"federation\.weight_aggregation"):
        ExperimentConfig().with_overrides(["federation.weight_aggregation=mode"])


def test_selection_is_the_seeded_draw_and_metrics_average_domains() -> None:
    fed = ExperimentConfig().with_overrides(["federation.participation=0.5"]).federation
    a = select_participants(fed, 10, torch.Generator().manual_seed(3))
    b = select_participants(fed, 10, torch.Generator().manual_seed(3))
    assert a == b and sum(a) == 5
    m = round_metrics(
        round_number=1,
        client_acc={"a0": 0.5, "a1": 1.0, "b0": 0.25},
        domain_of={"a0": "a", "a1": "a", "b0": "b"},
        losses=[1.0, 3.0],
        wall_s=0.0,
        privacy={},
    )
    assert m.acc == {"a": 0.75, "b": 0.25} and m.avg_acc == 0.5 and m.train_loss == 2.0


def test_weight_sharing_run_with_a_robust_rule() -> None:
    from protofl.engine.federated_data import build_federated_data
    from protofl.engine.simulation import Simulation
    from protofl.methods.checks import tiny_config

    cfg = tiny_config("fedavg", "none", rounds=2).with_overrides(
        ["federation.weight_aggregation=median"]
    )
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulation(cfg, build_federated_data(cfg, Path(tmp)))
    hist = sim.run()
    states = [c.model.state_dict() for c in sim.clients]
    for k in states[0]:  # everyone got the same (median) weights
        assert all(torch.equal(states[0][k], s[k]) for s in states)
    assert hist[-1].train_loss < hist[0].train_loss


def test_evaluation_plan_keeps_the_last_five_rounds_whole() -> None:
    from protofl.config import FederationConfig
    from protofl.engine.round import evaluation_plan

    fed = FederationConfig(rounds=10, eval_every=3, eval_samples=50)
    plan = [evaluation_plan(fed, r) for r in range(10)]
    # rounds 3 and 6 (1-based) of the first five are sampled, the last five whole
    assert plan == ["none", "none", "sample", "none", "none"] + ["full"] * 5
    every = FederationConfig(rounds=10, eval_every=3)
    assert [evaluation_plan(every, r) for r in range(5)] == ["none", "none", "full", "none", "none"]
    assert {evaluation_plan(FederationConfig(rounds=10), r) for r in range(10)} == {"full"}


def test_eval_subsample_is_seeded_sorted_and_whole_when_not_smaller() -> None:
    from protofl.engine.round import eval_subsample

    a = eval_subsample(100, 10, torch.Generator().manual_seed(3))
    b = eval_subsample(100, 10, torch.Generator().manual_seed(3))
    assert a is not None and b is not None and torch.equal(a, b)
    assert len(set(a.tolist())) == 10 and torch.equal(a, a.sort().values)
    assert eval_subsample(100, 100, torch.Generator()) is None
    assert eval_subsample(100, 0, torch.Generator()) is None


@pytest.mark.parametrize("key", ["federation.eval_every=0", "federation.eval_samples=-1"])
def test_bad_evaluation_budget_is_named(key: str) -> None:
    from protofl.methods.checks import tiny_config

    with pytest.raises(ConfigError, match=key.split("=")[0]):
        tiny_config("fedproto", "none").with_overrides([key])
