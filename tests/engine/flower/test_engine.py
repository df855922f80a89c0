"""Flower engine: parity with the in-process simulator, faults, the app, import hygiene."""

from __future__ import annotations

import copy
import json
import logging
import math
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Array, Context, Message

from protofl.engine.federated_data import build_federated_data
from protofl.engine.flower.client_app import (
    STATE_KEY,
    config_from_run_config,
    load_node_state,
    make_client_app,
)
from protofl.engine.flower.codec import unpack_state
from protofl.engine.flower.inline import InlineGrid
from protofl.engine.flower.run import run_flower_simulation
from protofl.engine.flower.server_app import ServerOutcome, run_flower_server
from protofl.engine.simulation import RoundMetrics, Simulation
from protofl.methods.checks import tiny_config as _tiny_config

# diagnostics the Flower engine does not report: wall time, and feature-norm quantiles (a local
# diagnostic outside the DP guarantee, which must not leave the client)
NOT_COMPARED = ("wall_s", "feature_norms")


def tiny_config(*args: Any, **kwargs: Any) -> Any:
    """``tiny_config`` with the clients' diagnostics opted in (``run.diagnostics``): these tests
    compare protofl's Flower simulation with the in-process simulator, training loss and VPP's
    overlap included; a deployed client never sends them either way."""
    return _tiny_config(*args, **kwargs).with_overrides(["run.diagnostics=true"])


def _nan_as_text(value: Any) -> Any:
    """NaN (the accuracy of a round that was not evaluated) as text: NaN equals nothing, and a
    container only compares it equal when both sides hold the very same NaN object."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, dict):
        return {k: _nan_as_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_as_text(v) for v in value]
    return value


def comparable(history: list[RoundMetrics]) -> list[dict[str, Any]]:
    return [
        _nan_as_text({k: v for k, v in m.to_json().items() if k not in NOT_COMPARED})
        for m in history
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[RoundMetrics]:
    """fedproto + vpdr on the tiny toy config, in-process."""
    config = tiny_config("fedproto", "vpdr")
    data = build_federated_data(config, tmp_path_factory.mktemp("home"))
    return Simulation(config, data).run()


def test_inline_flower_run_equals_the_simulator(
    reference: list[RoundMetrics], tmp_path: Path
) -> None:
    config = tiny_config("fedproto", "vpdr")
    result = run_flower_simulation(config, home=tmp_path, backend="inline", out=tmp_path / "runs")
    assert comparable(result.history) == comparable(reference)  # bitwise: same code, same order
    assert result.run_dir is not None
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(s)["round"] for s in lines] == [1, 2, 3]
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["engine"] == "flower" and summary["clients"] == ["red", "blue"]
    assert summary["privacy"]["epsilon_spent"] == reference[-1].privacy["epsilon_spent"]


@pytest.mark.slow
def test_ray_flower_simulation_equals_the_simulator(
    reference: list[RoundMetrics], tmp_path: Path
) -> None:
    """Flower's Simulation Runtime (Ray): same per-round metrics as the in-process simulator.
    With a run folder on a local Ray the actors write the node files on this machine, and each
    node keeps the state saved with its last release as that node file, hard-linked."""
    pytest.importorskip("ray")
    config = tiny_config("fedproto", "vpdr")
    t0 = time.perf_counter()
    result = run_flower_simulation(config, home=tmp_path, backend="ray", out=tmp_path / "runs")
    wall = time.perf_counter() - t0
    assert comparable(result.history) == comparable(reference)
    assert result.run_dir is not None
    node_files = sorted((result.run_dir / "nodes").glob("partition-*/*.pt"))
    assert len(node_files) == len(reference[0].client_acc)
    for path in node_files:
        cache = load_node_state(path)["release_cache"]  # type: ignore[index]
        assert (path.parent / cache["after"]).is_file()
    print(f"ray flower run: {wall:.1f}s")


# ----- faults ---------------------------------------------------------------------------------
def _round(msg: Message) -> int:
    return int(msg.content["config"]["server-round"])  # type: ignore[arg-type]


def _run_inline(
    tmp_path: Path,
    wrap: Any,
    *,
    rounds: int = 3,
    round_timeout: float = 30.0,
    on_grid: Any = None,
    method: str = "fedproto",
    overrides: tuple[str, ...] = (),
) -> tuple[ServerOutcome, InlineGrid]:
    config = tiny_config(method, "vpdr", rounds=rounds).with_overrides(list(overrides))
    app = make_client_app(config, tmp_path)

    def client(msg: Message, ctx: Context) -> Message:
        return wrap(app, msg, ctx)

    grid = InlineGrid(client, 2)
    outcome = ServerOutcome()

    def on_round(m: RoundMetrics) -> None:
        if on_grid is not None:
            on_grid(grid, m)

    run_flower_server(
        grid,
        config,
        out=None,
        min_nodes=2,
        round_timeout=round_timeout,
        wait_timeout=10.0,
        outcome=outcome,
        on_round=on_round,
        diagnostics=True,
    )
    return outcome, grid


def _serve(grid: InlineGrid, config: Any, **kwargs: Any) -> ServerOutcome:
    """``run_flower_server`` on ``grid`` with the tests' timeouts (2 nodes, 30 s a phase)."""
    outcome = ServerOutcome()
    options: dict[str, Any] = {"out": None, "min_nodes": 2, "wait_timeout": 10.0, **kwargs}
    run_flower_server(grid, config, round_timeout=30.0, outcome=outcome, **options)
    return outcome


def _client_ledger_rounds(grid: InlineGrid, node: int) -> list[int]:
    state = unpack_state(grid.contexts[node].state[STATE_KEY])  # type: ignore[arg-type]
    return [e["round"] for e in state["ledger"]["entries"]]


def test_client_that_raises_is_reported_and_only_released_prototypes_are_charged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def wrap(app: Any, msg: Message, ctx: Context) -> Message:
        pid = ctx.node_config["partition-id"]
        kind = msg.metadata.message_type
        if pid == 1 and _round(msg) == 2 and kind == "train.release":
            raise RuntimeError("disk on fire")  # before anything left the client
        if pid == 0 and _round(msg) == 3 and kind == "train":
            raise RuntimeError("out of memory")  # its release of round 3 has already left
        return app(msg, ctx)

    with caplog.at_level(logging.WARNING, logger="protofl.engine.flower"):
        outcome, grid = _run_inline(tmp_path, wrap)
    strategy = outcome.strategy
    assert strategy is not None
    h = outcome.history
    assert [m.round for m in h] == [1, 2, 3]  # every round completes
    assert h[0].rejected == []
    (r2,) = h[1].rejected
    assert r2["client"] == "blue" and r2["phase"] == "release" and r2["node"] == "1001"
    assert "disk on fire" in r2["reason"]
    assert h[1].participants == ["red"]  # blue released nothing and did not train
    (r3,) = h[2].rejected
    assert r3["client"] == "red" and r3["phase"] == "train" and "out of memory" in r3["reason"]
    assert h[2].participants == ["blue"]
    assert "round 2, release: node 1001 (partition 1, blue) failed" in caplog.text
    # the server charges exactly the releases it received; the clients' own ledgers agree
    assert [e["round"] for e in strategy.ledgers[1].entries] == [0, 2]
    assert [e["round"] for e in strategy.ledgers[0].entries] == [0, 1, 2]
    assert _client_ledger_rounds(grid, 1001) == [0, 2]
    eps = h[-1].privacy["epsilon_spent"]
    assert eps["blue"] < eps["red"]


def test_malformed_reply_is_rejected_and_never_aggregated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from protofl.methods.fedproto import FedProto

    seen: list[list[int]] = []
    original = FedProto.aggregate

    def spy(self: FedProto, uploads: Any, round_index: int) -> Any:
        seen.append([u.client for u in uploads])
        return original(self, uploads, round_index)

    monkeypatch.setattr(FedProto, "aggregate", spy)

    def wrap(app: Any, msg: Message, ctx: Context) -> Message:
        reply = app(msg, ctx)
        if ctx.node_config["partition-id"] == 1 and msg.metadata.message_type == "train.release":
            rnd = _round(msg)
            release = reply.content["release"]
            if rnd == 1:  # a wrong key set
                release.pop("counts")
            elif rnd == 2:  # non-finite values
                bad = release["prototypes"].numpy().copy()
                bad[0, 0] = float("nan")
                release["prototypes"] = Array(bad)
            else:  # a wrong shape
                release["prototypes"] = Array(release["prototypes"].numpy()[:, :5].copy())
        return reply

    with caplog.at_level(logging.WARNING, logger="protofl.engine.flower"):
        outcome, _ = _run_inline(tmp_path, wrap)
    assert seen == [[0], [0], [0]]  # partition 1 never reached aggregation
    reasons = [m.rejected[0]["reason"] for m in outcome.history]
    assert all(len(m.rejected) == 1 for m in outcome.history)
    assert "keys" in reasons[0]
    assert "NaN" in reasons[1]
    assert "shape" in reasons[2]
    assert caplog.text.count("rejected reply of node 1001") == 3
    # a malformed release still left the client: it is charged
    assert [e["round"] for e in outcome.strategy.ledgers[1].entries] == [0, 1, 2]  # type: ignore[union-attr]


