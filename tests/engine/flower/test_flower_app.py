"""The generated Flower App runs as printed (issue 43 item 1) and Flower runs show progress
without third-party noise (item 7)."""

from __future__ import annotations

import argparse
import logging
import tomllib
import warnings
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from protofl.engine.flower.app import TYPED_KEYS, write_flower_app
from protofl.engine.flower.client_app import config_from_run_config, make_client_app
from protofl.engine.flower.inline import InlineGrid
from protofl.engine.flower.run import quiet_flower, run_flower_app_command, run_flower_simulation
from protofl.engine.flower.server_app import run_flower_server
from protofl.methods.checks import tiny_config


def _app_config(path: Path) -> dict[str, object]:
    return tomllib.loads((path / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]  # type: ignore[no-any-return]


def test_the_printed_command_sets_one_supernode_per_client(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny_config("fedproto", "vpdr", clients_per_domain=2)  # 4 clients
    yaml = tmp_path / "c.yaml"
    yaml.write_text(config.to_yaml())
    args = argparse.Namespace(
        config=str(yaml), set=None, out_dir=str(tmp_path / "app"), runs=None,
        round_timeout=60.0, num_supernodes=None,
    )  # fmt: skip
    assert run_flower_app_command(args) == 0
    out = capsys.readouterr().out
    # flwr 1.42's `local` SuperLink starts 2 SuperNodes unless the run says otherwise
    assert '--federation-config "num-supernodes=4"' in out
    assert f"flwr run {tmp_path / 'app'} local --stream" in out
    readme = (tmp_path / "app" / "README.md").read_text()
    assert 'flwr run . local --stream --federation-config "num-supernodes=4"' in readme


def test_typed_app_config_keys_apply_over_the_full_config(tmp_path: Path) -> None:
    config = tiny_config("fedproto", "vpdr", rounds=3, seed=0)
    app = write_flower_app(tmp_path / "app", config, num_supernodes=2)
    rc = _app_config(app)
    assert {k: rc[k] for k in TYPED_KEYS} == {
        "method": "fedproto",
        "mechanism": "vpdr",
        "epsilon": 8.0,
        "rounds": 3,
        "dataset": "toy",
        "seed": 0,
    }
    assert config_from_run_config(rc).to_dict() == config.to_dict()  # untouched: the same
    # a typed key overrides protofl-config; protofl-set overrides both
    edited = config_from_run_config({**rc, "rounds": 2, "epsilon": 4.0, "seed": 5})
    assert (edited.federation.rounds, edited.privacy.epsilon, edited.seed) == (2, 4.0, 5)
    both = config_from_run_config({**rc, "rounds": 2, "protofl-set": "federation.rounds=7"})
    assert both.federation.rounds == 7


def test_a_federation_that_cannot_start_fails_and_leaves_no_run_folder(tmp_path: Path) -> None:
    """Fewer nodes than clients: the ServerApp raises (Flower marks the run failed), naming
    the fix, and removes the run folder it had started, which would hold no round."""
    config = tiny_config("fedproto", "vpdr", rounds=1)
    grid = InlineGrid(make_client_app(config, tmp_path / "home"), 1)  # 1 node, 2 clients
    runs = tmp_path / "runs"
    with pytest.raises(TimeoutError, match='num-supernodes=2"'):
        run_flower_server(
            grid, config, out=runs, min_nodes=None, round_timeout=10.0, wait_timeout=0.5
        )
    assert list(runs.iterdir()) == []


def test_flower_engine_shows_a_rounds_bar_and_a_start_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny_config("fedproto", "vpdr", rounds=2)
    run_flower_simulation(config, home=tmp_path, backend="inline", progress=True)
    err = capsys.readouterr().err
    assert "starting Flower" in err
    assert "rounds" in err and "2/2" in err


def test_flowers_deprecation_notice_and_rays_future_warning_are_silenced() -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    flwr_log = logging.getLogger("flwr")
    handler = Keep()
    flwr_log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with quiet_flower():
                from flwr.supercore.logger import warn_deprecated_feature

                warn_deprecated_feature("The `run_simulation` function is deprecated.")
                warnings.warn(
                    "Tip: ... set RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0", FutureWarning, stacklevel=1
                )
            warn_deprecated_feature("something else")  # outside: untouched
    finally:
        flwr_log.removeHandler(handler)
    assert not [w for w in caught if "RAY_ACCEL" in str(w.message)]
    texts = [r.getMessage() for r in records]
    assert not any("run_simulation" in t for t in texts)
    assert any("something else" in t for t in texts)


def test_the_audit_prints_a_line_while_it_runs(capsys: pytest.CaptureFixture[str]) -> None:
    import time

    from protofl.attacks.cli import _ticker
    from protofl.progress import progress_notes

    with progress_notes(True), _ticker("audit", "release", every=0.05):
        time.sleep(0.3)
    assert "audit, release mode: still running" in capsys.readouterr().err
