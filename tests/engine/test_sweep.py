"""Sweeps: every point validated before anything runs; finished runs skipped, a stopped run
resumed, a failing run reported without stopping the others."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from protofl.config import ConfigError
from protofl.engine.rundir import read_client_summary
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
    base["federation"]["keep_checkpoints"] = 2  # _stop_after_first_round removes the newest
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
    uninterrupted_loss = read_client_summary(p1.run_dir(sweep_dir))["final_train_loss"]
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
    for key in ("acc", "avg_acc"):
        assert resumed[key] == uninterrupted[key], key  # resuming gives the same numbers
    loss = read_client_summary(p1.run_dir(sweep_dir))["final_train_loss"]  # local-only
    assert loss == uninterrupted_loss
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


# ----- select: a setting chosen on validation splits, never on test ------------------------------
def test_select_plans_validation_runs_per_group_over_the_default_clip_grid(
    tmp_path: Path,
) -> None:
    path = _sweep_file(
        tmp_path,
        {"privacy.mechanism": ["igpp", "vpdr"], "seed": [0, 1]},
        select={"key": "privacy.clip"},
    )
    plan = load_sweep(path)
    sel = plan.select
    assert sel is not None
    assert sel.values == [5.0, 10.0, 15.0, 20.0]  # VPDR's grid, the default for privacy.clip
    assert sel.per == ("privacy.mechanism",)  # seeds are pooled within a group
    assert sel.validation_fraction == 0.2 and sel.metric == "headline"
    assert len(plan.validation) == 2 * 2 * 4
    for v in plan.validation:
        cfg = v.point.config
        assert cfg.data.validation_fraction == 0.2
        assert cfg.privacy.clip == sel.values[v.value_index]
        assert cfg.privacy.mechanism == plan.points[v.grid_index].config.privacy.mechanism
    # the grid points themselves evaluate on test (no validation split)
    assert all(p.config.data.validation_fraction is None for p in plan.points)
    # --select sets the key (and values) over the file's section
    other = load_sweep(path, select="privacy.clip=[1, 2]")
    assert other.select is not None and other.select.values == [1, 2]
    with pytest.raises(ValueError, match="run it with run_selection"):
        run_sweep(plan, sweep_dir=tmp_path / "s", jobs=1, progress=False)


@pytest.mark.parametrize(
    ("select", "needle"),
    [
        (
            {"key": "privacy.clip", "valus": [1]},
            "unknown select key 'valus' (did you mean 'values'?)",
        ),
        ({"key": "privacy.clp"}, "privacy.clp"),
        ({"key": "seed"}, "select.key=seed cannot be selected"),
        ({"key": "federation.lr"}, "select.values is required for select.key=federation.lr"),
        ({"key": "privacy.clip", "values": []}, "select.values must be a non-empty list"),
        ({"key": "privacy.clip", "values": [5, 5]}, "lists a value twice"),
        ({"key": "privacy.clip", "values": [-1]}, "privacy.clip=-1"),
        ({"key": "privacy.clip", "validation_fraction": 1.5}, "select.validation_fraction=1.5"),
        ({"key": "privacy.clip", "metric": "best"}, "select.metric='best'"),
        ({"key": "privacy.clip", "per": ["seedz"]}, "select.per=['seedz'] must list grid axes"),
        ({"key": "privacy.mechanism"}, "select.key=privacy.mechanism is also a grid axis"),
    ],
)
def test_bad_select_is_one_line_naming_the_key(
    tmp_path: Path, select: dict[str, Any], needle: str
) -> None:
    path = _sweep_file(tmp_path, {"privacy.mechanism": ["igpp"]}, select=select)
    with pytest.raises(ConfigError) as err:
        load_sweep(path)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


class _Guarded:
    """A test split's images that may only be read once the selection has chosen."""

    def __init__(self, images: Any, state: dict[str, bool]) -> None:
        self.images, self.state = images, state

    def __getitem__(self, item: Any) -> Any:
        if not self.state["chosen"]:
            raise AssertionError("the test images were read before the choice")
        return self.images[item]


def _select(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, permute_test: bool
) -> dict[str, Any]:
    """Run a 2-candidate clip selection on toy; the test split is unreadable until the choice
    (and with ``permute_test`` its labels are shuffled)."""
    import numpy as np

    import protofl.engine.federated_data as federated_data
    import protofl.engine.sweep as sweep
    from protofl.data.toy import make_toy
    from protofl.engine.sweep import run_selection

    state = {"chosen": False}

    def load(config: Any, home: Path) -> Any:
        toy = make_toy()
        for dom in toy.domains:
            if permute_test:
                labels = np.random.default_rng(0).permutation(dom.test.labels)
                object.__setattr__(dom.test, "labels", labels)
            object.__setattr__(dom.test, "images", _Guarded(dom.test.images, state))
        return toy

    real_choose = sweep.choose

    def choose(*args: Any, **kwargs: Any) -> Any:
        out = real_choose(*args, **kwargs)
        state["chosen"] = True
        return out

    monkeypatch.setattr(federated_data, "load_dataset", load)
    monkeypatch.setattr(sweep, "choose", choose)
    base = _base()
    # nearest noisy global prototype: a large clip radius (more noise) hurts
    base["privacy"].update({"mechanism": "igpp", "epsilon": 1.0})
    base["method"]["params"] = {"eval": "prototype"}
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": name,
                "base": base,
                "grid": {"method.name": ["fedproto"]},
                "select": {
                    "key": "privacy.clip",
                    "values": [20.0, 0.5],
                    "validation_fraction": 0.3,
                },
            }
        )
    )
    result = run_selection(load_sweep(path), sweep_dir=tmp_path / name, jobs=1, progress=False)
    assert not result.failed
    record = json.loads((tmp_path / name / "selection.json").read_text())
    assert record == json.loads(json.dumps(result.record))
    return record


