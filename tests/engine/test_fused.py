"""Fused runs: a sweep's compatible points as one batched program give what they give alone;
an incompatible group runs one by one and says why; ``fuse: false`` / ``--no-fuse``; a killed
fused sweep resumes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from protofl.config import ConfigError
from protofl.engine import fused
from protofl.engine.batched import BatchedTrainer
from protofl.engine.federated_data import build_federated_data
from protofl.engine.fused import FusedMember, FusionUnavailable, fusion_key, fusion_problem
from protofl.engine.simulation import Simulation
from protofl.methods.checks import tiny_config
from protofl.report.cli import add_report_parsers
from protofl.sweeps import LOG_FILE, fusion_groups, plan_sweep, read_status, run_sweep


def _base(method: str = "fedproto", rounds: int = 3, **extra: Any) -> dict[str, Any]:
    base = tiny_config(method, "igpp", rounds=rounds, clients_per_domain=2).to_dict()
    base["federation"]["execution"] = "batched"
    base["federation"]["local_epochs"] = 1
    base["federation"]["keep_checkpoints"] = 2  # tests stop runs by removing the newest one
    for key, value in extra.items():
        section, name = key.split(".")
        base[section][name] = value
    return base


def _plan(grid: dict[str, list[Any]], base: dict[str, Any] | None = None, **extra: Any) -> Any:
    return plan_sweep({"name": "f", "base": base or _base(), "grid": grid, **extra})


def _history(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl with the client-local diagnostics (training loss ...) merged back in."""
    from protofl.engine.rundir import read_rounds

    return read_rounds(run_dir)


def _last_state(run_dir: Path) -> dict[str, Any]:
    index = json.loads((run_dir / "checkpoints.json").read_text())
    path = run_dir / f"checkpoint-{index[-1]['round']:04d}.pt"
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


def _assert_same_runs(a: Path, b: Path, dirs: list[str]) -> None:
    """Per-round accuracies, losses and privacy figures, ledgers and final models agree."""
    for d in dirs:
        ha, hb = _history(a / d), _history(b / d)
        assert len(ha) == len(hb) > 0, d
        for ra, rb in zip(ha, hb):
            assert ra["client_acc"] == rb["client_acc"], (d, ra["round"])
            # (nan in a round where every participant dropped out)
            assert ra["train_loss"] == pytest.approx(
                rb["train_loss"], rel=1e-5, abs=1e-6, nan_ok=True
            )
            assert ra["privacy"] == rb["privacy"], (d, ra["round"])
        sa = json.loads((a / d / "summary.json").read_text())
        sb = json.loads((b / d / "summary.json").read_text())
        assert sa["privacy"] == sb["privacy"]
        assert sa["acc"] == sb["acc"]
        ca, cb = _last_state(a / d), _last_state(b / d)
        for xa, xb in zip(ca["clients"], cb["clients"]):
            assert xa["ledger"] == xb["ledger"]
            assert xa["noise_gen"] == xb["noise_gen"]
            for name, t in xa["model"].items():
                torch.testing.assert_close(t, xb["model"][name], atol=1e-5, rtol=1e-4)
        for ra, rb in zip(ca["releases"], cb["releases"]):
            for xa, xb in zip(ra, rb):
                assert (xa is None) == (xb is None)
                if xa is not None:
                    torch.testing.assert_close(
                        xa["prototypes"], xb["prototypes"], atol=1e-4, rtol=0
                    )
                    assert torch.equal(xa["noise_std"], xb["noise_std"])