def test_node_that_disappears_times_out_and_the_run_continues(tmp_path: Path) -> None:
    def vanish(grid: InlineGrid, m: RoundMetrics) -> None:
        if m.round == 1:
            grid.silent.add(1001)  # still listed by the SuperLink, never answers again

    timeout = 1.0
    t0 = time.perf_counter()
    outcome, _ = _run_inline(
        tmp_path, lambda app, msg, ctx: app(msg, ctx), round_timeout=timeout, on_grid=vanish
    )
    wall = time.perf_counter() - t0
    h = outcome.history
    assert [m.round for m in h] == [1, 2, 3]
    assert h[0].participants == ["red", "blue"]
    for m in h[1:]:
        assert m.participants == ["red"]
        assert {r["phase"] for r in m.rejected} == {"release", "evaluate"}
        assert all("no reply within 1s" in r["reason"] for r in m.rejected)
        assert list(m.client_acc) == ["red"]
    assert wall < 60  # two rounds x two phases x 1 s, plus the work


def test_weight_sharing_method_averages_like_the_simulator(tmp_path: Path) -> None:
    """fedavg (shares weights, no prototypes): the averaged weights travel and match."""
    config = tiny_config("fedavg", "none", rounds=2)
    data = build_federated_data(config, tmp_path)
    ref = Simulation(config, data).run()
    got = run_flower_simulation(config, home=tmp_path, backend="inline")
    assert comparable(got.history) == comparable(ref)


# ----- the app and its configuration ----------------------------------------------------------
def test_generated_app_carries_the_config(tmp_path: Path) -> None:
    from protofl.engine.flower.app import FLWR_RANGE, write_flower_app

    config = tiny_config("fedproto", "vpdr")
    path = write_flower_app(tmp_path / "app", config, out_dir=tmp_path / "runs", num_supernodes=2)
    doc = tomllib.loads((path / "pyproject.toml").read_text())
    flwr_app = doc["tool"]["flwr"]["app"]
    assert flwr_app["components"]["clientapp"].endswith("components:clientapp")
    run_config = dict(flwr_app["config"])
    assert config_from_run_config(run_config) == config
    run_config["protofl-set"] = "federation.rounds=1; seed=4"
    changed = config_from_run_config(run_config)
    assert (changed.federation.rounds, changed.seed) == (1, 4)
    assert doc["project"]["dependencies"] == [f"flwr{FLWR_RANGE}"]
    root = tomllib.loads(Path(__file__).parents[3].joinpath("pyproject.toml").read_text())
    extra = root["project"]["optional-dependencies"].get("flower", [])
    assert any(FLWR_RANGE in dep for dep in extra), "keep the extra's flwr range in sync"
    with pytest.raises(FileExistsError):
        write_flower_app(path, config, num_supernodes=2)


def test_components_module_loads_from_the_run_config() -> None:
    from protofl.engine.flower.app import components

    assert components.clientapp is not None and components.serverapp is not None


