"""run.device: parsing, resolution, the moves, autocast; GPU-only checks are marked ``gpu``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from protofl.config import ExperimentConfig
from protofl.errors import ConfigError
from protofl.models.backbones import create_backbone
from protofl.models.device import (
    autocast,
    check_device_setting,
    describe_device,
    move_attributes,
    prepare_device,
    resolve_device,
    to_cpu,
    to_device,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU")


@pytest.mark.parametrize("setting", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_valid_settings_parse(setting: str) -> None:
    check_device_setting(setting)
    assert ExperimentConfig.from_dict({"run": {"device": setting}}).run.device == setting


@pytest.mark.parametrize("setting", ["gpu", "cuda:", "CUDA", "cuda:x", "mps:0", ""])
def test_bad_settings_fail_naming_the_key(setting: str) -> None:
    with pytest.raises(ConfigError, match=r"run\.device="):
        ExperimentConfig.from_dict({"run": {"device": setting}})


def test_old_configs_get_the_default() -> None:
    cfg = ExperimentConfig.from_dict({"run": {"progress": False}})
    assert cfg.run.device == "auto" and cfg.run.amp == "none"
    with pytest.raises(ConfigError, match=r"run\.amp"):
        ExperimentConfig.from_dict({"run": {"amp": "fp16"}})


def test_cpu_and_auto_resolve_here() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert describe_device(torch.device("cpu")) == {"device": "cpu", "type": "cpu", "name": "cpu"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_is_one_line_naming_the_setting() -> None:
    for setting in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError) as info:
            resolve_device(setting)
        message = str(info.value)
        assert "\n" not in message and f"run.device={setting}" in message
        assert "no CUDA GPU" in message


def test_to_device_and_to_cpu_keep_structure_and_do_not_copy_on_cpu() -> None:
    t = torch.arange(3.0)
    value = {"a": t, "b": [t, (t, 1)], "c": "text"}
    moved = to_device(value, torch.device("cpu"))
    assert moved["a"] is t and moved["b"][0] is t and moved["b"][1][0] is t
    assert moved["c"] == "text" and isinstance(moved["b"][1], tuple)
    assert to_cpu(value)["a"] is t


def test_move_attributes_moves_a_backbones_tensors() -> None:
    bb = create_backbone("pixels", 8)
    before = bb.matrix
    move_attributes(bb, torch.device("cpu"))
    assert bb.matrix is before  # already there: nothing copied
    bb.to("cpu")
    out = bb.encode(torch.zeros(2, 8, 8, 3, dtype=torch.uint8).numpy(), device="cpu")
    assert out.shape == (2, 256) and out.device.type == "cpu"


def test_bf16_autocast_on_cpu() -> None:
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with autocast(torch.device("cpu"), "bf16"):
        assert lin(x).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), "none"):
        assert lin(x).dtype == torch.float32


@pytest.mark.gpu
@needs_cuda
def test_cuda_is_deterministic_and_described() -> None:
    device = prepare_device("cuda")
    assert device.type == "cuda"
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"]
    info = describe_device(device)
    assert info["type"] == "cuda" and info["name"]
    with pytest.raises(ConfigError, match="torch sees"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.gpu
@needs_cuda
def test_backbone_encodes_on_cuda_like_cpu() -> None:
    import numpy as np

    images = np.random.default_rng(0).integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)
    cpu = create_backbone("pixels", 16).encode(images)
    gpu = create_backbone("pixels", 16).encode(images, device="cuda")
    assert gpu.device.type == "cpu"
    torch.testing.assert_close(gpu, cpu, atol=1e-5, rtol=1e-5)


def test_the_gpu_checks_python_part_runs_on_cpu_with_dry_run(tmp_path: Path) -> None:
    """benchmarks/gpu_check.py --dry-run: every section at tiny sizes, so the script is known
    to work before anyone spends GPU time."""
    out = tmp_path / "results-gpu.json"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "gpu_check.py"),
            "--dry-run",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["dry_run"] is True and res["device"]["name"] == "cpu"
    assert res["encode"]["images_per_s"] > 0
    assert set(res["train"]) >= {"M4", "M8"} and res["train"]["M4"]["train_round_s"] > 0
    assert res["vpdr"]["vpdr"]["round_s"] > 0 and res["vpdr"]["vpdr_over_igpp"] > 0
    assert res["vit"]["clients"] == 4 and 0.0 <= res["vit"]["avg_acc"] <= 1.0
    # without --dry-run it refuses a machine without a GPU instead of timing the CPU
    if not torch.cuda.is_available():
        refused = subprocess.run(
            [
                sys.executable,
                str(root / "benchmarks" / "gpu_check.py"),
                "--device",
                "cpu",
                "--out",
                str(tmp_path / "x.json"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert refused.returncode == 2 and "no GPU" in refused.stderr
