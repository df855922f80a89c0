"""Weights that no node can inflate, and a federation that no hello can reshape (issue 41, 7).

A hostile node that is *consistent* (it registers 10**9 samples at ``hello`` and claims them in
every reply) used to make FedAvg's average exactly its own weights, and a first ``hello``
claiming ``num-classes=2`` fixed the federation's class count and locked every honest node
out.  Aggregation weights now follow ``federation.weighting`` (a self-declared count is capped
at ``federation.weight_cap`` x the lower median; ``uniform``; ``declared``), and the
federation's shape comes from the server's own config (:class:`FederationPlan`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Array, Context, Message

from protofl.config import ExperimentConfig
from protofl.engine.federated_data import build_federated_data
from protofl.engine.flower.client_app import make_client_app
from protofl.engine.flower.codec import decode_upload
from protofl.engine.flower.inline import InlineGrid
from protofl.engine.flower.plan import FederationPlan, NodeInfo, plan_from_config, plan_from_data
from protofl.engine.flower.server_app import ServerOutcome, run_flower_server
from protofl.engine.flower.strategy import ProtoStrategy
from protofl.errors import ConfigError
from protofl.methods.base import Upload
from protofl.methods.checks import tiny_config
from protofl.privacy.base import Release

LIE = 10**9


def _liar(app: Any, liar: int) -> Any:
    """The ClientApp, with node ``liar`` claiming 10**9 samples at hello and in every reply
    (its release's counts and prototypes scaled to stay consistent with the claim)."""

    def client(msg: Message, ctx: Context) -> Message:
        reply = app(msg, ctx)
        if ctx.node_id != liar:
            return reply
        content = reply.content
        if "hello" in content:
            content["hello"]["num-samples"] = LIE
        if "upload" in content:
            content["upload"]["num-samples"] = LIE
        if "release" in content:
            rel = content["release"]
            rel["counts"] = Array(rel["counts"].numpy() * 10**6)
            # within the norm bound of the claimed counts
            rel["prototypes"] = Array(rel["prototypes"].numpy() * 1e-4)
        return reply

    return client


def _serve(
    grid: InlineGrid, config: ExperimentConfig, *, min_nodes: int = 2, **kwargs: Any
) -> ServerOutcome:
    outcome = ServerOutcome()
    options: dict[str, Any] = {"out": None, "wait_timeout": 10.0, "diagnostics": True, **kwargs}
    run_flower_server(
        grid, config, min_nodes=min_nodes, round_timeout=30.0, outcome=outcome, **options
    )
    return outcome


def _fedavg_run(
    tmp_path: Path, overrides: list[str], *, liar: int = 1001, rounds: int = 2
) -> tuple[ServerOutcome, dict[int, dict[str, torch.Tensor]]]:
    """fedavg on the tiny toy config (red 160, blue 160 samples) with node ``liar`` lying; the
    weights each partition trained in the last round, as the server decoded them."""
    config = tiny_config("fedavg", "igpp", rounds=rounds).with_overrides(overrides)
    client = _liar(make_client_app(config, tmp_path), liar)
    trained: dict[int, dict[str, torch.Tensor]] = {}

    def spy(msg: Message, ctx: Context) -> Message:
        reply = client(msg, ctx)
        if msg.metadata.message_type == "train":
            part = int(ctx.node_config["partition-id"])  # type: ignore[arg-type]
            trained[part] = decode_upload(reply.content, client=part).weights or {}
        return reply

    outcome = _serve(InlineGrid(spy, 2), config)
    return outcome, trained


def _mix(trained: dict[int, dict[str, torch.Tensor]], w: dict[int, float]) -> dict[str, Any]:
    total = sum(w.values())
    return {k: sum(trained[p][k].double() * (w[p] / total) for p in w) for k in trained[0]}


def _close(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.allclose(a[k].double(), b[k].double(), rtol=1e-5, atol=1e-7) for k in a)


# ----- the consistent liar -------------------------------------------------------------------
def test_a_consistent_liar_is_capped_and_cannot_take_over_fedavg(tmp_path: Path) -> None:
    """Blue registers 10**9 samples and claims them in every reply.  Without a partition plan
    its count is self-declared: its weight is capped at weight_cap (10) x the lower median
    of the registered counts (160), so the average is 160:1600, not blue's own weights."""
    outcome, trained = _fedavg_run(tmp_path, [])
    strategy = outcome.strategy
    assert strategy is not None and strategy.avg_weights is not None
    assert all(sorted(m.participants) == ["blue", "red"] for m in outcome.history)
    assert not _close(strategy.avg_weights, trained[1])  # no longer blue's own (it was)
    assert _close(strategy.avg_weights, _mix(trained, {0: 160, 1: 1600}))
    weighting = outcome.summary["weighting"]
    assert weighting["mode"] == "samples" and weighting["limit"] == 1600
    assert weighting["capped"] == {"blue": {"claimed": LIE, "weight": 1600, "round": 1}}


def test_the_liar_is_refused_where_the_server_built_the_partition_plan(tmp_path: Path) -> None:
    """protofl's own Flower simulation builds the partition plan on the server: a hello must
    register its partition's count exactly, so the liar (node 999, first to claim blue's
    partition) is refused and recorded, and the honest blue (node 1001) registers."""
    config = tiny_config("fedproto", "igpp", rounds=1)
    plan = plan_from_data(config, build_federated_data(config, tmp_path))
    assert plan.counts_known and [p.num_samples for p in plan.partitions] == [160, 160]
    grid = InlineGrid(_liar(make_client_app(config, tmp_path), 999), 3, node_ids=[999, 1000, 1001])
    for node, part in ((999, 1), (1000, 0), (1001, 1)):
        grid.contexts[node].node_config["partition-id"] = part
    outcome = _serve(grid, config, plan=plan)
    (refusal,) = outcome.history[0].rejected
    assert refusal["node"] == "999" and refusal["phase"] == "hello"
    assert refusal["reason"] == f"registers {LIE} samples, the partition plan has 160"
    assert outcome.strategy is not None
    assert {n.node_id: n.partition for n in outcome.strategy.nodes.values()} == {1000: 0, 1001: 1}
    assert outcome.summary["weighting"]["capped"] == {}
    assert "partition plan" in outcome.summary["weighting"]["counts"]


def test_uniform_weighting_weighs_every_client_alike(tmp_path: Path) -> None:
    outcome, trained = _fedavg_run(tmp_path, ["federation.weighting=uniform"])
    assert outcome.strategy is not None and outcome.strategy.avg_weights is not None
    assert _close(outcome.strategy.avg_weights, _mix(trained, {0: 1, 1: 1}))
    assert outcome.summary["weighting"]["mode"] == "uniform"


def test_declared_counts_refuse_a_node_whose_claim_disagrees(tmp_path: Path) -> None:
    config = tiny_config("fedproto", "igpp", rounds=1).with_overrides(
        ["federation.weighting=declared", "federation.declared_counts={0: 160, 1: 160}"]
    )
    grid = InlineGrid(_liar(make_client_app(config, tmp_path), 999), 3, node_ids=[999, 1000, 1001])
    for node, part in ((999, 1), (1000, 0), (1001, 1)):
        grid.contexts[node].node_config["partition-id"] = part
    outcome = _serve(grid, config)
    (refusal,) = outcome.history[0].rejected
    assert refusal["node"] == "999"
    assert refusal["reason"] == f"registers {LIE} samples, federation.declared_counts has 160"
    assert sorted(outcome.history[0].participants) == ["blue", "red"]
    assert outcome.summary["weighting"]["counts"].startswith("federation.declared_counts")


def test_declared_counts_must_cover_the_run_and_agree_with_the_plan(tmp_path: Path) -> None:
    base = tiny_config("fedproto", "igpp", rounds=1)
    partial = base.with_overrides(
        ["federation.weighting=declared", "federation.declared_counts={0: 160, 2: 5}"]
    )
    with pytest.raises(
        ValueError, match=r"no count for partition\(s\) \[1\]; partition\(s\) \[2\]"
    ):
        ProtoStrategy(partial)._prepare()
    wrong = base.with_overrides(
        ["federation.weighting=declared", "federation.declared_counts={0: 160, 1: 99}"]
    )
    plan = plan_from_data(wrong, build_federated_data(wrong, tmp_path))
    with pytest.raises(ValueError, match=r"declared_counts.1=99, but .* \(blue\) 160 samples"):
        ProtoStrategy(wrong, plan=plan)._prepare()


# ----- the federation's shape comes from the server's config ---------------------------------
@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("num-classes", 2, "reports num-classes=2, the run's config has 4"),
        ("num-domains", 1, "reports num-domains=1, the run's config has 2"),
        ("num-clients", 1000, "reports num-clients=1000, the run's config has 2"),
        ("method", "fedavg", "reports method='fedavg', the run's config has 'fedproto'"),
        ("mechanism", "none", "reports mechanism='none', the run's config has 'igpp'"),
        ("partition-id", 7, "claims partition 7, the run has partitions 0..1"),
        ("domain", 5, "claims partition 0 as red (domain 5 red); the run's partition 0 is red"),
    ],
)
def test_a_first_hello_cannot_reshape_the_federation(
    field: str, value: Any, reason: str, tmp_path: Path
) -> None:
    """Node 999 registers first and disagrees with the server's config in one field: it is
    refused and recorded, and the honest nodes register (a first hello claiming two classes
    used to fix the class count and lock both of them out)."""
    config = tiny_config("fedproto", "igpp", rounds=1)
    app = make_client_app(config, tmp_path)

    def client(msg: Message, ctx: Context) -> Message:
        reply = app(msg, ctx)
        if ctx.node_id == 999 and "hello" in reply.content:
            reply.content["hello"][field] = value
        return reply

    grid = InlineGrid(client, 3, node_ids=[999, 1000, 1001])
    for node, part in ((999, 0), (1000, 0), (1001, 1)):
        grid.contexts[node].node_config["partition-id"] = part
    outcome = _serve(grid, config)
    (refusal,) = outcome.history[0].rejected
    assert refusal["node"] == "999" and refusal["phase"] == "hello"
    assert refusal["reason"].startswith(reason)
    strategy = outcome.strategy
    assert strategy is not None and strategy.num_classes == 4
    assert {n.node_id: n.partition for n in strategy.nodes.values()} == {1000: 0, 1001: 1}
    assert sorted(outcome.history[0].participants) == ["blue", "red"]


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["data.clients_per_domain=2"],
        ["data.domains=[red, green, blue]", "data.holdout_domain=green"],
        ["data.allocation='red:3,blue:1'"],
    ],
)
def test_the_plan_from_the_config_names_the_partitions_as_the_data_does(
    overrides: list[str], tmp_path: Path
) -> None:
    config = tiny_config("fedproto", "igpp").with_overrides(overrides)
    built = plan_from_data(config, build_federated_data(config, tmp_path))
    read = plan_from_config(config, tmp_path)
    assert read.source == "data set" and not read.counts_known
    for attr in ("num_classes", "domains", "has_holdout"):
        assert getattr(read, attr) == getattr(built, attr)
    facts = [(p.name, p.domain, p.domain_name) for p in read.partitions]
    assert facts == [(p.name, p.domain, p.domain_name) for p in built.partitions]


