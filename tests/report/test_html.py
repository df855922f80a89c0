"""report.html renders in a real headless Chromium: every image loads, no script errors; plus
the figure helpers and the optional TensorBoard logger."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from protofl.engine.runner import run_experiment
from protofl.methods.checks import tiny_config
from protofl.report.html import write_report
from protofl.report.plots import feature_norm_stats, plot_feature_norms

CHROMIUM = "/usr/bin/chromium"

PROBE = """
<script>
window.__errors = [];
window.addEventListener('error', function (e) { window.__errors.push(String(e.message)); });
window.addEventListener('load', function () {
  var imgs = document.images, broken = 0, empty = 0;
  for (var i = 0; i < imgs.length; i++) {
    var src = imgs[i].getAttribute('src') || '';
    if (src.indexOf('data:image/png;base64,') !== 0 || src.length < 100) { empty++; }
    if (!imgs[i].complete || imgs[i].naturalWidth === 0) { broken++; }
  }
  var d = document.createElement('div');
  d.id = 'probe';
  d.textContent = 'images=' + imgs.length + ' broken=' + broken + ' empty=' + empty +
    ' errors=' + window.__errors.length;
  document.body.appendChild(d);
});
</script>
"""


def _chromium() -> str:
    """Debian's chromium, installed on first use; skips the test only if that fails."""
    found = shutil.which("chromium") or (CHROMIUM if os.path.exists(CHROMIUM) else None)
    if found:
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run(["apt-get", "update"], check=True, capture_output=True, timeout=600)
        subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", "chromium"],
            check=True,
            capture_output=True,
            timeout=1200,
            env=env,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"chromium is not installed and apt-get install chromium failed: {exc}")
    found = shutil.which("chromium")
    if not found:
        pytest.skip("apt-get install chromium ran but no chromium binary is on PATH")
    return found