def test_import_protofl_stays_free_of_flower() -> None:
    code = (
        "import sys, protofl, protofl.cli, protofl.engine.runner, protofl.engine.flower;"
        "bad = sorted(m for m in sys.modules if m == 'flwr' or m.startswith(('flwr.', 'ray')));"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_backend_and_missing_config_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="backend"):
        run_flower_simulation(tiny_config("fedproto", "none"), home=tmp_path, backend="nope")
    with pytest.raises(ValueError, match="protofl-config"):
        config_from_run_config({})
    # node state only in files on this machine: refused on a Ray cluster, before any folder
    disk = tiny_config("fedproto", "none").with_overrides(
        ["federation.execution=batched", "run.client_state=disk"]
    )
    with pytest.raises(ValueError, match=r"run.client_state=disk .* Ray cluster"):
        run_flower_simulation(disk, home=tmp_path, ray_address="auto", out=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("ray_address", [None, "ray://cluster:10001"])
def test_release_files_only_where_the_node_files_are_this_machines(
    ray_address: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """protofl's simulation keeps a release's state as a hard-linked node file (memory mode
    included) unless it runs on a Ray cluster, whose workers may each write node files on
    their own machine: there the Context keeps the bytes."""
    import protofl.engine.flower.client_app as client_app

    class Built(Exception):
        pass

    seen: dict[str, Any] = {}

    def capture(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(client_app, "make_client_app", capture)
    with pytest.raises(Built):
        run_flower_simulation(
            tiny_config("fedproto", "igpp"), home=tmp_path, backend="ray", ray_address=ray_address
        )
    assert seen["release_files"] is (ray_address is None)


def test_state_survives_in_context_between_messages(tmp_path: Path) -> None:
    """The ClientApp keeps nothing it needs outside context.state: a fresh process cache
    (simulated by clearing it) continues identically."""
    from protofl.engine.flower import client_app as ca

    config = tiny_config("fedproto", "vpdr", rounds=2)
    ref = Simulation(config, build_federated_data(config, tmp_path)).run()

    def wrap(app: Any, msg: Message, ctx: Context) -> Message:
        ca._RUNTIMES.clear()  # every message in a "new process"
        return app(msg, ctx)

    outcome, _ = _run_inline(tmp_path, wrap, rounds=2)
    assert comparable(outcome.history) == comparable(ref)


def test_dtype_and_weights_round_trip_keep_client_models(tmp_path: Path) -> None:
    from protofl.engine.flower.client_app import client_state, get_runtime, load_client_state

    config = tiny_config("fedproto", "vpdr")
    rt = get_runtime(config, tmp_path)
    c = rt.sim.clients[0]
    before = copy.deepcopy(client_state(rt.sim, c))
    with torch.no_grad():
        for p in c.model.parameters():
            p.add_(1.0)
    load_client_state(rt.sim, c, before)
    after = client_state(rt.sim, c)
    for k, v in before["model"].items():
        assert torch.equal(v, after["model"][k])


def test_a_client_state_leaves_out_frozen_parameters_it_can_take_from_the_start(
    tmp_path: Path,
) -> None:
    """A frozen projection that still equals its initial value is not saved with the client's
    state (every message packs that state), and loads back from the run's initial state; one
    that changed (weights averaged over clients with different frozen values) is saved."""
    from protofl.engine.flower.client_app import client_state, get_runtime, load_client_state

    config = tiny_config("fedproto", "vpdr").with_overrides(["backbone.train_projection=false"])
    rt = get_runtime(config, tmp_path)
    c = rt.sim.clients[0]
    frozen = {"proj.weight", "proj.bias"}
    assert {n for n, p in c.model.named_parameters() if not p.requires_grad} == frozen
    # the clients' initial states share one copy of the frozen values
    assert rt.initial[0]["model"]["proj.weight"] is rt.initial[1]["model"]["proj.weight"]
    with torch.no_grad():
        c.model.head.weight.add_(1.0)
    full = copy.deepcopy(client_state(rt.sim, c))
    state = copy.deepcopy(client_state(rt.sim, c, rt.initial[0]))
    assert set(full["model"]) - set(state["model"]) == frozen
    with torch.no_grad():
        for p in c.model.parameters():
            p.add_(1.0)  # frozen ones too: loading must put them back from the initial state
    load_client_state(rt.sim, c, state, rt.initial[0])
    for k, v in c.model.state_dict().items():
        assert torch.equal(v, full["model"][k]), k
    with torch.no_grad():
        c.model.proj.bias.add_(1.0)
    changed = client_state(rt.sim, c, rt.initial[0])
    assert "proj.bias" in changed["model"] and "proj.weight" not in changed["model"]
    # a frozen parameter already holding the value to load is not written (its version, which
    # keys the batched trainer's proj(z) caches, stays); one holding another value is
    version = c.model.proj.weight._version, c.model.proj.bias._version
    load_client_state(rt.sim, c, state, rt.initial[0])
    assert c.model.proj.weight._version == version[0] and c.model.proj.bias._version > version[1]
    assert torch.equal(c.model.proj.bias, rt.initial[0]["model"]["proj.bias"])
    # a state that does not fit the model is refused, naming the client and the keys
    bad = {**state, "model": {**state["model"], "adapter.extra": torch.zeros(1)}}
    with pytest.raises(ValueError, match=r"client 'red'.*unexpected \['adapter.extra'\]"):
        load_client_state(rt.sim, c, bad, rt.initial[0])
    load_client_state(rt.sim, c, rt.initial[0], None)  # leave the cached runtime as it was


@pytest.mark.parametrize("method", ["fedproto", "fedavg"])
def test_a_frozen_projection_run_equals_the_simulator_and_evaluation_keeps_the_state(
    method: str, tmp_path: Path
) -> None:
    """With a frozen projection (VPDR's protocol) both engines agree; an evaluation without
    averaged weights leaves the client's saved state as it was (no repacking), one with
    them saves the adopted weights."""
    config = tiny_config(method, "vpdr").with_overrides(["backbone.train_projection=false"])
    ref = Simulation(config, build_federated_data(config, tmp_path / "home")).run()
    app = make_client_app(config, tmp_path / "home")
    kept: list[bool] = []
    saved_frozen: list[bool] = []

    def client(msg: Message, ctx: Context) -> Message:
        before = ctx.state.get(STATE_KEY)
        reply = app(msg, ctx)
        if msg.metadata.message_type == "evaluate":
            kept.append(ctx.state[STATE_KEY] is before)
            state = unpack_state(ctx.state[STATE_KEY])  # type: ignore[arg-type]
            saved_frozen.append("proj.weight" in state["model"])
        return reply

    got = _serve(InlineGrid(client, 2), config, diagnostics=True).history
    assert comparable(got) == comparable(ref)
    assert kept == [method == "fedproto"] * 6  # 3 rounds x 2 clients
    assert saved_frozen == [False] * 6


def test_a_release_cache_saved_as_a_dict_is_snapshotted_before_anything_trains() -> None:
    """A state saved before the release cache was kept as bytes holds it as a dict, which may
    share tensors with the saved state itself (``torch.save`` keeps shared objects shared):
    training on the loaded state must not change the state the cache gives back."""
    from protofl.engine.flower.client_app import cached_release, cached_state_after_release

    moments = {"exp_avg": torch.zeros(3)}
    saved = {"optimizer": moments, "release_cache": {"round": 2, "after": {"optimizer": moments}}}
    cache = cached_release(saved)
    moments["exp_avg"].add_(1.0)  # what training does to the loaded optimiser state
    after = cached_state_after_release(cache, saved)
    assert torch.equal(after["optimizer"]["exp_avg"], torch.zeros(3)) and cache["round"] == 2
    assert cached_release({}) == {}


def test_the_state_after_a_release_is_kept_once_as_the_bytes_it_was_saved_as(
    tmp_path: Path,
) -> None:
    """A release saves the client's state once (its cache points at it); the next message that
    changes the state (training) keeps the bytes the release saved, untouched, as the state a
    repeated release goes back to."""
    from protofl.engine.flower.codec import packed_bytes

    config = tiny_config("fedproto", "vpdr", rounds=2)
    app = make_client_app(config, tmp_path / "home")
    seen: list[tuple[str, int, Any]] = []

    def client(msg: Message, ctx: Context) -> Message:
        before = ctx.state.get(STATE_KEY)
        before_bytes = None if before is None else packed_bytes(before)  # type: ignore[arg-type]
        reply = app(msg, ctx)
        if STATE_KEY not in ctx.state:  # hello saves no derived state
            return reply
        cache = unpack_state(ctx.state[STATE_KEY])["release_cache"]  # type: ignore[arg-type]
        if ctx.node_config["partition-id"] == 0 and cache and ctx.state[STATE_KEY] is not before:
            after = cache["after"]
            kept = None if after is None else after.numpy().tobytes() == before_bytes
            seen.append((msg.metadata.message_type, _round(msg), kept))
        return reply

    _serve(InlineGrid(client, 2), config, diagnostics=True)
    assert seen == [
        ("train.release", 1, None),
        ("train", 1, True),
        ("train.release", 2, None),
        ("train", 2, True),
    ]  # evaluations adopt no weights here: they save nothing


@pytest.mark.parametrize("release_files", [True, False])
def test_a_node_with_a_context_and_a_node_file_serialises_its_state_once(
    release_files: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run.client_state: memory`` with node files (a run folder): every message that changes
    the state serialises it once, for the Context and the node file alike (the same bytes).
    Where the node files are this machine's (``release_files``, protofl's simulation), the
    state saved with a release stays as that node file, hard-linked, and the Context's cache
    names it; elsewhere (a Ray cluster's workers, a deployed node) the Context holds its
    bytes."""
    from protofl.engine.flower.codec import packed_bytes

    config = tiny_config("fedproto", "vpdr", rounds=2)
    nodes = tmp_path / "nodes"
    app = make_client_app(
        config, tmp_path / "home", deployment=False, state_root=nodes, release_files=release_files
    )
    real_save = torch.save
    saves = [0]
    inside = [False]

    def counting_save(*args: Any, **kwargs: Any) -> None:
        saves[0] += inside[0]
        real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", counting_save)
    seen: list[tuple[str, int, Any]] = []
    at_release: list[bytes] = []

    def client(msg: Message, ctx: Context) -> Message:
        before, count = ctx.state.get(STATE_KEY), saves[0]
        inside[0] = True
        try:
            reply = app(msg, ctx)
        finally:
            inside[0] = False
        if ctx.state.get(STATE_KEY) is before:  # nothing changed, nothing serialised
            assert saves[0] == count
            return reply
        assert saves[0] == count + 1, msg.metadata.message_type
        pid = ctx.node_config["partition-id"]
        (node_file,) = (nodes / f"partition-{pid}").glob("*.pt")
        data = packed_bytes(ctx.state[STATE_KEY])  # type: ignore[arg-type]
        assert node_file.read_bytes() == data
        if pid == 0:
            after = unpack_state(ctx.state[STATE_KEY])["release_cache"]["after"]  # type: ignore[arg-type]
            if after is None:
                at_release.append(data)
            elif isinstance(after, str):  # the file the release wrote, not a copy
                link = node_file.parent / after
                assert link.read_bytes() == at_release[-1] and link.stat().st_nlink == 1
            seen.append((msg.metadata.message_type, _round(msg), type(after).__name__))
        return reply

    _serve(InlineGrid(client, 2), config, diagnostics=True)
    kept = "str" if release_files else "Tensor"
    assert seen == [
        ("train.release", 1, "NoneType"),
        ("train", 1, kept),
        ("train.release", 2, "NoneType"),
        ("train", 2, kept),
    ]
    files = sorted(p.name for p in (nodes / "partition-0").iterdir())
    assert len(files) == (2 if release_files else 1)  # the node file and its round-2 release


def test_a_simulated_node_without_node_files_keeps_no_state_after_its_release(
    tmp_path: Path,
) -> None:
    """protofl's simulation without a run folder: no checkpoint, so no server restart asks for
    a release again, and the Context keeps no state after the release once training changes
    it (the cache says so); a repeated request is refused in one line, not answered with
    another state."""
    config = tiny_config("fedproto", "vpdr", rounds=2)
    app = make_client_app(config, tmp_path / "home", deployment=False, release_files=True)
    releases: dict[int, Message] = {}
    seen: list[tuple[str, int, Any]] = []
    refused: list[str] = []

    def client(msg: Message, ctx: Context) -> Message:
        reply = app(msg, ctx)
        if ctx.node_config["partition-id"] != 0 or STATE_KEY not in ctx.state:
            return reply
        kind = msg.metadata.message_type
        if kind not in ("train", "train.release"):  # evaluations adopt no weights here
            return reply
        packed = ctx.state[STATE_KEY]
        after = unpack_state(packed)["release_cache"]["after"]  # type: ignore[arg-type]
        seen.append((kind, _round(msg), after))
        if kind == "train.release":
            releases[_round(msg)] = msg
        elif kind == "train" and _round(msg) == 1:  # the server asks for round 1 again
            with pytest.raises(ValueError) as err:
                app(releases[1], ctx)
            refused.append(str(err.value))
            assert ctx.state[STATE_KEY] is packed  # nothing changed
        return reply

    _serve(InlineGrid(client, 2), config, diagnostics=True)
    assert seen == [
        ("train.release", 1, None),
        ("train", 1, False),
        ("train.release", 2, None),
        ("train", 2, False),
    ]
    assert (
        refused and "round 1: the release is asked for again, but the state after" in (refused[0])
    )


def tensors(obj: Any, path: str = "") -> Any:
    """``(path, tensor)`` for every tensor in nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{path}[{i}]")


def owns_its_storage(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _resident_bytes_under(folder: Path | None) -> int:
    """Resident bytes of this process's mappings of files under ``folder`` (Linux smaps)."""
    assert folder is not None
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = len(head) >= 6 and head[5].startswith(str(folder))
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")
def test_a_disk_backed_runtime_keeps_one_copy_of_the_clients_equal_initial_values(
    tmp_path: Path,
) -> None:
    """With ``run.client_state=disk`` a client's parameters are rows of a mapped store built
    with the clients: the runtime's initial states hold their own rows (a deep copy of a row
    copied the whole store, once per client: memory quadratic in M), and clients that start
    from the same values share one copy of each (linear in the distinct values, not in M)."""
    from protofl.engine.flower.client_app import get_runtime

    config = tiny_config("fedproto", "vpdr", clients_per_domain=3).with_overrides(
        [
            "federation.execution=batched",
            "run.client_state=disk",
            "privacy.dcr=true",
            "backbone.adapter_hidden=64",  # 64 KB a client's adapter row: whole pages
        ]
    )
    rt = get_runtime(config, tmp_path)
    assert len(rt.initial) == 6
    for pid, state in rt.initial.items():
        for path, t in tensors(state):
            assert owns_its_storage(t), f"partition {pid}: {path} views a larger storage"
    # reading the initial values faulted every client's rows into the resident set (6
    # clients' worth); they are paged out (what stays: pages shared by small rows)
    one_client = sum(p.numel() * 4 for p in rt.sim.clients[0].model.parameters() if p.requires_grad)
    assert one_client > 100_000
    assert _resident_bytes_under(rt.sim.state_dir) < 1.5 * one_client
    first = dict(tensors({k: rt.initial[0][k] for k in ("model", "dcr")}))
    assert first and all(t.numel() > 0 for t in first.values())
    for pid in range(1, 6):
        other = dict(tensors({k: rt.initial[pid][k] for k in ("model", "dcr")}))
        for path, t in first.items():
            assert torch.equal(t, other[path]) and other[path] is t, (pid, path)


def test_building_the_runtime_clones_each_shared_initial_value_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients that start from one template: the runtime's initial states clone each of its
    values once, not once a client only to drop the copies equal to the first (at 10,000
    clients those dropped copies left 6.7-8.3 GB of heap resident)."""
    import protofl.engine.flower.client_app as client_app

    config = tiny_config("fedproto", "vpdr", clients_per_domain=3).with_overrides(
        ["federation.execution=batched", "privacy.dcr=true"]
    )
    real = torch.Tensor.clone
    cloned: list[tuple[int, ...]] = []

    class Built(Simulation):  # clones made once the clients exist: the initial states'
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)

            def spy(t: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
                cloned.append(tuple(t.shape))
                return real(t, *a, **kw)

            monkeypatch.setattr(torch.Tensor, "clone", spy)

    monkeypatch.setattr(client_app, "Simulation", Built)
    rt = client_app.get_runtime(config, tmp_path)
    monkeypatch.setattr(torch.Tensor, "clone", real)
    assert len(rt.initial) == 6
    model = rt.sim.clients[0].model
    adapter = {tuple(t.shape) for k, t in model.state_dict().items() if k.startswith("adapter.")}
    assert adapter and sum(1 for shape in cloned if shape in adapter) == len(adapter)


def assert_equal_to_batched(got: list[RoundMetrics], ref: list[RoundMetrics]) -> None:
    """Flower against a batched simulator run, equal to float rounding: a Flower process trains
    its clients one message at a time, the simulator all of them in one batched group."""
    for a, b in zip(comparable(got), comparable(ref), strict=True):
        assert a["client_acc"] == b["client_acc"] and a["participants"] == b["participants"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
        assert a["privacy"]["epsilon_spent"] == b["privacy"]["epsilon_spent"]


def test_a_batched_flower_client_saves_its_own_rows_only(tmp_path: Path) -> None:
    """With batched execution a client's parameters, moments and DCR teacher are rows of the
    process's stacked store; its saved state holds its own rows (``torch.save`` would write
    every client's), and the run equals the simulator's."""
    config = tiny_config("fedproto", "vpdr", clients_per_domain=2).with_overrides(
        ["federation.execution=batched", "privacy.dcr=true"]
    )
    ref = Simulation(config, build_federated_data(config, tmp_path / "home")).run()
    app = make_client_app(config, tmp_path / "home")
    shared: list[str] = []

    def client(msg: Message, ctx: Context) -> Message:
        reply = app(msg, ctx)
        if STATE_KEY not in ctx.state:  # hello saves no derived state
            return reply
        state = unpack_state(ctx.state[STATE_KEY])  # type: ignore[arg-type]
        for path, t in tensors({k: v for k, v in state.items() if k != "release_cache"}):
            if not owns_its_storage(t):
                shared.append(f"{msg.metadata.message_type}{path}")
        return reply

    got = _serve(InlineGrid(client, 4), config, diagnostics=True, min_nodes=4).history
    assert_equal_to_batched(got, ref)
    assert shared == []


def test_a_batched_flower_client_evaluates_like_the_simulator_projecting_each_test_set_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With batched execution and a frozen projection a Flower client evaluates as the
    batched simulator does (:meth:`Simulation.evaluate` of the one client): ``proj(z)`` of a
    test set is computed once in the process and reused by every later evaluate message of
    every client that shares it, as a message that loads a client's state leaves the frozen
    projection it already holds untouched.  Before, every evaluate message pushed the whole
    test set through the client's projection: most of a 10,000-client Flower round."""
    from protofl.engine.flower.client_app import get_runtime
    from protofl.engine.store import FrozenProjections

    config = tiny_config("fedproto", "vpdr", clients_per_domain=2).with_overrides(
        ["federation.execution=batched", "backbone.train_projection=false"]
    )
    home = tmp_path / "home"
    ref = Simulation(config, build_federated_data(config, home)).run()
    projected: list[int] = []
    project = FrozenProjections.project

    def counted(self: FrozenProjections, z: torch.Tensor, j: int) -> torch.Tensor:
        projected.append(id(z))
        return project(self, z, j)

    monkeypatch.setattr(FrozenProjections, "project", counted)
    evaluations: list[int] = []
    app = make_client_app(config, home)

    def client(msg: Message, ctx: Context) -> Message:
        evaluations.append(msg.metadata.message_type == "evaluate")
        return app(msg, ctx)

    got = _serve(InlineGrid(client, 4), config, diagnostics=True, min_nodes=4).history
    assert_equal_to_batched(got, ref)
    test_sets = {id(c.data.test_z) for c in get_runtime(config, home).sim.clients}
    assert len(test_sets) == 2 and sum(evaluations) == 4 * 3
    # each test set once, of 12 evaluate messages; nothing twice (a release projects its
    # client's training features, cached as well)
    assert sorted(i for i in projected if i in test_sets) == sorted(test_sets)
    assert len(projected) == len(set(projected))


@pytest.mark.parametrize("client_state", ["memory", "disk"])
def test_a_flower_process_keeps_no_client_state_between_messages_beyond_what_it_saves(
    client_state: str, tmp_path: Path
) -> None:
    """After each message a client's optimiser moments, method state and last gradients leave
    the process's simulator skeleton (every message loads the first two from the saved state:
    a second copy, kept for every client the process served).  With ``run.client_state=disk``
    the node's state file is the only saved state (its Context holds none, so a process
    simulating many nodes holds none of them), and the run still equals the simulator's."""
    from protofl.engine.flower.client_app import get_runtime

    config = tiny_config("fedproto", "vpdr", clients_per_domain=2).with_overrides(
        ["federation.execution=batched", f"run.client_state={client_state}", "privacy.dcr=true"]
    )
    home = tmp_path / "home"
    ref = Simulation(config, build_federated_data(config, home)).run()
    nodes = tmp_path / "nodes"
    app = make_client_app(config, home, state_root=nodes)
    kept: list[str] = []
    trains: list[bool] = []

    def client(msg: Message, ctx: Context) -> Message:
        reply = app(msg, ctx)
        sim = get_runtime(config, home).sim
        for c in sim.clients:
            grads = any(p.grad is not None for p in c.model.parameters())
            if c.optimizer.state or c.state.tensors or grads:
                kept.append(f"{msg.metadata.message_type}: {c.data.name}")
        in_context = STATE_KEY in ctx.state
        trained = msg.metadata.message_type == "train"
        trains.append(trained)
        if in_context if client_state == "disk" else trained and not in_context:
            kept.append(f"{msg.metadata.message_type}: context holds state: {in_context}")
        return reply

    got = _serve(InlineGrid(client, 4), config, diagnostics=True, min_nodes=4).history
    assert_equal_to_batched(got, ref)
    assert kept == [] and sum(trains) == 4 * 3
    assert len(list(nodes.glob("partition-*/protofl-client-*.pt"))) == 4


def test_a_client_that_never_trains_writes_no_state_and_no_secret_key(
    tmp_path: Path,
) -> None:
    """``hello`` and an evaluation without weights change no client state: in a cross-device
    run (derived noise keys) a client never selected writes no state (no Context entry, no
    state file), and the run equals the simulator's.  A deployed client's hello saves nothing
    either (its secret noise key lives in the process's memory, never in a state); what it
    saves after releasing, in its Context and its state-dir, holds the key's mode, no key."""
    from protofl.engine.flower.client_app import get_runtime

    config = tiny_config("fedproto", "vpdr", rounds=2, clients_per_domain=4).with_overrides(
        ["federation.participation=0.25"]
    )
    home = tmp_path / "home"
    ref = Simulation(config, build_federated_data(config, home)).run()
    nodes = tmp_path / "nodes"
    grid = InlineGrid(make_client_app(config, home, state_root=nodes), 8)
    got = _serve(grid, config, diagnostics=True, min_nodes=8).history
    assert comparable(got) == comparable(ref)
    names = [c.data.name for c in get_runtime(config, home).sim.clients]
    trained = {names.index(n) for m in got for n in m.participants}
    assert 0 < len(trained) < 8
    in_context = {nid - 1000 for nid, ctx in grid.contexts.items() if STATE_KEY in ctx.state}
    in_files = {int(p.parent.name.split("-")[1]) for p in nodes.glob("partition-*/*.pt")}
    assert in_context == in_files == trained

    # deployed, with the state on disk and in a state-dir: the Context keeps its copy too
    secret = tiny_config("fedproto", "igpp", rounds=1).with_overrides(
        ["federation.execution=batched", "run.client_state=disk"]
    )
    app = make_client_app(secret, home, deployment=True)
    keys: list[Any] = []

    def client(msg: Message, ctx: Context) -> Message:
        reply = app(msg, ctx)
        if msg.metadata.message_type.endswith("hello"):
            keys.append(STATE_KEY in ctx.state)
        return reply

    grid = InlineGrid(client, 2)
    for ctx in grid.contexts.values():
        ctx.node_config["state-dir"] = str(tmp_path / f"node-{ctx.node_id}")
    outcome = _serve(grid, secret)
    assert keys == [False, False] and not outcome.history[0].rejected
    for nid, ctx in grid.contexts.items():
        (path,) = (tmp_path / f"node-{nid}").glob("*.pt")
        for saved in (unpack_state(ctx.state[STATE_KEY]), load_node_state(path)):  # type: ignore[arg-type]
            assert saved is not None and saved["noise_key"] == "secret"
            assert saved["noise_gen"]["mode"] == "secret" and "key" not in saved["noise_gen"]


def test_a_disk_backed_flower_run_resumes_from_its_node_files_to_the_same_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run.client_state=disk`` on the Flower engine: without a run folder the nodes' state
    lives in a temporary folder removed with the run; with one, a run stopped mid-round (its
    clients a round ahead of the server's checkpoint) resumes from the node files alone to the
    numbers of the run that never stopped."""
    import tempfile

    from protofl.engine.flower.run import resume_flower_simulation

    config = tiny_config("fedproto", "vpdr", rounds=3).with_overrides(
        ["federation.execution=batched", "run.client_state=disk", "privacy.dcr=true"]
    )
    home = tmp_path / "home"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    reference = run_flower_simulation(config, home=home, backend="inline")
    assert not list((tmp_path / "tmp").glob("protofl-flower-nodes-*"))
    saves = _spy_node_saves(monkeypatch)
    run_dir = _stopped_before_checkpoint_2(config, home, tmp_path / "runs", monkeypatch)
    assert _node_ledger_rounds(run_dir) == {"partition-0": [0, 1], "partition-1": [0, 1]}
    # the state each client saved with its round-2 release is that very file, hard-linked
    # (not its bytes inside the node file its training wrote), and the round-1 one is gone
    for path in sorted((run_dir / "nodes").glob("partition-*/*.pt")):
        cache = load_node_state(path)["release_cache"]  # type: ignore[index]
        assert cache["round"] == 2 and cache["after"] == f"{path.name}.release-2"
        link = path.parent / cache["after"]
        assert [p.name for p in path.parent.iterdir() if p != path] == [link.name]
        at_release = saves[path][-2]  # the release's save, then the training's
        assert (link.stat().st_ino, link.read_bytes()) == at_release
        assert path.stat().st_size < 1.2 * link.stat().st_size
    resumed = resume_flower_simulation(run_dir, home=home, backend="inline")
    for a, b in zip(comparable(resumed.history), comparable(reference.history), strict=True):
        assert a["client_acc"] == b["client_acc"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
        assert a["privacy"] == b["privacy"]
    assert resumed.summary["privacy"] == reference.summary["privacy"]
    assert _node_ledger_rounds(run_dir) == {"partition-0": [0, 1, 2], "partition-1": [0, 1, 2]}


def test_a_client_that_ignores_the_evaluation_plan_is_rejected(tmp_path: Path) -> None:
    """A client built before evaluation plans measures its whole test set in a ``sample``
    round; the server leaves that accuracy out and records why."""
    config = tiny_config("fedproto", "vpdr", rounds=7).with_overrides(
        ["federation.eval_every=2", "federation.eval_samples=24"]
    )
    app = make_client_app(config, tmp_path / "home")

    def old_client(msg: Message, ctx: Context) -> Message:
        if msg.metadata.message_type == "evaluate":
            del msg.content["config"]["evaluation"]
        return app(msg, ctx)

    history = _serve(InlineGrid(old_client, 2), config, diagnostics=True).history
    assert [m.evaluation for m in history] == ["none", "sample"] + ["full"] * 5
    reasons = {(m.round, r["reason"]) for m in history for r in m.rejected}
    assert reasons == {
        (
            2,
            "malformed metrics: evaluated on 80 test samples; "
            "the round's plan (sample) asks for 24",
        )
    }
    assert math.isnan(history[1].avg_acc) and not math.isnan(history[2].avg_acc)


def test_a_config_key_is_its_canonical_json_for_every_config_object() -> None:
    """Every message asks for the key of its run's config (kept per config object): equal
    configs share it, and a config that differs never gets another's."""
    from protofl.engine.flower.client_app import config_key

    a = tiny_config("fedproto", "vpdr")
    b = tiny_config("fedproto", "vpdr")
    assert config_key(a) == config_key(b) == config_key(a)
    keys = {config_key(a.with_overrides([f"seed={s}"])) for s in range(1, 41)}
    assert len(keys) == 40 and config_key(a) not in keys


def test_cli_glue_runs_the_flower_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the lead wires into ``protofl``: ``run --engine flower`` and ``flower-app``."""
    import yaml

    from protofl.cli import build_parser

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config("fedproto", "vpdr", rounds=1).to_dict()))
    parser = build_parser()
    args = parser.parse_args(
        [
            *("run", str(cfg), "--engine", "flower", "--flower-backend", "inline"),
            *("--json", "--out", str(tmp_path / "runs")),
        ]
    )
    assert args.engine == "flower"
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rounds"] == 1 and Path(out["run_dir"]).is_dir()
    args = parser.parse_args(
        ["flower-app", str(tmp_path / "app"), str(cfg), "--num-supernodes", "2"]
    )
    assert args.func(args) == 0
    assert (tmp_path / "app" / "pyproject.toml").is_file()


def _both_engines(config: Any, home: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    ref = Simulation(config, build_federated_data(config, home)).run()
    got = run_flower_simulation(config, home=home, backend="inline").history
    return comparable(ref), comparable(got)


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    ["fedavg", "feddap", "fedpcl", "fedplvm", "fedprox", "fedtgp", "fpl", "local", "moon", "mpft"],
)
def test_every_method_runs_identically_on_flower(method: str, tmp_path: Path) -> None:
    """Server-side state (FedTGP generator, MPFT head), weight sharing, per-domain aggregation."""
    ref, got = _both_engines(tiny_config(method, "vpdr", rounds=2), tmp_path)
    assert got == ref


@pytest.mark.parametrize(
    "overrides",
    [
        ["data.clients_per_domain=3", "federation.participation=0.5"],
        ["federation.dropout=0.4"],  # round 3 has no participant at all
        ["privacy.dcr=true"],
        ["data.domains=[red,blue,green]", "data.holdout_domain=blue"],
    ],
)
def test_sampling_dcr_and_holdout_match_the_simulator(overrides: list[str], tmp_path: Path) -> None:
    ref, got = _both_engines(tiny_config("fedproto", "vpdr").with_overrides(overrides), tmp_path)
    assert got == ref


@pytest.mark.parametrize("method", ["fedproto", "fedavg"])
def test_evaluation_at_scale_matches_the_simulator(method: str, tmp_path: Path) -> None:
    """``federation.eval_every`` / ``eval_samples`` on Flower: the simulator's per-round
    figures; a skipped round sends no evaluation (a method that shares weights still hands
    them out), a sampled round is measured on the subsample, the last rounds on the whole set."""
    config = tiny_config(method, "vpdr", rounds=8).with_overrides(
        ["federation.eval_every=3", "federation.eval_samples=24"]
    )
    ref = Simulation(config, build_federated_data(config, tmp_path / "home")).run()
    assert [m.evaluation for m in ref] == ["none", "none", "sample"] + ["full"] * 5
    app = make_client_app(config, tmp_path / "home")
    tested: dict[int, list[Any]] = {}

    def client(msg: Message, ctx: Context) -> Message:
        reply = app(msg, ctx)
        if msg.metadata.message_type == "evaluate":
            metrics = reply.content["metrics"]
            tested.setdefault(_round(msg), []).append(metrics.get("num-examples"))
        return reply

    got = _serve(InlineGrid(client, 2), config, diagnostics=True).history
    assert comparable(got) == comparable(ref)
    shares_weights = method == "fedavg"
    assert tested == {
        **({1: [None, None], 2: [None, None]} if shares_weights else {}),
        3: [24, 24],
        **{r: [80, 80] for r in range(4, 9)},
    }


# ----- privacy against the server: the wire allow-list and the noise key ----------------------
def _allowed(phase: str, *, diagnostics: bool) -> set[str]:
    from protofl.engine.flower.codec import DIAGNOSTIC_RECORD, WIRE_FIELDS

    return {
        f"{record}.{key}"
        for record, keys in WIRE_FIELDS[phase].items()
        if diagnostics or record != DIAGNOSTIC_RECORD
        for key in keys
    }


def _recording_run(
    tmp_path: Path,
    config: Any,
    *,
    deployment: bool,
    node_config: dict[str, Any] | None = None,
    wait: float = 10.0,
) -> tuple[ServerOutcome, dict[str, set[str]]]:
    """An inline Flower run whose every reply is recorded as it crosses the wire."""
    from protofl.engine.flower.codec import wire_fields

    app = make_client_app(config, tmp_path, deployment=deployment)
    seen: dict[str, set[str]] = {}
    phases = {"query.hello": "hello", "train.release": "release", "train": "train"}

    def client(msg: Message, ctx: Context) -> Message:
        reply = app(msg, ctx)
        phase = phases.get(msg.metadata.message_type, "evaluate")
        seen.setdefault(phase, set()).update(wire_fields(reply.content))
        return reply

    grid = InlineGrid(client, 2)
    for ctx in grid.contexts.values():
        ctx.node_config.update(node_config or {})
    outcome = _serve(
        grid, config, out=tmp_path / "runs", wait_timeout=wait, diagnostics=not deployment
    )
    return outcome, seen


@pytest.mark.parametrize("deployment", [False, True])
def test_every_field_on_the_wire_is_released_or_declared_public(
    deployment: bool, tmp_path: Path
) -> None:
    config = tiny_config("fedproto", "vpdr", rounds=2)
    outcome, seen = _recording_run(tmp_path, config, deployment=deployment)
    assert set(seen) == {"hello", "release", "train", "evaluate"}
    for phase, fields in seen.items():
        assert fields <= _allowed(phase, diagnostics=not deployment), phase
    # the private diagnostics (VPP's partition overlap, the training loss) travel only in
    # protofl's simulation, never from a deployed client
    assert ("diagnostics.partition_overlap" in seen["release"]) is not deployment
    assert ("diagnostics.train-loss" in seen["train"]) is not deployment
    assert all(not m.rejected for m in outcome.history)
    summary = outcome.summary
    assert summary["wire_fields"]["release"] == sorted(seen["release"])
    g = summary["privacy"]["guarantee"]
    assert g["noise_key"] == ("secret" if deployment else "derived")
    assert set(g["noise_key_per_client"].values()) == {g["noise_key"]}


def test_the_server_rejects_a_field_outside_the_allow_list(tmp_path: Path) -> None:
    from flwr.app import ConfigRecord

    def leak(app: Any, msg: Message, ctx: Context) -> Message:
        reply = app(msg, ctx)
        if msg.metadata.message_type == "train.release" and _round(msg) == 2:
            reply.content["upload"]["exact-count"] = 160
        if msg.metadata.message_type == "train" and _round(msg) == 1:
            reply.content["secrets"] = ConfigRecord({"x": 1})
        return reply

    outcome, _ = _run_inline(tmp_path, leak, rounds=2)
    reasons = [r["reason"] for m in outcome.history for r in m.rejected]
    assert any("upload['exact-count'] is not allowed on the wire" in r for r in reasons)
    assert any("record 'secrets'" in r for r in reasons)


def test_a_deployed_client_refuses_a_derived_noise_key_unless_its_node_opts_out(
    tmp_path: Path,
) -> None:
    config = tiny_config("fedproto", "igpp", rounds=1).with_overrides(
        ["privacy.noise_seed=derived"]
    )
    with pytest.raises(TimeoutError, match="only 0 of 2 nodes registered"):
        _recording_run(tmp_path, config, deployment=True, wait=1.0)
    outcome, _ = _recording_run(
        tmp_path, config, deployment=True, node_config={"insecure-derived-noise-key": "true"}
    )
    assert outcome.summary["privacy"]["guarantee"]["noise_key"] == "derived"


def test_a_restarted_supernode_keeps_its_ledger_and_never_saves_its_secret_key(
    tmp_path: Path,
) -> None:
    """With a node-local state folder, a node that lost its in-memory context resumes its
    ledger instead of starting over; its secret noise key was never saved, so it draws a fresh
    one (no replayed noise)."""
    config = tiny_config("fedproto", "igpp", rounds=2)
    app = make_client_app(config, tmp_path, deployment=True)
    grid = InlineGrid(app, 2)
    for ctx in grid.contexts.values():
        ctx.node_config["state-dir"] = str(tmp_path / f"node-{ctx.node_id}")
    first = {}

    def forget(g: InlineGrid, m: RoundMetrics) -> None:
        for nid, ctx in g.contexts.items():  # a SuperNode restart: the in-memory state is gone
            first[nid] = unpack_state(ctx.state[STATE_KEY])  # type: ignore[arg-type]
            ctx.state = type(ctx.state)()

    outcome = _serve(grid, config, on_round=lambda m: forget(grid, m) if m.round == 1 else None)
    for nid, ctx in grid.contexts.items():
        after = unpack_state(ctx.state[STATE_KEY])  # type: ignore[arg-type]
        assert [e["round"] for e in after["ledger"]["entries"]] == [0, 1]
        assert after["noise_key"] == "secret"
        # the key is never saved: only its mode and draw count
        assert after["noise_gen"]["mode"] == "secret" and "key" not in after["noise_gen"]
        assert "key" not in first[nid]["noise_gen"]
    assert all(not m.rejected for m in outcome.history)


def test_add_remove_with_noisy_counts_sends_no_exact_count(tmp_path: Path) -> None:
    """Presence is what add_remove protects: no exact sample count leaves the client, and the
    server accepts every honest noisy upload (it used to reject 65% on an exact-total check)."""
    config = tiny_config("feddap", "igpp", rounds=3).with_overrides(
        ["privacy.neighbouring=add_remove", "privacy.addremove_counts=noisy", "privacy.epsilon=1"]
    )
    app = make_client_app(config, tmp_path, deployment=True)
    sent: list[tuple[str, Any]] = []

    def client(msg: Message, ctx: Context) -> Message:
        reply = app(msg, ctx)
        sent.append((msg.metadata.message_type, reply.content))
        return reply

    grid = InlineGrid(client, 2)
    outcome = _serve(grid, config)
    exact = {
        c.data.num_train for c in Simulation(config, build_federated_data(config, tmp_path)).clients
    }
    for kind, content in sent:
        if kind == "query.hello":
            assert "num-samples" not in content["hello"]
        if kind == "train.release":
            counts = content["release"]["counts"].numpy()
            assert int(content["upload"]["num-samples"]) == int(counts.sum())
            assert int(content["metrics"]["num-examples"]) == int(counts.sum())
    released = [int(c["upload"]["num-samples"]) for k, c in sent if k == "train.release"]
    assert not set(released) <= exact  # noisy, not the exact counts
    assert all(not m.rejected for m in outcome.history)


# ----- a hostile node cannot take over the federation (over the real wire format) ------------
def test_inflated_sample_counts_are_refused(tmp_path: Path) -> None:
    def inflate(app: Any, msg: Message, ctx: Context) -> Message:
        reply = app(msg, ctx)
        if ctx.node_config["partition-id"] == 1 and msg.metadata.message_type == "train.release":
            reply.content["upload"]["num-samples"] = 10**9
            rel = reply.content["release"]
            rel["counts"] = Array(rel["counts"].numpy() * 10**6)
            # prototypes shrunk to lie within the norm bound of the claimed counts
            rel["prototypes"] = Array(rel["prototypes"].numpy() * 1e-4)
        return reply

    outcome, _ = _run_inline(tmp_path, inflate, rounds=2)
    reasons = [r["reason"] for m in outcome.history for r in m.rejected]
    assert len(reasons) == 2 and all("claims 1000000000 samples, registered" in r for r in reasons)


def test_inflated_weight_claims_cannot_take_over_fedavg(tmp_path: Path) -> None:
    def inflate(app: Any, msg: Message, ctx: Context) -> Message:
        reply = app(msg, ctx)
        if ctx.node_config["partition-id"] == 1 and msg.metadata.message_type == "train":
            reply.content["upload"]["num-samples"] = 10**9
        return reply

    outcome, _ = _run_inline(tmp_path, inflate, rounds=2, method="fedavg")
    assert all(m.participants == ["red"] for m in outcome.history)  # blue's weights never count
    assert all("registered" in m.rejected[0]["reason"] for m in outcome.history)


def test_extra_prototype_rows_and_missing_events_are_refused_and_still_charged(
    tmp_path: Path,
) -> None:
    import numpy as np

    def hostile(app: Any, msg: Message, ctx: Context) -> Message:
        reply = app(msg, ctx)
        if ctx.node_config["partition-id"] == 1 and msg.metadata.message_type == "train.release":
            if _round(msg) == 1:  # 20,000 rows of the same classes
                rel = reply.content["release"]
                reps = 20_000 // len(rel["classes"].numpy()) + 1
                for key in ("prototypes", "classes", "counts", "sensitivity", "noise_std"):
                    a = rel[key].numpy()
                    tiled = np.concatenate([a] * reps)[:20_000]
                    rel[key] = Array(tiled if key != "counts" else np.ones_like(tiled))
            else:  # omit the privacy events: the server must still charge the release
                reply.content["upload"]["events"] = "[]"
        return reply

    outcome, _ = _run_inline(tmp_path, hostile, rounds=3)
    reasons = [m.rejected[0]["reason"] for m in outcome.history]
    assert "one per class" in reasons[0]
    assert all("the configured mechanism charges" in r for r in reasons[1:])
    eps = outcome.history[-1].privacy["epsilon_spent"]
    assert eps["blue"] == pytest.approx(eps["red"])  # charged as the mechanism prescribes


def test_a_second_claim_for_a_held_partition_is_refused_and_recorded(tmp_path: Path) -> None:
    config = tiny_config("fedproto", "igpp", rounds=1)
    app = make_client_app(config, tmp_path)
    grid = InlineGrid(app, 3, node_ids=[1000, 1001, 1002])
    grid.contexts[1002].node_config["partition-id"] = 0  # a rogue node claims red's partition
    outcome = _serve(grid, config, diagnostics=True)
    (refusal,) = [r for r in outcome.history[0].rejected if r["phase"] == "hello"]
    assert refusal["node"] == "1002" and "already held by node 1000" in refusal["reason"]
    assert outcome.strategy is not None
    assert {n.node_id for n in outcome.strategy.nodes.values()} == {1000, 1001}


def test_a_partition_map_binds_partitions_to_node_ids(tmp_path: Path) -> None:
    """With a partition map (the authenticated deployment's), a node claiming a partition
    its id is not bound to is refused and recorded, even while that partition is free."""
    config = tiny_config("fedproto", "igpp", rounds=1)
    app = make_client_app(config, tmp_path)
    bound = {1000: 0, 1002: 1}

    def grid(claims: dict[int, int]) -> InlineGrid:
        g = InlineGrid(app, 3, node_ids=[1000, 1001, 1002])
        for node, partition in claims.items():
            g.contexts[node].node_config["partition-id"] = partition
        return g

    # 1000 claims 1 (bound to 0), 1001 claims 0 (bound to none): only 1002 is accepted
    with pytest.raises(TimeoutError, match="only 1 of 2 nodes registered"):
        _serve(grid({1000: 1, 1001: 0, 1002: 1}), config, wait_timeout=2.0, partition_map=bound)
    outcome = _serve(
        grid({1000: 0, 1001: 0, 1002: 1}),
        config,
        out=tmp_path / "runs",
        partition_map=bound,
        diagnostics=True,
    )
    (refusal,) = [r for r in outcome.history[0].rejected if r["phase"] == "hello"]
    assert refusal["node"] == "1001" and refusal["phase"] == "hello"
    assert refusal["reason"] == "claims partition 0, its identity is bound to no partition"
    assert outcome.strategy is not None
    assert {n.node_id: n.partition for n in outcome.strategy.nodes.values()} == bound
    assert outcome.summary["partition_map"] == {"1000": 0, "1002": 1}


def test_a_partition_map_from_the_run_config_is_checked() -> None:
    from protofl.engine.flower.server_app import format_partition_map, parse_partition_map

    assert parse_partition_map("") == {}
    assert parse_partition_map(format_partition_map({977: 1, 812: 0})) == {812: 0, 977: 1}
    for text, match in [
        ("812", "expected NODE_ID:PARTITION"),
        ("812:x", "expected NODE_ID:PARTITION"),
        ("812:-1", "a partition is >= 0"),
        ("812:0,812:1", "node 812 is bound twice"),
        ("812:0,977:0", "partition 0 is bound to two nodes"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_partition_map(text)


def test_flower_runs_in_one_process_repeat_exactly(tmp_path: Path) -> None:
    """The per-process client cache must not carry one run's state into the next (VPDR's DCR
    teacher was aliased and drifted: training loss 1.106271 -> 1.106709 -> 1.107130)."""
    config = tiny_config("fedproto", "vpdr", rounds=2)
    losses = [
        [
            m.train_loss
            for m in run_flower_simulation(config, home=tmp_path, backend="inline").history
        ]
        for _ in range(3)
    ]
    assert losses[0] == losses[1] == losses[2]


@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_no_message_writes_the_runtime_initial_states_it_loads(
    execution: str, tmp_path: Path
) -> None:
    """A client with no saved state is loaded from the runtime's initial state, whose model and
    DCR teacher it shares (not deep-copied per message): training, releases and evaluations of
    clients that did and did not train leave every initial tensor as it was, and the run still
    equals the simulator's."""
    from protofl.engine.flower.client_app import get_runtime

    config = tiny_config("fedproto", "vpdr", clients_per_domain=2, rounds=2).with_overrides(
        [f"federation.execution={execution}", "federation.participation=0.5", "privacy.dcr=true"]
    )
    runtime = get_runtime(config, tmp_path)
    before = {path: t.clone() for path, t in tensors(runtime.initial)}
    assert any(".dcr.teacher." in path for path in before)
    got = run_flower_simulation(config, home=tmp_path, backend="inline").history
    assert get_runtime(config, tmp_path) is runtime
    after = dict(tensors(runtime.initial))
    assert before.keys() == after.keys()
    assert [p for p, t in before.items() if not torch.equal(t, after[p])] == []
    ref = Simulation(config, build_federated_data(config, tmp_path)).run()
    if execution == "batched":
        assert_equal_to_batched(got, ref)
    else:
        assert comparable(got) == comparable(ref)


def test_a_flower_run_folder_has_its_log_record_and_what_the_server_received(
    tmp_path: Path,
) -> None:
    from protofl.attacks.artifacts import load_run
    from protofl.engine.runner import resume_experiment

    config = tiny_config("fedproto", "igpp", rounds=2).with_overrides(["run.save_releases=true"])
    result = run_flower_simulation(config, home=tmp_path, backend="inline", out=tmp_path / "runs")
    run_dir = result.run_dir
    assert run_dir is not None
    assert "round 2" in (run_dir / "run.log").read_text()
    art = torch.load(run_dir / "artifacts.pt", weights_only=True)
    assert art["engine"] == "flower" and len(art["releases"]) == 2
    assert all(r is not None and r["diagnostics"] == {} for rnd in art["releases"] for r in rnd)
    with pytest.raises(ValueError, match="never leave a client"):
        load_run(run_dir)
    with pytest.raises(ValueError, match="'flower' engine"):
        resume_experiment(run_dir)


def test_a_restarted_supernode_gets_its_partition_back_with_its_state(tmp_path: Path) -> None:
    """A restarted SuperNode has a new node id; once its old id is gone the partition moves to
    it (same registered facts), and its node-local state folder continues ledger and noise."""
    from flwr.app import RecordDict

    config = tiny_config("fedproto", "igpp", rounds=3)
    app = make_client_app(config, tmp_path, deployment=True)
    grid = InlineGrid(app, 2)
    for ctx in grid.contexts.values():
        ctx.node_config["state-dir"] = str(tmp_path / "state")

    def restart(g: InlineGrid, m: RoundMetrics) -> None:
        if m.round == 1:
            old = g.contexts[1001]
            g.removed.add(1001)
            g.contexts[2001] = Context(
                run_id=old.run_id,
                node_id=2001,
                node_config=dict(old.node_config),
                state=RecordDict(),
                run_config=dict(old.run_config),
            )

    outcome = _serve(grid, config, out=tmp_path / "runs", on_round=lambda m: restart(grid, m))
    assert [sorted(m.participants) for m in outcome.history] == [["blue", "red"]] * 3
    assert outcome.summary["rebinds"] == [{"partition": "1", "from": "1001", "to": "2001"}]
    state = unpack_state(grid.contexts[2001].state[STATE_KEY])  # type: ignore[arg-type]
    assert [e["round"] for e in state["ledger"]["entries"]] == [0, 1, 2]  # nothing reset


# ----- resume and extension on the Flower engine ---------------------------------------------
def _node_ledger_rounds(run_dir: Path) -> dict[str, list[int]]:
    out = {}
    for path in sorted((run_dir / "nodes").glob("partition-*/*.pt")):
        state = load_node_state(path)
        assert state is not None
        out[path.parent.name] = [e["round"] for e in state["ledger"]["entries"]]
    return out


def _spy_node_saves(monkeypatch: pytest.MonkeyPatch) -> dict[Path, list[tuple[int, bytes]]]:
    """Every node file :func:`save_node_state` writes from now on: (inode, bytes) per save."""
    import protofl.engine.flower.client_app as client_app

    real = client_app.save_node_state
    saves: dict[Path, list[tuple[int, bytes]]] = {}

    def spy(path: Path, data: bytes) -> None:
        real(path, data)
        saves.setdefault(path, []).append((path.stat().st_ino, path.read_bytes()))

    monkeypatch.setattr(client_app, "save_node_state", spy)
    return saves


def test_a_release_file_falls_back_to_bytes_and_a_missing_one_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node file system without hard links: the cache holds the bytes the release saved. A
    release file the cache names but that is gone: a one-line error naming it."""
    import protofl.engine.flower.client_app as client_app

    node_file = tmp_path / "protofl-client-0-abc.pt"
    node_file.write_bytes(b"saved at the release")
    cache = {"round": 3, "reply": torch.zeros(1), "after": None}

    def no_links(src: Any, dst: Any) -> None:
        raise OSError("operation not permitted")

    with monkeypatch.context() as m:
        m.setattr(client_app.os, "link", no_links)
        kept = client_app.keep_release_file(cache, node_file, node_file.read_bytes())
    assert kept["after"].numpy().tobytes() == b"saved at the release"
    assert list(tmp_path.iterdir()) == [node_file]

    kept = client_app.keep_release_file(cache, node_file, node_file.read_bytes())
    link = tmp_path / "protofl-client-0-abc.pt.release-3"
    assert kept["after"] == link.name and link.stat().st_ino == node_file.stat().st_ino
    assert client_app.keep_release_file(kept, node_file, b"") is kept  # kept once
    link.unlink()
    with pytest.raises(ValueError, match=r"abc\.pt\.release-3: the state saved with the round-3"):
        client_app.cached_state_after_release(kept, {}, tmp_path)
    with pytest.raises(ValueError, match="a release file is named within its node's folder"):
        client_app.cached_state_after_release({**kept, "after": "../x.pt"}, {}, tmp_path)


def _stopped_before_checkpoint_2(
    config: Any, home: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """A Flower run of ``config`` (inline) whose server stops after its clients finished round
    2 but before its checkpoint of round 2 (the clients are a round ahead); its run folder."""
    import protofl.engine.checkpoint as checkpoint

    real = checkpoint.save_checkpoint

    class Stopped(Exception):
        pass

    def stop_at_round_2(run_dir: Path, rnd: int, state: dict[str, Any], **kw: Any) -> Path:
        if rnd == 2:
            raise Stopped
        return real(run_dir, rnd, state, **kw)

    monkeypatch.setattr(checkpoint, "save_checkpoint", stop_at_round_2)
    with pytest.raises(Stopped):
        run_flower_simulation(config, home=home, backend="inline", out=out)
    monkeypatch.setattr(checkpoint, "save_checkpoint", real)
    (run_dir,) = (p for p in out.iterdir() if not p.name.endswith(".client-local"))
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """fedproto + vpdr, 3 rounds, with a run folder: the reference for the resume tests."""
    home = tmp_path_factory.mktemp("home")
    config = tiny_config("fedproto", "vpdr", rounds=3)
    return run_flower_simulation(config, home=home, backend="inline", out=home / "runs"), home


def test_a_flower_run_stopped_mid_round_resumes_to_the_same_numbers(
    uninterrupted: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server stops after its clients finished round 2 but before its checkpoint of round
    2 (the clients are a round ahead): the resumed server asks for round 2 again, each client
    sends the release it made (nothing charged or drawn twice) and the run ends as if it had
    never stopped."""
    from protofl.engine.flower.run import resume_flower_simulation

    reference, home = uninterrupted
    config = tiny_config("fedproto", "vpdr", rounds=3)
    run_dir = _stopped_before_checkpoint_2(config, home, tmp_path / "runs", monkeypatch)
    assert not (run_dir / "summary.json").exists()
    assert _node_ledger_rounds(run_dir) == {"partition-0": [0, 1], "partition-1": [0, 1]}

    # run.client_state: memory with a run folder: the state each client saved with its round-2
    # release is that node file, hard-linked, not bytes inside the Context and the node file
    # its training wrote (which the repeated release of round 2 reads back)
    for path in sorted((run_dir / "nodes").glob("partition-*/*.pt")):
        cache = load_node_state(path)["release_cache"]  # type: ignore[index]
        assert cache["round"] == 2 and cache["after"] == f"{path.name}.release-2"
        assert path.stat().st_size < 1.2 * (path.parent / cache["after"]).stat().st_size

    resumed = resume_flower_simulation(run_dir, home=home, backend="inline")
    assert comparable(resumed.history) == comparable(reference.history)
    assert resumed.summary["privacy"] == reference.summary["privacy"]
    assert resumed.summary["avg_acc"] == reference.summary["avg_acc"]
    assert _node_ledger_rounds(run_dir) == {"partition-0": [0, 1, 2], "partition-1": [0, 1, 2]}
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(s)["round"] for s in lines] == [1, 2, 3]
    assert "resuming" in (run_dir / "run.log").read_text()

    # the same config again in this process, with a run folder: the same numbers
    again = run_flower_simulation(config, home=home, backend="inline", out=tmp_path / "again")
    assert comparable(again.history) == comparable(reference.history)


def test_a_killed_flower_run_resumes_on_its_engine_from_the_cli(
    uninterrupted: Any, tmp_path: Path
) -> None:
    """SIGKILL of ``protofl run --engine flower`` after its first checkpoint, then
    ``protofl run --resume``: the same final numbers as an uninterrupted run."""
    import os
    import signal

    reference, home = uninterrupted
    config = tiny_config("fedproto", "vpdr", rounds=3)
    (tmp_path / "exp.yaml").write_text(config.to_yaml())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # Ray sets it
    env["PROTOFL_HOME"] = str(home)
    cli = [sys.executable, "-c", "import sys; from protofl.cli import main; sys.exit(main())"]
    runs = tmp_path / "runs"
    flower = ["--engine", "flower", "--flower-backend", "inline", "--quiet"]
    proc = subprocess.Popen(
        [*cli, "run", str(tmp_path / "exp.yaml"), "--out", str(runs), *flower],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    try:
        while not list(runs.glob("*/checkpoint-*.pt")):  # round 1's (only the latest is kept)
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    (run_dir,) = (p for p in runs.iterdir() if not p.name.endswith(".client-local"))
    done = subprocess.run(
        [*cli, "run", "--resume", str(run_dir), "--flower-backend", "inline", "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    from protofl.engine.rundir import merge_fields, read_client_summary, read_rounds

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["engine"] == "flower" and summary["rounds"] == 3
    # (summary.json and metrics.jsonl: the server's part; the local-only rest is client-local)
    summary = merge_fields(summary, read_client_summary(run_dir))
    assert summary["privacy"] == reference.summary["privacy"]
    assert summary["avg_acc"] == reference.summary["avg_acc"]
    history = [RoundMetrics.from_json(row) for row in read_rounds(run_dir)]
    assert comparable(history) == comparable(reference.history)


def test_a_flower_run_resumes_only_on_its_engine(uninterrupted: Any, tmp_path: Path) -> None:
    from protofl.config import ConfigError
    from protofl.engine.engines import resume_run
    from protofl.engine.flower.run import resume_flower_simulation
    from protofl.engine.runner import resume_experiment, run_experiment

    reference, _ = uninterrupted
    with pytest.raises(ConfigError, match="made by the 'flower' engine") as info:
        resume_run(reference.run_dir, engine="sim")
    assert "not on the 'sim' engine" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="'flower' engine and resumes only on it"):
        resume_experiment(reference.run_dir)
    sim_dir = run_experiment(tiny_config("fedproto", "igpp", rounds=1), out=tmp_path).run_dir
    with pytest.raises(ConfigError, match="'sim' engine and resumes only on it") as info:
        resume_flower_simulation(sim_dir, home=tmp_path, backend="inline")
    assert "resuming it on the 'flower' engine" in str(info.value)


def test_extending_a_flower_run_composes_every_release_on_both_sides(
    uninterrupted: Any, tmp_path: Path
) -> None:
    import shutil

    from protofl.engine.flower.run import resume_flower_simulation
    from protofl.privacy.accounting import epsilon_spent
    from protofl.privacy.vpp import VPP

    reference, home = uninterrupted
    run_dir = tmp_path / "run"
    shutil.copytree(reference.run_dir, run_dir)
    (run_dir / ".lock").unlink(missing_ok=True)
    config = tiny_config("fedproto", "vpdr", rounds=3)
    with pytest.raises(ValueError, match="whole number of rounds"):
        resume_flower_simulation(run_dir, extend=0 - 1, home=home, backend="inline")
    result = resume_flower_simulation(run_dir, extend=2, home=home, backend="inline")
    mech = VPP(config.privacy, rounds=3, dim=config.backbone.proto_dim)
    events = [e for i in range(5) for e in mech.release_events(i)]
    total = epsilon_spent(events, delta=config.privacy.delta, accountant=config.privacy.accountant)
    privacy = result.summary["privacy"]
    assert total > config.privacy.epsilon
    assert privacy["epsilon"] == pytest.approx(total, rel=1e-9)
    assert list(privacy["epsilon_spent"].values()) == [pytest.approx(total, rel=1e-9)] * 2
    assert privacy["calibrated"]["epsilon"] == config.privacy.epsilon
    assert "EXTENDED" in privacy["guarantee"]["statement"]
    assert [m.round for m in result.history] == [1, 2, 3, 4, 5]
    assert comparable(result.history[:3]) == comparable(reference.history)
    # the clients' own ledgers, on their nodes, hold the five releases too
    assert _node_ledger_rounds(run_dir) == {
        "partition-0": [0, 1, 2, 3, 4],
        "partition-1": [0, 1, 2, 3, 4],
    }
    ext = json.loads((run_dir / "extensions.json").read_text())["extensions"]
    assert [(e["from_round"], e["to_round"], e["engine"]) for e in ext] == [(3, 5, "flower")]


def test_a_subsampled_flower_run_equals_the_simulator_and_charges_the_sampled_events(
    tmp_path: Path,
) -> None:
    """privacy.sample_rate (issue 44): the Poisson sample is drawn from each client's noise key
    on either engine, and the node's ledger composes the subsampled events to the budget."""
    config = tiny_config("fedproto", "igpp").with_overrides(
        ["privacy.neighbouring=add_remove", "privacy.sample_rate=0.3"]
    )
    data = build_federated_data(config, tmp_path / "home")
    reference = Simulation(config, data).run()
    result = run_flower_simulation(config, home=tmp_path / "home", backend="inline", out=tmp_path)
    assert comparable(result.history) == comparable(reference)
    spent = reference[-1].privacy["epsilon_spent"]
    assert set(spent) == {"red", "blue"}
    assert all(0.99 < e <= config.privacy.epsilon for e in spent.values())
    summary = json.loads((result.run_dir / "summary.json").read_text())  # type: ignore[operator]
    assert summary["privacy"]["guarantee"]["sample_rate"] == 0.3
    assert "Poisson subsample at rate 0.3" in summary["privacy"]["guarantee"]["statement"]


def test_release_schedule_once_runs_on_flower_like_the_simulator_and_charges_once(
    tmp_path: Path,
) -> None:
    """privacy.release_schedule=once on Flower (issue 44): each client's one release is charged
    by the client, its node and the server once; the re-sends of later rounds are recognised
    by the server (the same release, digest for digest) and cost nothing."""
    config = tiny_config("fedproto", "igpp").with_overrides(["privacy.release_schedule=once"])
    data = build_federated_data(config, tmp_path / "home")
    reference = Simulation(config, data).run()
    result = run_flower_simulation(config, home=tmp_path / "home", backend="inline", out=tmp_path)
    assert comparable(result.history) == comparable(reference)
    spent = result.history[-1].privacy["epsilon_spent"]
    assert spent == reference[-1].privacy["epsilon_spent"]
    eps = config.privacy.epsilon
    assert all(0.99 * eps < e <= eps for e in spent.values())  # one release: the whole budget


def test_a_changed_release_under_once_is_charged_and_rejected(tmp_path: Path) -> None:
    def wrap(app: Any, msg: Message, ctx: Context) -> Message:
        reply = app(msg, ctx)
        blue = ctx.node_config["partition-id"] == 1
        if blue and msg.metadata.message_type == "train.release" and _round(msg) == 3:
            release = reply.content["release"]  # a new draw where only a re-send is allowed
            release["prototypes"] = Array(release["prototypes"].numpy().copy() + 1e-3)
        return reply

    schedule = ("privacy.release_schedule=once",)
    outcome, grid = _run_inline(tmp_path, wrap, overrides=schedule)
    strategy = outcome.strategy
    assert strategy is not None
    assert [m.rejected for m in outcome.history[:2]] == [[], []]
    (r3,) = outcome.history[2].rejected
    assert r3["client"] == "blue" and "second, different release (charged)" in r3["reason"]
    assert [e["round"] for e in strategy.ledgers[0].entries] == [0]  # re-sends cost nothing
    assert [e["round"] for e in strategy.ledgers[1].entries] == [0, 2]
    assert _client_ledger_rounds(grid, 1000) == [0]
    assert _client_ledger_rounds(grid, 1001) == [0]
    assert set(strategy.sent_digests) == {0, 1}


def test_ctrl_c_in_a_new_flower_run_names_its_folder_and_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 43: a Ctrl-C in ``protofl run --engine flower`` printed `protofl run --resume
    RUN_DIR` without the folder, although the run had made it; now it names both."""
    import yaml

    from protofl.cli import main
    from protofl.engine.flower import server_app

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(server_app, "run_flower_server", interrupted)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config("fedproto", "igpp", rounds=1).to_dict()))
    out = tmp_path / "runs"
    argv = ["run", str(cfg), "--engine", "flower", "--flower-backend", "inline", "--out", str(out)]
    assert main(argv) == 130
    (folder,) = [d for d in out.iterdir() if d.is_dir() and not d.name.endswith("client-local")]
    err = capsys.readouterr().err
    assert f"protofl run --resume {folder}" in err
    assert "RUN_DIR" not in err