# ----- the weights themselves ----------------------------------------------------------------
def _upload(client: int, num_samples: int, counts: list[int]) -> Upload:
    k = len(counts)
    release = Release(
        prototypes=torch.ones(k, 4),
        classes=torch.arange(k),
        counts=torch.tensor(counts),
        sensitivity=torch.ones(k),
        noise_std=torch.ones(k, 4),
        mechanism="none",
    )
    return Upload(client, 0, release, num_samples)


def _strategy(overrides: list[str], registered: list[int]) -> ProtoStrategy:
    config = tiny_config("fedproto", "none", clients_per_domain=2).with_overrides(overrides)
    plan = plan_from_config(config)
    strategy = ProtoStrategy(config, plan=plan)
    strategy._prepare()
    for p, n in enumerate(registered):
        facts = plan.partitions[p]
        strategy.nodes[1000 + p] = NodeInfo(
            1000 + p, p, facts.name, facts.domain, facts.domain_name, n
        )
    return strategy


def test_capped_weights_scale_a_release_and_leave_honest_uploads_as_they_are() -> None:
    strategy = _strategy([], [160, 120, 200, LIE])
    ups = [_upload(0, 160, [100, 60]), _upload(1, 120, [120]), _upload(3, LIE, [LIE // 2] * 2)]
    out = strategy.weighted(ups, 1)
    assert strategy.weight_limit([]) == 1600  # 10 x median_low(120, 160, 200, 10**9)
    assert out[0] is ups[0] and out[1] is ups[1]  # untouched: bitwise as the simulator
    assert out[2].num_samples == 1600 and out[2].release is not None
    assert out[2].release.counts.tolist() == [800, 800]
    assert out[2].release.counts.dtype == ups[2].release.counts.dtype  # type: ignore[union-attr]
    assert ups[2].num_samples == LIE  # what was received stays as received
    assert strategy.capped == {"blue-1": {"claimed": LIE, "weight": 1600, "round": 1}}


def test_no_cap_and_uniform_weights() -> None:
    off = _strategy(["federation.weight_cap=0"], [160, 160, 160, LIE])
    assert off.weight_limit([]) is None
    ups = [_upload(0, 160, [100, 60]), _upload(3, LIE, [LIE])]
    assert off.weighted(ups) == ups
    uniform = _strategy(["federation.weighting=uniform"], [160, 160, 160, LIE])
    out = uniform.weighted([_upload(0, 160, [100, 60]), _upload(1, 40, [40])])
    assert [u.num_samples for u in out] == [160, 160]
    assert out[1].release is not None and out[1].release.counts.tolist() == [160]


def test_noisy_counts_are_capped_at_the_median_of_the_round() -> None:
    """Under add_remove with noisy counts nothing exact is registered: the cap is taken over
    the round's released (noisy) counts."""
    strategy = _strategy(
        [
            "privacy.mechanism=igpp",
            "privacy.neighbouring=add_remove",
            "privacy.addremove_counts=noisy",
        ],
        [0, 0, 0, 0],
    )
    ups = [_upload(0, 150, [150]), _upload(1, 170, [170]), _upload(2, LIE, [LIE])]
    assert [u.num_samples for u in strategy.weighted(ups)] == [150, 170, 1700]


# ----- configuration -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["federation.weighting=sample"], "federation.weighting='sample' is not allowed"),
        (["federation.weight_cap=0.5"], "federation.weight_cap=0.5 is out of range"),
        (["federation.weight_cap=-1"], "federation.weight_cap=-1.0 is out of range"),
        (["federation.weighting=declared"], "declared needs federation.declared_counts"),
        (["federation.declared_counts={0: 160}"], "federation.declared_counts is read only"),
        (
            ["federation.weighting=declared", "federation.declared_counts={red: 160}"],
            "federation.declared_counts: 'red' is not a partition id",
        ),
        (
            ["federation.weighting=declared", "federation.declared_counts={0: 0}"],
            "federation.declared_counts.0=0: a sample count",
        ),
        (
            [
                "federation.weighting=declared",
                "federation.declared_counts={0: 160}",
                "privacy.mechanism=igpp",
                "privacy.neighbouring=add_remove",
                "privacy.addremove_counts=noisy",
            ],
            "federation.weighting=declared weights clients by exact sample counts",
        ),
    ],
)
def test_bad_weighting_settings_fail_in_one_line_naming_the_key(
    overrides: list[str], expected: str
) -> None:
    with pytest.raises(ConfigError) as err:
        ExperimentConfig().with_overrides(overrides)
    message = str(err.value)
    assert expected in message and "\n" not in message


def test_declared_counts_keep_string_keys_through_yaml_and_json(tmp_path: Path) -> None:
    import json

    config = ExperimentConfig().with_overrides(
        ["federation.weighting=declared", "federation.declared_counts={1: 7, '0': 5}"]
    )
    assert config.federation.declared_counts == {"0": 5, "1": 7}
    path = tmp_path / "c.yaml"
    path.write_text(config.to_yaml())
    again = ExperimentConfig.from_yaml(path)
    assert again == config
    assert json.loads(json.dumps(config.to_dict())) == config.to_dict()


def test_the_default_weighting_is_samples_capped_at_ten() -> None:
    fed = ExperimentConfig().federation
    assert (fed.weighting, fed.weight_cap, fed.declared_counts) == ("samples", 10.0, {})
    assert isinstance(plan_from_config(tiny_config("fedproto", "none")), FederationPlan)