@pytest.mark.parametrize(
    ("method", "grid", "extra"),
    [
        ("fedproto", {"seed": [0, 1], "privacy.mechanism": ["igpp", "vpdr"]}, {}),
        # each run draws its own participants and drop-outs (its own server stream); DCR's soft
        # clip trains with each run's own radius
        (
            "fedproto",
            {"seed": [0, 1], "privacy.clip": [1.0, 4.0]},
            {
                "privacy.mechanism": "vpdr",
                "federation.participation": 0.5,
                "federation.dropout": 0.2,
            },
        ),
        ("fedprox", {"seed": [0, 1, 2], "privacy.epsilon": [4.0, 8.0]}, {}),
        # each run's own cluster prototypes (training and the cosine evaluation rule)
        ("fpl", {"seed": [0, 1]}, {}),
        # no cross-entropy (a head without gradient), local prototypes fitted after training
        ("fedpcl", {"seed": [0, 1], "privacy.epsilon": [4.0, 8.0]}, {}),
        # the run's own client ids (which heads are the others')
        ("copa", {"seed": [0, 1]}, {}),
        # each run's own statistics bank and draw counters (an input transform)
        ("fedrdn", {"seed": [0, 1]}, {}),
        # reference models (the model view of the fused rows)
        ("moon", {"seed": [0, 1]}, {}),
    ],
)
def test_fused_sweep_gives_what_each_run_gives_alone(
    tmp_path: Path, method: str, grid: dict[str, list[Any]], extra: dict[str, Any]
) -> None:
    plan = _plan(grid, _base(method, **extra))
    separate = run_sweep(plan, sweep_dir=tmp_path / "separate", jobs=1, progress=False, fuse=False)
    # two fused groups go to two worker processes; one group runs in this process
    jobs = 2 if "privacy.mechanism" in grid else 1
    together = run_sweep(plan, sweep_dir=tmp_path / "fused", jobs=jobs, progress=False)
    assert [r.status for r in together.runs] == ["done"] * len(plan.points)
    assert all(r.fused is None for r in separate.runs)
    groups = {r.fused for r in together.runs}
    # vpdr trains with DCR, igpp without: two fused groups; epsilon alone: one
    assert groups == ({1, 2} if "privacy.mechanism" in grid else {1})
    status = read_status(tmp_path / "fused")
    assert all(r["fused"] in groups and r["note"] is None for r in status["runs"])
    assert "fused group 1:" in (tmp_path / "fused" / LOG_FILE).read_text()
    _assert_same_runs(tmp_path / "separate", tmp_path / "fused", [p.dirname for p in plan.points])
    # each folder is a normal run folder, its own: the fused run's log names its partners
    first = plan.points[0].run_dir(tmp_path / "fused")
    assert "fused with" in (first / "run.log").read_text()
    # a checkpoint holds its own run's rows, not the whole fused store
    size = {
        d: (first.parent.parent / d / first.name / "checkpoint-0003.pt").stat().st_size
        for d in ("fused", "separate")
    }
    assert size["fused"] < 1.5 * size["separate"]


def test_grouping_keys_seed_and_privacy_only() -> None:
    base = tiny_config("fedproto", "igpp").with_overrides(["federation.execution=batched"])
    same = base.with_overrides(["seed=3", "privacy.epsilon=2", "privacy.mechanism=vpp"])
    assert fusion_key(base) == fusion_key(same)
    assert fusion_key(base) != fusion_key(base.with_overrides(["federation.lr=0.01"]))
    assert fusion_key(base.with_overrides(["federation.execution=sequential"])) is None
    # with DCR on, its settings train and must agree; the soft clip's radius is per client
    dcr = base.with_overrides(["privacy.mechanism=vpdr"])
    assert fusion_key(dcr) != fusion_key(base)
    assert fusion_key(dcr) != fusion_key(dcr.with_overrides(["privacy.dcr_tau=2"]))
    assert fusion_key(dcr) == fusion_key(dcr.with_overrides(["privacy.clip=2"]))
    assert fusion_key(base) == fusion_key(base.with_overrides(["privacy.clip=2"]))
    plan = _plan({"seed": [0, 1], "federation.lr": [1e-3, 3e-3]})
    assert [[p.index for p in t] for t in fusion_groups(plan.points)] == [[0, 2], [1, 3]]
    assert len(fusion_groups(plan.points, fuse=False)) == 4


