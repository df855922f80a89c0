"""Run folders: resume is exact or refuses, one process per folder, no debris from bad input."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml

from protofl.cli import main
from protofl.config import ConfigError
from protofl.engine.rundir import RECORD, FolderLock, LockError, check_resume, claim_dir
from protofl.engine.runner import resume_experiment, run_experiment
from protofl.methods.checks import tiny_config


def _edit(run_dir: Path, key: str, value: object) -> None:
    data = yaml.safe_load((run_dir / "config.yaml").read_text())
    node = data
    *path, last = key.split(".")
    for part in path:
        node = node[part]
    node[last] = value
    (run_dir / "config.yaml").write_text(yaml.safe_dump(data))


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = tiny_config("fedproto", "igpp", rounds=2).with_overrides(["privacy.epsilon=1"])
    return run_experiment(config, out=tmp_path_factory.mktemp("runs")).run_dir


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("federation.rounds", 5, "federation.rounds: 2 -> 5"),  # privacy: recalibrates sigma
        ("privacy.epsilon", 8.0, "privacy.epsilon: 1.0 -> 8.0"),  # the label of the numbers
        ("method.name", "fpl", "method.name: 'fedproto' -> 'fpl'"),
        ("seed", 3, "seed: 0 -> 3"),
        ("data.name", "digits4", "data.name: 'toy' -> 'digits4'"),
    ],
)
def test_resume_of_an_edited_config_is_refused_naming_the_key(
    finished: Path, key: str, value: object, shown: str, tmp_path: Path
) -> None:
    import shutil

    run_dir = tmp_path / "copy"
    shutil.copytree(finished, run_dir)
    _edit(run_dir, key, value)
    with pytest.raises(ConfigError) as info:
        resume_experiment(run_dir)
    assert shown in str(info.value) and "never changes what a run was" in str(info.value)


def test_result_free_keys_may_change_on_resume(finished: Path, tmp_path: Path) -> None:
    import shutil

    run_dir = tmp_path / "copy"
    shutil.copytree(finished, run_dir)
    summary = (run_dir / "summary.json").read_text()
    _edit(run_dir, "run.progress", True)
    _edit(run_dir, "run.threads", 2)
    result = resume_experiment(run_dir, progress=False)
    assert result.run_dir == run_dir and '"avg_acc"' in summary


def test_a_flower_run_is_not_resumed_on_the_simulator(tmp_path: Path) -> None:
    from protofl.engine.rundir import write_record

    config = tiny_config("fedproto", "igpp", rounds=1)
    (tmp_path / "config.yaml").write_text(config.to_yaml())
    write_record(tmp_path, config, engine="flower")
    with pytest.raises(ConfigError, match="'flower' engine"):
        check_resume(tmp_path, config)
    assert (tmp_path / RECORD).exists()


def test_one_process_per_folder_and_the_message_names_the_holder(tmp_path: Path) -> None:
    import os

    from protofl.sweeps import plan_sweep, run_sweep

    with FolderLock(tmp_path / "sweep", "sweep"):
        with pytest.raises(LockError, match=f"in use by process {os.getpid()}"):
            FolderLock(tmp_path / "sweep", "sweep").acquire()
        plan = plan_sweep(
            {
                "name": "s",
                "base": tiny_config("local", "none", rounds=1).to_dict(),
                "grid": {"seed": [0]},
            }
        )
        with pytest.raises(LockError, match="another sweep is running there"):
            run_sweep(plan, sweep_dir=tmp_path / "sweep", jobs=1, progress=False)
    FolderLock(tmp_path / "sweep").acquire()  # released: free again


def test_run_folder_names_are_claimed_atomically(tmp_path: Path) -> None:
    got: list[Path] = []
    errors: list[BaseException] = []
    for trial in range(20):
        barrier = threading.Barrier(2)

        def claim(trial: int = trial, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                got.append(claim_dir(tmp_path, f"20261201-000000-run{trial}"))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=claim) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == [] and len(set(got)) == 40


def test_bad_input_leaves_no_folder_and_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs"
    base = tiny_config("fedproto", "igpp", rounds=1)
    for override, needle in (
        ("method.name=fedprot", "did you mean 'fedproto'"),
        ("data.name=nope", "valid data sets"),
        ("data.root=/no/such/dir", "data.root='/no/such/dir' does not exist"),
    ):
        with pytest.raises(ValueError, match=needle):
            run_experiment(base.with_overrides([override]), out=out)
    assert not out.exists() or list(out.iterdir()) == []
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.yaml").write_text("seed: 0\n")
    assert main(["run", str(tmp_path / "folder")]) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err and "--resume" in err and "Traceback" not in err
    (tmp_path / "binary.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    assert main(["run", str(tmp_path / "binary.yaml")]) == 2
    assert f"config file {tmp_path / 'binary.yaml'} is not a text (YAML) file" in (
        capsys.readouterr().err
    )


def test_resume_on_another_engine_is_refused_in_one_line(
    finished: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--resume", str(finished), "--engine", "flower"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "made by the 'sim' engine" in err and "not on the 'flower' engine" in err
