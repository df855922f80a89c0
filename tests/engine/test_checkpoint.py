"""Checkpoints sized to the work (issue 43, item 5) and interrupts that name the command that
continues the run, with its folder (item 4)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from protofl.cli import build_parser, main
from protofl.config import ConfigError, ExperimentConfig
from protofl.engine import checkpoint
from protofl.engine.checkpoint import load_latest_checkpoint, save_checkpoint
from protofl.engine.runner import resume_experiment, run_experiment, tensor_bytes
from tests.engine.helpers import (
    checkpoint_differences,
    run_stopped_in_round,
    stop_in_round,
    toy_config,
)

TIMING = {"wall_s", "setup_s", "round_s", "run_dir", "environment"}


def toy(rounds: int = 3, *extra: str) -> ExperimentConfig:
    return toy_config(rounds, "federation.local_epochs=1", "run.save_releases=false", *extra)


def saved(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("checkpoint-*.pt"))


def comparable(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in TIMING}


# ----- only the latest N ----------------------------------------------------------------------
def test_only_the_latest_checkpoint_is_kept_by_default(tmp_path: Path) -> None:
    result = run_experiment(toy(3), out=tmp_path)
    assert saved(result.run_dir) == ["checkpoint-0003.pt"]
    index = json.loads((result.run_dir / "checkpoints.json").read_text())
    assert [e["round"] for e in index] == [3]


@pytest.mark.parametrize(
    ("keep", "expected"), [(2, [2, 3]), (0, [1, 2, 3])], ids=["latest-2", "all"]
)
def test_keep_checkpoints_keeps_the_latest_n_or_all(
    tmp_path: Path, keep: int, expected: list[int]
) -> None:
    result = run_experiment(toy(3, f"federation.keep_checkpoints={keep}"), out=tmp_path)
    assert saved(result.run_dir) == [f"checkpoint-{r:04d}.pt" for r in expected]


def test_keep_checkpoints_below_zero_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"federation\.keep_checkpoints=-1"):
        toy(3, "federation.keep_checkpoints=-1")
    with pytest.raises(ConfigError, match=r"run\.disk_warn_gb=-1"):
        toy(3, "run.disk_warn_gb=-1")


def test_a_crash_before_the_index_names_the_new_checkpoint_keeps_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New file, then the index, then deletions: a crash at any point leaves a checkpoint the
    index lists and that passes its check (never zero)."""
    one = {"round": 1, "w": torch.arange(4.0)}
    save_checkpoint(tmp_path, 1, one, keep=1)

    def crash(path: Path, data: bytes) -> None:
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "atomic_write_bytes", crash)
        with pytest.raises(OSError, match="disk full"):
            save_checkpoint(tmp_path, 2, {"round": 2, "w": torch.ones(4)}, keep=1)
    state = load_latest_checkpoint(tmp_path)
    assert state is not None and state["round"] == 1 and torch.equal(state["w"], one["w"])
    # the next save clears the file the index never named
    save_checkpoint(tmp_path, 3, {"round": 3}, keep=1)
    checkpoint.wait_for_deletions()
    assert saved(tmp_path) == ["checkpoint-0003.pt"]
    assert not list(tmp_path.glob(".checkpoint-*"))


