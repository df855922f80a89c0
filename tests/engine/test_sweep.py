"""Sweeps: every point validated before anything runs; finished runs skipped, a stopped run
resumed, a failing run reported without stopping the others."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from protofl.config import ConfigError
from protofl.engine.sweep import (
    execute_point,
    format_sweep_result,
    load_sweep,
    plan_sweep,
    read_status,
    run_sweep,
)
from protofl.methods.checks import tiny_config
from protofl.report.cli import add_report_parsers


def _base() -> dict[str, Any]:
    base = tiny_config("fedproto", "none", rounds=2).to_dict()
    base["federation"]["local_epochs"] = 1
    return base


def _sweep_file(tmp_path: Path, grid: dict[str, Any], **extra: Any) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "base": _base(), "grid": grid, **extra}))
    return path


def test_unknown_keys_fail_before_any_run_naming_the_key(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"federation\.roundz"):
        load_sweep(_sweep_file(tmp_path, {"seed": [0, 1], "federation.roundz": [1, 2]}))
    with pytest.raises(ConfigError, match=r"unknown sweep key 'grdi'.*did you mean 'grid'"):
        plan_sweep({"base": {}, "grdi": {"seed": [0]}})
    with pytest.raises(ConfigError, match=r"grid point 1 .*fedprot"):
        load_sweep(_sweep_file(tmp_path, {"method.name": ["fedproto", "fedprot"]}))
    with pytest.raises(ConfigError, match=r"grid point 1 .*federation.rounds=0.*out of range"):
        load_sweep(_sweep_file(tmp_path, {"federation.rounds": [1, 0]}))
    with pytest.raises(ConfigError, match="non-empty list"):
        load_sweep(_sweep_file(tmp_path, {"seed": 3}))
    assert not out.exists()


def test_base_may_be_a_config_file_next_to_the_sweep(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(_base()))
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"base": "base.yaml", "grid": {"seed": [0, 1]}}))
    plan = load_sweep(path)
    assert plan.name == "s"
    assert [p.dirname for p in plan.points] == ["000-seed-0", "001-seed-1"]
    assert [p.config.seed for p in plan.points] == [0, 1]
    assert plan.points[1].config.data.name == "toy"


def test_set_replaces_a_grid_axis_or_sets_a_base_key(tmp_path: Path) -> None:
    path = _sweep_file(tmp_path, {"method.name": ["fedproto", "local"], "seed": [0, 1, 2]})
    plan = load_sweep(path, ["seed=[1, 2]", "federation.checkpoint=false", "seed=[2]"])
    assert [p.overrides for p in plan.points] == [
        {"method.name": "fedproto", "seed": 2},
        {"method.name": "local", "seed": 2},
    ]
    assert all(not p.config.federation.checkpoint for p in plan.points)
    assert load_sweep(path, ["seed=1"]).grid["seed"] == [1]  # a scalar is a one-value axis
    with pytest.raises(ConfigError, match=r"federation\.chekpoint"):
        load_sweep(path, ["federation.chekpoint=false"])
    with pytest.raises(ConfigError, match="must look like key=value"):
        load_sweep(path, ["seed"])
    # the command line: --set on `protofl sweep --dry-run`
    parser = argparse.ArgumentParser()
    add_report_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["sweep", str(path), "--set", "seed=[0]", "--dry-run", "--out", str(tmp_path / "o")]
    )
    assert args.func(args) == 0


def _stop_after_first_round(run_dir: Path) -> None:
    """Make a finished 2-round run look like one killed after round 1."""
    (run_dir / "summary.json").unlink()
    (run_dir / "checkpoint-0002.pt").unlink()
    index = json.loads((run_dir / "checkpoints.json").read_text())
    (run_dir / "checkpoints.json").write_text(json.dumps([e for e in index if e["round"] == 1]))
    first = (run_dir / "metrics.jsonl").read_text().splitlines()[0]
    (run_dir / "metrics.jsonl").write_text(first + "\n")


def test_stopped_sweep_completes_only_the_rest_and_reports_failures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _sweep_file(
        tmp_path,
        {"data.domains": [["red", "blue"], ["green", "grey"], ["red", "grey"], ["red", "nope"]]},
    )
    plan = load_sweep(path)
    sweep_dir = tmp_path / "sweep"
    p0, p1 = plan.points[0], plan.points[1]
    # point 0 finished in an earlier invocation; point 1 was killed after its first round
    assert execute_point(str(p0.run_dir(sweep_dir)), p0.config.to_yaml(), None)["status"] == "done"
    assert execute_point(str(p1.run_dir(sweep_dir)), p1.config.to_yaml(), None)["status"] == "done"
    uninterrupted = json.loads((p1.run_dir(sweep_dir) / "summary.json").read_text())
    _stop_after_first_round(p1.run_dir(sweep_dir))
    done_before = (p0.run_dir(sweep_dir) / "summary.json").stat().st_mtime_ns

    result = run_sweep(plan, sweep_dir=sweep_dir, jobs=2, progress=False)

    actions = [(r.status, r.action) for r in result.runs]
    assert actions == [
        ("done", "reused"),
        ("done", "resumed"),
        ("done", "ran"),
        ("failed", "ran"),
    ]
    assert (p0.run_dir(sweep_dir) / "summary.json").stat().st_mtime_ns == done_before
    assert result.runs[1].resumed_from == 1
    resumed = json.loads((p1.run_dir(sweep_dir) / "summary.json").read_text())
    for key in ("acc", "avg_acc", "final_train_loss"):
        assert resumed[key] == uninterrupted[key], key  # resuming gives the same numbers
    assert len((p1.run_dir(sweep_dir) / "metrics.jsonl").read_text().splitlines()) == 2
    failed = result.runs[3]
    assert "nope" in (failed.error or "")
    assert (sweep_dir / failed.dir / "error.txt").exists()
    text = format_sweep_result(result)
    assert "3/4 runs complete (1 already done, 1 ran, 1 resumed), 1 failed" in text
    assert f"FAILED {failed.dir}: " in text and "nope" in text
    status = read_status(sweep_dir)
    assert [r["status"] for r in status["runs"]] == ["done", "done", "done", "failed"]
    assert status["counts"]["failed"] == 1

    # the CLI on the same sweep: nothing left to run but the failed point, which fails again
    parser = argparse.ArgumentParser(prog="protofl")
    add_report_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["sweep", str(path), "--out", str(sweep_dir), "--jobs", "1", "--quiet"]
    )
    assert args.func(args) == 1
    out = capsys.readouterr().out
    assert "3/4 runs complete (3 already done, 0 ran, 0 resumed), 1 failed" in out
    assert "FAILED 003-domains-red+nope" in out
    # the summary table follows each run's run.headline and says which metric it is
    assert "| domains | metric | n | red | blue | green | grey | AVG | STD |" in out


def test_folder_with_a_different_sweep_is_refused(tmp_path: Path) -> None:
    plan = load_sweep(_sweep_file(tmp_path, {"seed": [0]}))
    sweep_dir = tmp_path / "sweep"
    d = plan.points[0].run_dir(sweep_dir)
    d.mkdir(parents=True)
    other = plan.points[0].config.with_overrides(["federation.rounds=5"])
    (d / "config.yaml").write_text(other.to_yaml())
    with pytest.raises(ConfigError, match=r"federation.rounds: 5 there, 2 now"):
        run_sweep(plan, sweep_dir=sweep_dir, jobs=1, progress=False)


@pytest.mark.parametrize(
    "path",
    sorted((Path(__file__).resolve().parents[2] / "experiments").glob("*.yaml")),
    ids=lambda p: p.stem,
)
def test_every_results_sweep_file_validates(path: Path) -> None:
    """The sweep files behind docs/results.md stay valid as the config evolves."""
    plan = load_sweep(path)
    assert plan.points
    seeds = {p.config.seed for p in plan.points}
    assert seeds == {0, 1, 2}, f"{path.name}: docs/results.md reports seeds 0-2"