def test_incompatible_runs_fall_back_one_by_one_naming_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # bf16 autocast does not batch (the batched layers write float32 gradients), so it cannot
    # fuse
    # fused; two groups (DCR on and off), and the log says of each that it fell back
    plan = _plan(
        {"seed": [0, 1], "privacy.mechanism": ["igpp", "vpdr"]},
        _base("fpl", rounds=2, **{"run.amp": "bf16"}),
    )
    with caplog.at_level("WARNING"):
        result = run_sweep(plan, sweep_dir=tmp_path / "s", jobs=1, progress=False)
    assert [r.status for r in result.runs] == ["done"] * 4
    why = "not fused: run.amp=bf16 is not batched"
    assert all(r.note == why for r in result.runs)
    assert all(r.fused is None for r in result.runs)
    sweep_log = (tmp_path / "s" / LOG_FILE).read_text()
    for group in (1, 2):
        assert sweep_log.count(f"fused group {group}: {why}") == 1, sweep_log
    assert "run.amp=bf16 is not batched" in caplog.text
    assert read_status(tmp_path / "s")["runs"][0]["note"].startswith("not fused")

    # simulations that differ where fusing cannot stack them: the reason names what differs
    home = tmp_path / "home"

    def sim(**over: Any) -> Simulation:
        cfg = tiny_config("fedproto", "igpp").with_overrides(
            ["federation.execution=batched", *[f"{k}={v}" for k, v in over.items()]]
        )
        return Simulation(cfg, build_federated_data(cfg, home))

    a = sim()
    assert fusion_problem([a, sim(**{"privacy.mechanism": "vpdr"})], ["a", "b"]) == (
        "DCR is on in b and off in a"
    )
    assert "backbone.adapter_hidden: 8 vs 4" in str(
        fusion_problem([a, sim(**{"backbone.adapter_hidden": 4})], ["a", "b"])
    )
    assert fusion_problem([a, sim(seed=5, **{"privacy.epsilon": 2})], ["a", "b"]) is None
    with pytest.raises(FusionUnavailable, match=r"differ in federation\.lr"):
        fused.run_fused(
            [
                FusedMember(a.config, tmp_path / "x"),
                FusedMember(a.config.with_overrides(["federation.lr=0.1"]), tmp_path / "y"),
            ],
            home=home,
        )
    assert not (tmp_path / "x" / "summary.json").exists()


def test_a_fused_group_keeps_to_the_memory_budget_of_its_runs(tmp_path: Path) -> None:
    # one client of this model needs ~11 MB: a 12 MB budget cuts a group at every client
    wide = ["federation.execution=batched", "backbone.adapter_hidden=4096"]
    cfgs = [
        tiny_config("fedproto", "igpp", seed=seed).with_overrides(
            [*wide, "run.memory_budget_mb=12"]
        )
        for seed in (0, 1)
    ]
    trainer = fused.FusedTrainer([Simulation(c, build_federated_data(c, tmp_path)) for c in cfgs])
    assert trainer.supported
    assert trainer.memory_budget == 12 * 2**20
    clients = trainer.sim.clients
    assert len(clients) == 4
    assert [len(g.clients) for g in trainer.groups(clients)] == [1] * 4

    # a budget below one client: the group is not fused, and each run fails as it does alone
    extra = {"run.memory_budget_mb": 1, "backbone.adapter_hidden": 4096}
    plan = _plan({"seed": [0, 1]}, _base(rounds=1, **extra))
    result = run_sweep(plan, sweep_dir=tmp_path / "s", jobs=1, progress=False)
    refused = "run.memory_budget_mb=1 cannot hold one group of batched clients"
    assert [r.status for r in result.runs] == ["failed", "failed"]
    assert all(refused in (r.error or "") for r in result.runs)
    assert all((r.note or "").startswith(f"not fused: {refused}") for r in result.runs)
    assert f"fused group 1: not fused: {refused}" in (tmp_path / "s" / LOG_FILE).read_text()