def test_checkpoint_digest_is_the_files_and_the_mode_0600(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digest (sha256 of the pieces' sha256s, hashed on several threads as it is written)
    is the file's; an index entry of the older plain-sha256 form is still checked."""
    import hashlib

    monkeypatch.setattr(checkpoint, "CHUNK", 1000)  # many pieces, several in one write
    state = {"w": torch.randn(1000, 10), "b": [torch.arange(7)] * 3}
    path = save_checkpoint(tmp_path, 1, state)
    (entry,) = json.loads((tmp_path / "checkpoints.json").read_text())
    data = path.read_bytes()
    pieces = [hashlib.sha256(data[i : i + 1000]).digest() for i in range(0, len(data), 1000)]
    assert entry["sha256_tree"] == hashlib.sha256(b"".join(pieces)).hexdigest()
    assert entry["chunk"] == 1000 and entry["bytes"] == len(data) > 40_000
    assert path.stat().st_mode & 0o777 == 0o600
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and torch.equal(loaded["w"], state["w"])
    old = {"round": 1, "file": path.name, "sha256": hashlib.sha256(data).hexdigest()}
    (tmp_path / "checkpoints.json").write_text(json.dumps([old]))
    assert load_latest_checkpoint(tmp_path) is not None
    path.write_bytes(data[:-10] + b"x" * 10)
    with pytest.raises(checkpoint.CheckpointError, match="integrity"):
        load_latest_checkpoint(tmp_path)


def test_a_run_stopped_after_pruning_resumes_to_the_same_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = toy(4)
    full = run_experiment(cfg, out=tmp_path / "full")
    run_dir = run_stopped_in_round(cfg, 4, tmp_path / "stopped", monkeypatch)
    assert saved(run_dir) == ["checkpoint-0003.pt"]  # round 2's is gone
    resumed = resume_experiment(run_dir)
    assert comparable(resumed.summary) == comparable(full.summary)
    assert saved(run_dir) == ["checkpoint-0004.pt"]
    ours, theirs = load_latest_checkpoint(run_dir), load_latest_checkpoint(full.run_dir)
    assert checkpoint_differences(ours, theirs) == []


# ----- frozen parameters once -----------------------------------------------------------------
def _frozen_run(device: str) -> tuple[Any, dict[str, Any], int]:
    from protofl.data.cache import protofl_home
    from protofl.engine.federated_data import build_federated_data
    from protofl.engine.simulation import Simulation

    cfg = toy(
        1,
        "federation.execution=batched",
        "data.clients_per_domain=4",
        "backbone.train_projection=false",
        "backbone.proto_dim=128",
        f"run.device={device}",
    )
    sim = Simulation(cfg, build_federated_data(cfg, protofl_home()))
    sim.run()
    model = sim.clients[0].model
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    return sim, sim.state_dict(), frozen


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
        ),
    ],
)
def test_shared_frozen_parameters_are_stored_once(tmp_path: Path, device: str) -> None:
    """Every client's model holds the pooled frozen projection: the checkpoint stores it once
    (on a GPU too, where each client's copy to the CPU used to be its own), and loading it
    restores every client exactly."""
    sim, state, frozen = _frozen_run(device)
    n = len(sim.clients)
    assert n == 16 and frozen > 0
    path = save_checkpoint(tmp_path, 1, state)
    size = path.stat().st_size
    entries = tensor_bytes(state)  # each client's frozen projection counted
    assert size < entries - (n - 2) * frozen, (size, entries, frozen, n)  # stored once, not 16x
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None
    other, _, _ = _frozen_run(device)
    other.load_state_dict(loaded)
    assert checkpoint_differences(other.state_dict(), state) == []


# ----- the console: size once, disk warning once -----------------------------------------------
def test_the_first_checkpoint_prints_its_size_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_experiment(toy(3), out=tmp_path, progress=True)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("checkpoint: ")]
    assert len(lines) == 1, err
    assert re.match(r"checkpoint: \d+\.\d MB every round \(written in \d+\.\d s\)", lines[0])
    assert "keeping the latest 1 (federation.keep_checkpoints" in lines[0]
    assert "run.disk_warn_gb" not in err  # a small run: no warning
    run_experiment(toy(3), out=tmp_path, progress=False)  # quiet: the size in run.log only
    assert "checkpoint: " not in capsys.readouterr().err


def test_a_run_projected_past_the_threshold_warns_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_experiment(toy(3, "run.disk_warn_gb=0.00001"), out=tmp_path)
    err = capsys.readouterr().err
    warnings = [ln for ln in err.splitlines() if "run.disk_warn_gb=1e-05" in ln]
    assert len(warnings) == 1, err
    assert str(result.run_dir) in warnings[0] and "federation.keep_checkpoints=1" in warnings[0]
    assert "run.disk_warn_gb" in (result.run_dir / "run.log").read_text()


