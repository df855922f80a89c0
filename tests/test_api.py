"""``protofl.api.run``: the documented Python API runs what ``protofl run`` runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protofl.api import run
from protofl.config import ConfigError
from protofl.methods.checks import tiny_config


def test_run_takes_a_config_mapping_or_yaml_and_returns_the_summary(tmp_path: Path) -> None:
    config = tiny_config("fedproto", "igpp", rounds=1)
    summary = run(config, overrides=["seed=1"], out=tmp_path / "a")
    run_dir = Path(summary["run_dir"])
    assert json.loads((run_dir / "summary.json").read_text())["avg_acc"] == summary["avg_acc"]
    assert 0.0 <= summary["avg_acc"] <= 1.0
    # run folders are named after what ran when the config has no name of its own
    unnamed = config.with_overrides(["name=default"])
    again = run(unnamed, out=tmp_path / "b")
    assert Path(again["run_dir"]).name.endswith("-fedproto-igpp")
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text(config.to_yaml())
    assert run(yaml_path, out=tmp_path / "c")["method"] == "fedproto"


def test_bad_input_fails_in_one_line_before_any_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"federation\.rounds"):
        run({"federation": {"rounds": 0}}, out=tmp_path / "x")
    with pytest.raises(TypeError, match="list of 'key=value' strings"):
        run(None, overrides="seed=1", out=tmp_path / "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be"):
        run(3, out=tmp_path / "x")  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()


def test_protofl_run_is_the_api_and_importing_the_package_stays_cheap() -> None:
    """Issue 43: the documented ``protofl.run(config)``; ``import protofl`` loads no torch."""
    import subprocess
    import sys

    import protofl

    assert protofl.run is run
    with pytest.raises(AttributeError, match="no attribute 'runn'"):
        protofl.runn  # noqa: B018
    code = "import sys, protofl; assert 'torch' not in sys.modules; print(protofl.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == protofl.__version__