def _render(html_path: Path, tmp: Path, screenshot: Path | None = None) -> tuple[str, str]:
    """DOM after load (with the image probe injected into a copy) and chromium's stderr."""
    probe = tmp / f"probe-{html_path.parent.name}.html"
    probe.write_text(html_path.read_text().replace("</body>", PROBE + "</body>"))
    base = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp / 'chromium-profile'}",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=10000",
    ]
    res = subprocess.run(
        [*base, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    if screenshot is not None:
        subprocess.run(
            [*base, "--window-size=1200,2400", f"--screenshot={screenshot}", html_path.as_uri()],
            capture_output=True,
            text=True,
            timeout=120,
        )
    return res.stdout, res.stderr


def _check_page(dom: str, stderr: str, min_images: int) -> None:
    m = re.search(r"images=(\d+) broken=(\d+) empty=(\d+) errors=(\d+)", dom)
    assert m, "the probe did not run: " + dom[-500:]
    images, broken, empty, errors = map(int, m.groups())
    assert images >= min_images
    assert (broken, empty, errors) == (0, 0, 0)
    script_errors = [
        line
        for line in stderr.splitlines()
        if "Uncaught" in line or ("CONSOLE" in line and "error" in line.lower())
    ]
    assert not script_errors, script_errors


def _fake_norms(run_dir: Path) -> None:
    """Add per-client feature_norms (as the engine is asked to record them) to metrics.jsonl."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    gen = torch.Generator().manual_seed(0)
    for r in rows:
        scale = 3.0 / r["round"]
        r["feature_norms"] = {
            c: feature_norm_stats(scale * torch.randn(50, 8, generator=gen), clip=1.0)
            for c in r["acc"]
        }
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_run_report_renders_in_chromium(tmp_path: Path) -> None:
    config = tiny_config("fedproto", "vpp", rounds=2).with_overrides(
        ["run.save_releases=true", "federation.local_epochs=1"]
    )
    run_dir = run_experiment(config, out=tmp_path / "runs").run_dir
    _fake_norms(run_dir)
    (run_dir / "attack_mia.json").write_text(
        json.dumps({"attack": "mia", "mean": {"mia_auc": 0.61, "mia_advantage": 0.2}})
    )
    html_path, md_path = write_report(run_dir, tsne_points=200)
    page = html_path.read_text()
    assert "<script" not in page and "http://" not in page and "https://" not in page
    for needle in (
        "Final round",
        "Privacy ledger",
        "What the guarantee covers",
        "Resolved config",
        "Report generated with",
    ):
        assert needle in page, needle
    assert page.count('src="data:image/png;base64,') == 4  # accuracy, epsilon, norms, t-SNE
    md = md_path.read_text()
    for fig in ("accuracy", "epsilon", "feature_norms", "tsne"):
        assert f"figures/{fig}.png" in md
        assert (run_dir / "figures" / f"{fig}.svg").exists()
    assert "mia_auc" in md
    shot = tmp_path / "run-report.png"
    dom, err = _render(html_path, tmp_path, screenshot=shot)
    _check_page(dom, err, min_images=4)
    assert shot.exists() and shot.stat().st_size > 10_000
    if os.environ.get("PROTOFL_KEEP_SCREENSHOT"):
        shutil.copy(shot, os.environ["PROTOFL_KEEP_SCREENSHOT"])


def _hand_run(root: Path, name: str, mechanism: str, eps: float, seed: int, avg: float) -> None:
    d = root / name
    d.mkdir(parents=True)
    cfg = {
        "seed": seed,
        "method": {"name": "fedproto"},
        "privacy": {"mechanism": mechanism, "epsilon": eps},
    }
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    acc = {"A": avg + 0.05, "B": avg - 0.05}
    rows = [
        {
            "round": i,
            "acc": {k: v * i / 3 for k, v in acc.items()},
            "avg_acc": avg * i / 3,
            "std_acc": 0.05 * i / 3,
            "privacy": {"epsilon_spent": {"A": None if mechanism == "none" else eps * i / 3}},
        }
        for i in (1, 2, 3)
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {
        "acc": acc,
        "avg_acc": avg,
        "std_acc": 0.05,
        "rounds": 3,
        "domains": ["A", "B"],
        "wall_s": 2.0,
        "privacy": {"mechanism": mechanism, "epsilon_spent": {"A": None}},
        "environment": {"protofl": "0.1.0", "torch": torch.__version__},
    }
    (d / "summary.json").write_text(json.dumps(summary))
    if mechanism != "none":
        (d / "attack_mia.json").write_text(
            json.dumps({"mean": {"mia_auc": 0.5 + 0.02 * eps, "mia_advantage": 0.01 * eps}})
        )


def test_sweep_report_renders_in_chromium(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    rng = np.random.default_rng(0)
    i = 0
    for mech, eps_list in (("none", [1.0]), ("igpp", [0.5, 1, 2]), ("vpdr", [0.5, 1, 2])):
        for eps in eps_list:
            for seed in (0, 1):
                base = {"none": 0.8, "igpp": 0.4, "vpdr": 0.6}[mech] + 0.03 * np.log2(eps)
                _hand_run(root, f"{i:03d}", mech, eps, seed, base + rng.normal(0, 0.01))
                i += 1
    (root / "broken").mkdir()
    (root / "broken" / "config.yaml").write_text("seed: 0\n")
    html_path, md_path = write_report(root)
    page = html_path.read_text()
    assert page.count('src="data:image/png;base64,') == 3  # AVG/round, privacy-utility, attacks
    assert "Skipped folders" in page and "broken" in page
    md = md_path.read_text()
    assert "| mechanism | epsilon | n | A | B | AVG | STD |" in md
    assert "figures/privacy_utility.png" in md and "figures/attacks.png" in md
    dom, err = _render(html_path, tmp_path)
    _check_page(dom, err, min_images=3)


def test_feature_norm_stats_and_plot(tmp_path: Path) -> None:
    f = torch.zeros(4, 3)
    f[:, 0] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    stats = feature_norm_stats(f, clip=2.5)
    assert stats["n"] == 4 and stats["min"] == 1.0 and stats["max"] == 4.0
    assert stats["q50"] == pytest.approx(2.5) and stats["mean"] == pytest.approx(2.5)
    assert stats["frac_above_clip"] == 0.5
    with pytest.raises(ValueError, match="no run has feature_norms"):
        _hand_run(tmp_path, "r", "none", 1.0, 0, 0.5)
        plot_feature_norms([tmp_path / "r"], tmp_path / "fn")


def test_tensorboard_logger_is_optional(tmp_path: Path) -> None:
    from protofl.report.tensorboard import TensorBoardLogger

    row = {"round": 1, "acc": {"A": 0.5}, "avg_acc": 0.5, "std_acc": 0.0, "train_loss": 1.0}
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ImportError, match="pip install tensorboard"):
            TensorBoardLogger(tmp_path)
        return
    with TensorBoardLogger(tmp_path) as tb:  # pragma: no cover - only with tensorboard
        tb.log_round(row)
    assert any((tmp_path / "tensorboard").iterdir())  # pragma: no cover


# ----- issue 43: the report's small defects ----------------------------------------------------
def test_run_report_shows_attack_counts_as_integers_and_no_empty_header_row(
    tmp_path: Path,
) -> None:
    _hand_run(tmp_path, "run", "vpdr", 2.0, 0, 0.6)
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["privacy"]["guarantee"] = {
        "epsilon": 2.0,
        "statement": "(2, 1e-05)-local DP per client over the whole run (3 releases)",
        "noise_key": "derived",
        "not_covered": ["the trained feature map"],
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    members = {"c0": 2285, "c1": 2286, "c2": 2286, "c3": 2286}  # mean 2285.75
    (run_dir / "attack_mia.json").write_text(
        json.dumps(
            {
                "clients": {c: {"mia_auc": 0.6, "mia_members": n} for c, n in members.items()},
                "mean": {"mia_auc": 0.6, "mia_members": 2285.75, "mia_nonmembers": 800.0},
            }
        )
    )
    html_path, md_path = write_report(run_dir, tsne=False)
    md = md_path.read_text()
    assert "2285.7500" not in md and "800.0000" not in md
    assert "| mia_members (total over 4 clients) | 9143 |" in md
    assert "| mia_nonmembers (mean per client) | 800 |" in md
    assert "| mia_auc | 0.6000 |" in md
    page = html_path.read_text()
    assert "What the guarantee covers" in page
    assert not re.search(r"<thead><tr>(<th></th>)+</tr></thead>", page)  # no empty header row
    assert not re.search(r"^\|( +\|)+$", md, re.M)


def test_privacy_utility_caption_names_the_dashed_line_only_when_drawn(tmp_path: Path) -> None:
    for with_reference in (False, True):
        root = tmp_path / f"sweep-{with_reference}"
        mechanisms = (["none"] if with_reference else []) + ["igpp"]
        for i, (mech, eps) in enumerate((m, e) for m in mechanisms for e in (1.0, 2.0)):
            _hand_run(root, f"{i:03d}", mech, eps, 0, 0.5 + 0.05 * eps)
        _, md_path = write_report(root)
        md = md_path.read_text()
        caption = next(line for line in md.splitlines() if line.startswith("*Privacy-utility"))
        svg = (root / "figures" / "privacy_utility.svg").read_text()
        drawn = "stroke-dasharray" in svg  # the 'no privacy' reference is the only dashed line
        assert drawn == with_reference
        assert ("dashed" in caption) == drawn, caption