# ----- interrupts name the command ------------------------------------------------------------
def _command_in(err: str) -> list[str]:
    """The command between backticks in an interrupt message, split as a shell would."""
    assert err.count("`") == 2, err
    return shlex.split(err.split("`")[1])


def test_ctrl_c_names_protofl_run_resume_with_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "toy.yaml"
    config.write_text(toy(3).to_yaml())
    out = tmp_path / "runs dir"  # a space: the command must quote it
    with monkeypatch.context() as patch:
        stop_in_round(patch, 3)
        code = main(["run", str(config), "--out", str(out), "--quiet"])
    assert code == 130
    err = capsys.readouterr().err
    argv = _command_in(err)
    assert argv[:3] == ["protofl", "run", "--resume"]
    args = build_parser().parse_args(argv[1:])
    run_dir = Path(args.resume)
    assert run_dir.parent == out and (run_dir / "config.yaml").is_file()
    assert main([*argv[1:], "--quiet", "--json"]) == 0
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 3


def test_ctrl_c_during_a_resume_or_extend_names_the_same_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = run_stopped_in_round(toy(3), 2, tmp_path, monkeypatch)
    capsys.readouterr()
    with monkeypatch.context() as patch:
        stop_in_round(patch, 3)
        assert main(["run", "--resume", str(run_dir), "--quiet"]) == 130
    argv = _command_in(capsys.readouterr().err)
    assert Path(build_parser().parse_args(argv[1:]).resume) == run_dir


def test_sweep_interrupt_names_the_sweep_command_with_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from protofl import sweeps as sweep

    path = tmp_path / "sweep.yaml"
    path.write_text(
        yaml.safe_dump({"name": "t", "base": toy(2).to_dict(), "grid": {"seed": [0, 1]}})
    )
    out = tmp_path / "sw"

    def stop(*args: Any, **kwargs: Any) -> Any:
        kwargs["sweep_dir"].mkdir(parents=True)
        raise KeyboardInterrupt("signal SIGTERM")

    monkeypatch.setattr(sweep, "run_sweep", stop)
    code = main(["sweep", str(path), "--out", str(out), "--set", "seed=[3,4]", "--quiet"])
    assert code == 130
    err = capsys.readouterr().err
    assert "SIGTERM" in err
    argv = _command_in(err)
    args = build_parser().parse_args(argv[1:])
    assert args.command == "sweep" and Path(args.out) == out and out.is_dir()
    assert args.sweep_file == str(path) and args.set == ["seed=[3,4]"]


def test_sigterm_during_a_run_names_the_command_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kill PID` (SIGTERM) of `protofl run` stops like Ctrl-C: exit 130, the command printed."""
    import os
    import signal

    from protofl.engine import simulation

    original = simulation.Simulation.run_round

    def killed(self: simulation.Simulation) -> simulation.RoundMetrics:
        if self.round == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self)

    config = tmp_path / "toy.yaml"
    config.write_text(toy(3).to_yaml())

    def reached_the_test(signum: int, frame: Any) -> None:  # main had no handler: fail cleanly
        raise RuntimeError("SIGTERM was not handled by the run")

    previous = signal.signal(signal.SIGTERM, reached_the_test)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(simulation.Simulation, "run_round", killed)
            code = main(["run", str(config), "--out", str(tmp_path / "runs"), "--quiet"])
        assert signal.getsignal(signal.SIGTERM) is reached_the_test  # the handler is put back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 130
    err = capsys.readouterr().err
    assert "stopped (signal SIGTERM)" in err
    args = build_parser().parse_args(_command_in(err)[1:])
    assert (Path(args.resume) / "checkpoint-0001.pt").is_file()
