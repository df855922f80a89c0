"""The worked examples in examples/ run offline, as a user runs them, and say what they promise."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: Path, timeout: float = 300.0) -> str:
    res = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=script.parent,
        env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "PYTHONUNBUFFERED": "1"},
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res.stdout


def _accuracies(out: str) -> list[float]:
    line = next(s for s in out.splitlines() if s.startswith("accuracy per client:"))
    return [float(v) for v in line.split(":")[1].split()]


def test_plain_pytorch_loop_adds_vpdr_to_fedproto() -> None:
    out = _run(EXAMPLES / "plain_pytorch_fedproto.py")
    assert min(_accuracies(out)) > 0.8
    eps = float(re.search(r"epsilon spent per client: ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert 3.9 < eps <= 4.0
    assert "noise key secret; complete" in out


def test_the_facade_ledger_agrees_with_dp_accounting() -> None:
    out = _run(EXAMPLES / "dp_accounting_ledger.py")
    for name in ("IGPP", "VPP"):
        m = re.search(rf"{name}, 20 releases: protofl ([0-9.]+), dp-accounting PLD ([0-9.]+)", out)
        assert m, out
        assert abs(float(m.group(1)) - float(m.group(2))) < 0.01
    assert "IGPP + your Laplace counts" in out


@pytest.mark.slow
def test_flower_app_releases_through_the_facade() -> None:
    pytest.importorskip("flwr")
    pytest.importorskip("ray")
    out = _run(EXAMPLES / "flower_prototypes" / "run.py")
    rounds = re.findall(r"round (\d+): 3 releases, max epsilon spent ([0-9.]+)", out)
    assert [int(r) for r, _ in rounds] == [1, 2, 3, 4, 5]
    assert 3.9 < float(rounds[-1][1]) <= 4.0
    assert min(_accuracies(out)) > 0.8
