"""Sweeps: every point validated before anything runs; finished runs skipped, a stopped run
resumed, a failing run reported without stopping the others; every point on the engine its
``run.engine`` names."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from protofl.config import ConfigError, ExperimentConfig
from protofl.engine.engines import (
    ENGINE_REGISTRY,
    EngineOptions,
    in_dir_engine,
    run_engine_in_dir,
)
from protofl.engine.rundir import read_client_summary, read_record, write_record
from protofl.methods.checks import tiny_config
from protofl.report.cli import add_report_parsers
from protofl.sweeps import (
    LOG_FILE,
    execute_point,
    format_sweep_result,
    fusion_groups,
    load_sweep,
    plan_sweep,
    read_status,
    run_sweep,
)


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
    import protofl.sweeps.schedule as schedule
    from protofl.data.toy import make_toy
    from protofl.sweeps import run_selection

    state = {"chosen": False}

    def load(config: Any, home: Path) -> Any:
        toy = make_toy()
        for dom in toy.domains:
            if permute_test:
                labels = np.random.default_rng(0).permutation(dom.test.labels)
                object.__setattr__(dom.test, "labels", labels)
            object.__setattr__(dom.test, "images", _Guarded(dom.test.images, state))
        return toy

    real_choose = schedule.choose

    def choose(*args: Any, **kwargs: Any) -> Any:
        out = real_choose(*args, **kwargs)
        state["chosen"] = True
        return out

    monkeypatch.setattr(federated_data, "load_dataset", load)
    monkeypatch.setattr(schedule, "choose", choose)
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


# ----- run.engine: every point on its engine (the registry), resumed there ---------------------
# On main a sweep point called the simulator's run_in_dir directly: a sweep whose base or grid
# set run.engine: flower ran every point in the in-process simulator (and fused batched ones into
# the simulator's fused program), silently.
def _engine_base(engine: str = "flower", **federation: Any) -> dict[str, Any]:
    base = _base()
    base["federation"].update(federation)
    base["run"]["engine"] = engine
    return base


def _engine_plan(grid: dict[str, list[Any]], base: dict[str, Any] | None = None) -> Any:
    return plan_sweep({"name": "e", "base": base or _engine_base(), "grid": grid})


@dataclasses.dataclass
class _Result:
    run_dir: Path | None
    summary: dict[str, Any]


def _fake_engine(monkeypatch: pytest.MonkeyPatch, name: str) -> list[dict[str, Any]]:
    """Replace the registered ``name`` engine's in-folder runner with one that records each
    call and writes a finished run folder of that engine (no Flower, no Ray)."""
    calls: list[dict[str, Any]] = []

    def run_in_dir(
        config: ExperimentConfig, run_dir: Path, options: EngineOptions, resume: bool
    ) -> _Result:
        calls.append(
            {
                "engine": config.run.engine,
                "dir": run_dir.name,
                "resume": resume,
                "flower": dict(options.flower),
                "home": options.home,
                "progress": options.progress,
            }
        )
        if read_record(run_dir) is None:
            write_record(run_dir, config, engine=name)
        summary = {"engine": name, "avg_acc": 0.5, "rounds": config.federation.rounds}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return _Result(run_dir, summary)

    engine = dataclasses.replace(ENGINE_REGISTRY.get(name), run_in_dir=run_in_dir)
    monkeypatch.setitem(ENGINE_REGISTRY._items, name, engine)
    return calls


def test_sweep_points_run_on_the_flower_engine_resume_there_and_never_fuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run.engine=flower in the base: every point goes to the flower engine (with the sweep's
    flower options and cache home), a point with checkpoints is resumed there, and batched
    points that would fuse on the simulator each run on their own."""
    calls = _fake_engine(monkeypatch, "flower")
    plan = _engine_plan({"seed": [0, 1, 2]}, _engine_base(execution="batched"))
    assert [len(t) for t in fusion_groups(plan.points)] == [1, 1, 1]
    sweep_dir = tmp_path / "s"
    stopped = plan.points[1].run_dir(sweep_dir)  # killed after its first round
    stopped.mkdir(parents=True)
    write_record(stopped, plan.points[1].config, engine="flower")
    (stopped / "checkpoints.json").write_text(json.dumps([{"round": 1, "file": "x.pt"}]))
    home = tmp_path / "home"

    result = run_sweep(
        plan,
        sweep_dir=sweep_dir,
        jobs=1,
        home=home,
        progress=False,
        flower={"backend": "inline"},
    )

    assert [(r.status, r.action, r.fused) for r in result.runs] == [
        ("done", "ran", None),
        ("done", "resumed", None),
        ("done", "ran", None),
    ]
    assert result.runs[1].resumed_from == 1
    assert calls == [
        {
            "engine": "flower",
            "dir": p.dirname,
            "resume": p.index == 1,
            "flower": {"backend": "inline"},
            "home": home,
            "progress": False,
        }
        for p in plan.points
    ]
    assert "fused group" not in (
        (sweep_dir / LOG_FILE).read_text() if (sweep_dir / LOG_FILE).exists() else ""
    )
    # the same grid on the simulator fuses (so the check above is not vacuous)
    sim = _engine_plan({"seed": [0, 1, 2]}, _engine_base("sim", execution="batched"))
    assert [len(t) for t in fusion_groups(sim.points)] == [3]