def test_selection_chooses_on_validation_and_never_reads_test_before_choosing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = _select(tmp_path, monkeypatch, "sel", permute_test=False)
    assert record["key"] == "privacy.clip" and record["grid"] == [20.0, 0.5]
    assert record["validation_fraction"] == 0.3
    (group,) = record["groups"]
    assert group["group"] == {"method.name": "fedproto"}
    accs = [c["avg_acc"] for c in group["validation"]]
    assert [c["value"] for c in group["validation"]] == [20.0, 0.5]
    assert all(0.0 <= a <= 1.0 for a in accs) and len(set(accs)) == 2
    best = max(range(2), key=lambda i: (accs[i], -i))
    assert group["chosen"] == record["grid"][best]  # the argmax of the validation accuracies
    # the validation runs evaluate on the held-out part of the training data ...
    for c in group["validation"]:
        (run,) = c["runs"]
        config = yaml.safe_load((tmp_path / "sel" / run / "config.yaml").read_text())
        assert config["data"]["validation_fraction"] == 0.3
        assert config["privacy"]["clip"] == c["value"]
    # ... and the test run trains with the choice on all of it and reports test accuracy
    (test_run,) = group["test"]["runs"]
    config = yaml.safe_load((tmp_path / "sel" / test_run / "config.yaml").read_text())
    assert config["data"]["validation_fraction"] is None
    assert config["privacy"]["clip"] == group["chosen"]
    summary = json.loads((tmp_path / "sel" / test_run / "summary.json").read_text())
    assert group["test"]["avg_acc"] == pytest.approx(summary["avg_acc"])
    # another test set (labels shuffled) changes the test accuracy, not the choice
    other = _select(tmp_path, monkeypatch, "sel2", permute_test=True)
    (group2,) = other["groups"]
    assert [c["avg_acc"] for c in group2["validation"]] == accs
    assert group2["chosen"] == group["chosen"]
    assert group2["test"]["avg_acc"] != group["test"]["avg_acc"]


def test_cli_select_dry_run_lists_the_validation_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _sweep_file(tmp_path, {"privacy.mechanism": ["igpp"]})
    parser = argparse.ArgumentParser(prog="protofl")
    add_report_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["sweep", str(path), "--select", "privacy.clip", "--dry-run", "--out", str(tmp_path / "s")]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "4 validation runs" in out and "choosing privacy.clip among 5.0, 10.0, 15.0, 20.0" in out
    assert out.count("to run") == 4 and "validation_fraction-0.2" in out


# ----- a killed sweep takes its workers with it ------------------------------------------------
def _workers_of(marker: str) -> list[int]:
    """Live processes (forkserver and its workers) started by a sweep whose cwd is ``marker``:
    the forkserver's command line carries the driver's sys.path, which starts with its cwd."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if "forkserver" in cmd and marker in cmd and state != "Z":
            pids.append(int(proc.name))
    return pids


def _rounds_logged(sweep_dir: Path) -> list[int]:
    return sorted(len(m.read_text().splitlines()) for m in sweep_dir.glob("*/metrics.jsonl"))


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_killed_sweep_leaves_no_worker_writing_runs(tmp_path: Path, sig: str) -> None:
    """On main, killing `protofl sweep -j 2` left its forkserver workers running: they went on
    writing rounds into the sweep folder (racing a resumed sweep).  Now the workers exit with
    the driver (SIGKILL), and SIGTERM stops the sweep like Ctrl-C, recording the runs as
    stopped."""
    import os
    import signal
    import subprocess
    import sys
    import time

    base = tiny_config("fedproto", "none", rounds=5000).to_dict()
    base["federation"].update(local_epochs=1, checkpoint=False)
    path = tmp_path / "sweep.yaml"
    path.write_text(
        yaml.safe_dump({"name": "t", "base": base, "grid": {"seed": [0, 1]}, "fuse": False})
    )
    sweep_dir = tmp_path / "out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PROTOFL_HOME": str(tmp_path / "home")}
    stderr = (tmp_path / "stderr.txt").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "protofl.cli",
            "sweep",
            str(path),
            "--out",
            str(sweep_dir),
            "-j",
            "2",
            "--quiet",
            "--no-table",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            logged = _rounds_logged(sweep_dir)
            if len(logged) == 2 and min(logged) >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the sweep ended before it could be killed"
        assert _workers_of(str(tmp_path)), "found no worker to watch: the check would be vacuous"
        proc.send_signal(getattr(signal, sig))
        proc.wait(timeout=60)
        deadline = time.time() + 30
        while _workers_of(str(tmp_path)) and time.time() < deadline:
            time.sleep(0.1)
        assert _workers_of(str(tmp_path)) == []
        settled = _rounds_logged(sweep_dir)
        time.sleep(1.0)
        assert _rounds_logged(sweep_dir) == settled  # nothing writes into the folder any more
        assert max(settled) < 5000
        if sig == "SIGTERM":
            assert proc.returncode == 130
            assert "sweep stopped by signal SIGTERM" in (tmp_path / "stderr.txt").read_text()
            status = read_status(sweep_dir)
            assert status["interrupted"] is True
            assert [r["status"] for r in status["runs"]] == ["stopped", "stopped"]
    finally:
        stderr.close()
        if proc.poll() is None:
            proc.kill()
        for pid in _workers_of(str(tmp_path)):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