def test_fuse_off_in_the_sweep_file_and_on_the_command_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fuse must be true or false"):
        _plan({"seed": [0]}, fuse="no")
    plan = _plan({"seed": [0, 1]}, _base(rounds=1), fuse=False)
    assert plan.fuse is False
    result = run_sweep(plan, sweep_dir=tmp_path / "off", jobs=1, progress=False)
    assert all(r.fused is None and r.note is None for r in result.runs)
    assert not (tmp_path / "off" / LOG_FILE).exists()

    path = tmp_path / "s.yaml"
    path.write_text(
        yaml.safe_dump({"name": "c", "base": _base(rounds=1), "grid": {"seed": [0, 1]}})
    )
    parser = argparse.ArgumentParser(prog="protofl")
    add_report_parsers(parser.add_subparsers(dest="command", required=True))
    for flag, fused_runs in ((["--no-fuse"], [None, None]), ([], [1, 1])):
        out = tmp_path / f"cli{len(flag)}"
        args = parser.parse_args(
            ["sweep", str(path), "--out", str(out), "--jobs", "1", "--quiet", "--no-table", *flag]
        )
        assert args.func(args) == 0
        assert [r["fused"] for r in read_status(out)["runs"]] == fused_runs


def test_killed_fused_sweep_resumes_to_the_uninterrupted_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _plan({"seed": [0, 1, 2]}, _base(rounds=3))
    whole = tmp_path / "whole"
    run_sweep(plan, sweep_dir=whole, jobs=1, progress=False)

    killed = tmp_path / "killed"
    real = fused.fused_round
    calls = {"n": 0}

    def dies_in_round_three(trainer: Any, runs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(trainer, runs)

    monkeypatch.setattr(fused, "fused_round", dies_in_round_three)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(plan, sweep_dir=killed, jobs=1, progress=False)
    assert [r["status"] for r in read_status(killed)["runs"]] == ["stopped"] * 3
    monkeypatch.setattr(fused, "fused_round", real)
    # one run lost its round-2 checkpoint too: it catches up before the group steps together
    lagging = plan.points[1].run_dir(killed)
    (lagging / "checkpoint-0002.pt").unlink()
    index = json.loads((lagging / "checkpoints.json").read_text())
    (lagging / "checkpoints.json").write_text(json.dumps([e for e in index if e["round"] == 1]))

    result = run_sweep(plan, sweep_dir=killed, jobs=1, progress=False)
    assert [(r.status, r.action, r.resumed_from) for r in result.runs] == [
        ("done", "resumed", 2),
        ("done", "resumed", 1),
        ("done", "resumed", 2),
    ]
    assert all(r.fused == 1 for r in result.runs)
    _assert_same_runs(whole, killed, [p.dirname for p in plan.points])


def test_a_fused_group_trains_clients_of_several_runs_together(tmp_path: Path) -> None:
    cfgs = [
        tiny_config("fedproto", "igpp", seed=seed).with_overrides(["federation.execution=batched"])
        for seed in (0, 1)
    ]
    sims = [Simulation(c, build_federated_data(c, tmp_path)) for c in cfgs]
    trainer = fused.FusedTrainer(sims, ["a", "b"])
    assert trainer.supported
    groups = trainer.groups(trainer.sim.clients)
    assert any(len({trainer.run_of_state(c.state) for c in g.clients}) == 2 for g in groups)


@pytest.mark.parametrize(("method", "reassociate"), [("fedproto", True), ("moon", None)])
def test_fused_runs_with_frozen_projections_use_one_product_per_run(
    tmp_path: Path, method: str, reassociate: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``backbone.train_projection: false`` each seed's clients hold one frozen projection:
    the fused trainer keeps one per run (not a stacked per-client copy, which lost the cached
    evaluation products and made the VPDR preset's fused sweep slower than its runs one by
    one), and the fused sweep still gives what each run gives alone, also with the projection
    re-associated over pieces that mix the runs (BatchedTrainer.REASSOCIATE)."""
    monkeypatch.setattr(BatchedTrainer, "REASSOCIATE", reassociate)
    cfgs = [
        tiny_config(method, "igpp", seed=seed, clients_per_domain=2).with_overrides(
            ["federation.execution=batched", "backbone.train_projection=false"]
        )
        for seed in (0, 1)
    ]
    sims = [Simulation(c, build_federated_data(c, tmp_path / "data")) for c in cfgs]
    trainer = fused.FusedTrainer(sims, ["a", "b"])
    assert trainer.projections is not None
    assert len(trainer.projections.table) == 2
    for r, sim in enumerate(sims):
        which = trainer.projections.which(trainer.stand_ins(r, sim.clients))
        assert len(set(which)) == 1
        w, b = trainer.projections.table[which[0]]
        assert torch.equal(w, sim.clients[0].model.proj.weight)
        assert torch.equal(b, sim.clients[0].model.proj.bias)
    # a piece mixing the runs' clients applies each client's own projection
    stand_ins = [trainer.stand_ins(r, sim.clients)[0] for r, sim in enumerate(sims)]
    a = torch.randn(2, 5, sims[0].data.feature_dim)
    out = trainer.projections.apply(a, trainer.projections.which(stand_ins))
    for i, sim in enumerate(sims):
        torch.testing.assert_close(out[i], sim.clients[0].model.proj(a[i]))

    base = _base(method, **{"backbone.train_projection": False})
    plan = _plan({"seed": [0, 1, 2]}, base)
    separate = run_sweep(plan, sweep_dir=tmp_path / "separate", jobs=1, progress=False, fuse=False)
    together = run_sweep(plan, sweep_dir=tmp_path / "fused", jobs=1, progress=False)
    assert all(r.fused is None for r in separate.runs)
    assert {r.fused for r in together.runs} == {1}
    _assert_same_runs(tmp_path / "separate", tmp_path / "fused", [p.dirname for p in plan.points])


def test_a_failing_fused_program_leaves_its_runs_to_finish_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _plan({"seed": [0, 1]}, _base(rounds=3))
    real = fused.fused_round
    calls = {"n": 0}

    def fails_in_round_two(trainer: Any, runs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise FloatingPointError("local loss is nan")
        return real(trainer, runs)

    monkeypatch.setattr(fused, "fused_round", fails_in_round_two)
    result = run_sweep(plan, sweep_dir=tmp_path / "s", jobs=1, progress=False)
    assert [(r.status, r.action, r.resumed_from) for r in result.runs] == [
        ("done", "resumed", 1),
        ("done", "resumed", 1),
    ]
    note = "the fused program stopped (FloatingPointError: local loss is nan)"
    assert all(r.note is not None and r.note.startswith(note) for r in result.runs)
    assert note in (tmp_path / "s" / LOG_FILE).read_text()


def test_a_run_started_unfused_resumes_fused(tmp_path: Path) -> None:
    plan = _plan({"seed": [0, 1]}, _base(rounds=3))
    whole = tmp_path / "whole"
    run_sweep(plan, sweep_dir=whole, jobs=1, progress=False, fuse=False)
    mixed = tmp_path / "mixed"
    first = plan.points[0]
    run_sweep(
        plan_sweep({"name": "f", "base": _base(rounds=3), "grid": {"seed": [0]}}),
        sweep_dir=mixed,
        jobs=1,
        progress=False,
        fuse=False,
    )
    d = first.run_dir(mixed)
    (d / "summary.json").unlink()
    (d / "checkpoint-0003.pt").unlink()  # as if killed after round 2 (two are kept)
    index = json.loads((d / "checkpoints.json").read_text())
    (d / "checkpoints.json").write_text(json.dumps([e for e in index if e["round"] == 2]))
    result = run_sweep(plan, sweep_dir=mixed, jobs=1, progress=False)
    assert [(r.action, r.resumed_from, r.fused) for r in result.runs] == [
        ("resumed", 2, 1),
        ("ran", None, 1),
    ]
    _assert_same_runs(whole, mixed, [p.dirname for p in plan.points])