def test_a_grid_axis_over_run_engine_sends_each_point_to_its_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flower = _fake_engine(monkeypatch, "flower")
    sim = _fake_engine(monkeypatch, "sim")
    plan = _engine_plan({"run.engine": ["sim", "flower"]}, _engine_base("sim"))
    result = run_sweep(plan, sweep_dir=tmp_path / "s", jobs=1, progress=False)
    assert [r.status for r in result.runs] == ["done", "done"]
    assert [c["dir"] for c in sim] == [plan.points[0].dirname]
    assert [c["dir"] for c in flower] == [plan.points[1].dirname]


@pytest.mark.parametrize(
    ("engine", "needle"),
    [
        ("flower-loopback", "run.engine='flower-loopback' cannot run in a run folder it is given"),
        ("flwr", "run.engine='flwr': unknown engine 'flwr' (did you mean 'flower'?)"),
    ],
)
def test_an_engine_that_cannot_run_a_sweep_point_is_refused_before_anything_is_created(
    tmp_path: Path, engine: str, needle: str
) -> None:
    with pytest.raises(ConfigError) as err:
        _engine_plan({"seed": [0, 1]}, _engine_base(engine))
    assert needle in str(err.value) and "grid point 0 (seed=0)" in str(err.value)
    assert "\n" not in str(err.value)
    # a plan made otherwise (the points' configs changed after planning): run_sweep refuses
    # it before the sweep folder exists
    plan = _engine_plan({"seed": [0, 1]}, _engine_base("sim"))
    bad = plan.points[1].config.with_overrides([f"run.engine={engine}"])
    plan.points[1] = dataclasses.replace(plan.points[1], config=bad)
    with pytest.raises(ConfigError, match=r"grid point 1 \(seed=1\): run\.engine="):
        run_sweep(plan, sweep_dir=tmp_path / "s", jobs=1, progress=False)
    assert not (tmp_path / "s").exists()
    # and the engine functions say the same without a sweep
    with pytest.raises(ConfigError, match=r"run\.engine="):
        in_dir_engine(bad)
    with pytest.raises(ConfigError, match=r"run\.engine="):
        run_engine_in_dir(bad, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_point_run_on_another_engine_is_not_reused(tmp_path: Path) -> None:
    """A sweep folder whose point finished on the simulator (as every point did on main, whatever
    its run.engine) is not this point's result on Flower: refused, naming both."""
    plan = _engine_plan({"seed": [0]})
    d = plan.points[0].run_dir(tmp_path / "s")
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(plan.points[0].config.to_yaml())
    write_record(d, plan.points[0].config, engine="sim")
    (d / "summary.json").write_text(json.dumps({"avg_acc": 0.5, "rounds": 2}))
    with pytest.raises(ConfigError, match="run on the 'sim' engine, and this point has"):
        run_sweep(plan, sweep_dir=tmp_path / "s", jobs=1, progress=False)


def test_the_flower_engine_starts_afresh_or_resumes_in_a_given_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flower in a given folder: a fresh start leaves nothing of an earlier attempt that a
    Flower run would continue from (server checkpoints, the nodes' client state) and records
    the folder as Flower's; a resume continues only a Flower run of this config."""
    import protofl.engine.flower.run as flower_run

    calls: list[tuple[Path, dict[str, Any]]] = []

    def resume(run_dir: Path, **kwargs: Any) -> _Result:
        calls.append((run_dir, kwargs))
        return _Result(run_dir, {})

    monkeypatch.setattr(flower_run, "resume_flower_simulation", resume)
    config = ExperimentConfig.from_dict(_engine_base())
    d = tmp_path / "run"
    (d / "nodes" / "partition-0").mkdir(parents=True)
    (d / "nodes" / "partition-0" / "state.pt").write_bytes(b"stale")
    (d / "checkpoints.json").write_text("[]")
    (d / "checkpoint-0001.pt").write_bytes(b"stale")
    options = EngineOptions(progress=False, flower={"backend": "inline"}, home=tmp_path / "h")
    run_engine_in_dir(config, d, options, resume=False)
    assert not (d / "nodes").exists() and not list(d.glob("checkpoint*"))
    assert read_record(d)["engine"] == "flower"  # type: ignore[index]
    assert ExperimentConfig.from_yaml(d / "config.yaml").to_dict() == config.to_dict()
    assert calls == [(d, {"home": tmp_path / "h", "progress": False, "backend": "inline"})]
    run_engine_in_dir(config, d, options, resume=True)  # the Flower run it now is
    assert len(calls) == 2
    # a folder the simulator made, or one of another config, does not resume on Flower
    sim_made = tmp_path / "sim"
    sim_made.mkdir()
    write_record(sim_made, config, engine="sim")
    with pytest.raises(ConfigError, match=r"made by the 'sim' engine.*run\.engine='flower'"):
        run_engine_in_dir(config, sim_made, options, resume=True)
    other = config.with_overrides(["federation.lr=0.5"])
    with pytest.raises(ConfigError, match=r"federation\.lr"):
        run_engine_in_dir(other, d, options, resume=True)
    assert len(calls) == 2


def test_a_flower_sweep_point_runs_on_flower_and_resumes_there(tmp_path: Path) -> None:
    """One real point on Flower (inline backend, no Ray; ~5 s): its folder is a Flower run
    folder, and a point killed after round 1 resumes on Flower to the uninterrupted numbers."""
    pytest.importorskip("flwr")
    plan = _engine_plan({"seed": [0]})
    sweep_dir = tmp_path / "s"

    def sweep() -> Any:
        return run_sweep(
            plan,
            sweep_dir=sweep_dir,
            jobs=1,
            home=tmp_path / "home",
            progress=False,
            flower={"backend": "inline"},
        )

    (run,) = sweep().runs
    assert (run.status, run.action) == ("done", "ran"), run.error
    d = sweep_dir / run.dir
    assert read_record(d)["engine"] == "flower"  # type: ignore[index]
    uninterrupted = json.loads((d / "summary.json").read_text())
    assert uninterrupted["engine"] == "flower"
    assert sorted(p.name for p in (d / "nodes").iterdir()) == ["partition-0", "partition-1"]

    _stop_after_first_round(d)
    (run,) = sweep().runs
    assert (run.status, run.action, run.resumed_from) == ("done", "resumed", 1), run.error
    resumed = json.loads((d / "summary.json").read_text())
    assert resumed["engine"] == "flower"
    for key in ("acc", "avg_acc"):
        assert resumed[key] == uninterrupted[key], key
    assert len((d / "metrics.jsonl").read_text().splitlines()) == 2


def test_sweep_workers_register_the_drivers_diagnostic_hooks(tmp_path: Path) -> None:
    """A point that asks for the membership diagnostic (run.mia_every) runs in a worker process
    with the hook the driver registered (protofl.attacks; the engine never imports it)."""
    from protofl.engine.hooks import hook_modules
    from protofl.engine.rundir import DIAGNOSTICS, client_local_dir

    assert "protofl.attacks.mia" in hook_modules()
    path = _sweep_file(tmp_path, {"seed": [0, 1]})
    plan = load_sweep(path, ["run.mia_every=1"])
    result = run_sweep(plan, sweep_dir=tmp_path / "sweep", jobs=2, fuse=False, progress=False)
    assert [r.status for r in result.runs] == ["done", "done"], [r.error for r in result.runs]
    for p in plan.points:
        local = client_local_dir(p.run_dir(tmp_path / "sweep")) / DIAGNOSTICS
        rows = [json.loads(row) for row in local.read_text().splitlines()]
        assert rows and all(row["mia"] for row in rows)
