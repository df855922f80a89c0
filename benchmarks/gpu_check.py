"""The timings of the GPU check (benchmarks/gpu_check.sh): one JSON file, figures from one run.

Sections (each timed after a warm-up where it repeats; CUDA synchronised around every timing):

* ``encode``: EfficientNet-Lite0 feature encoding of random images (images/s, the batch size
  chosen from free memory);
* ``batched_train``: one round of batched local training (FedProto, random 1280-d features,
  digits4-like sizes) at M = 100 (default model) and M = 1000 (frozen projection);
* ``vpdr_round``: one whole round (uploads, VPDR releases on the CPU, aggregation, training,
  evaluation) at M = 100, batched;
* ``vit_small_224``: one FedProto round of the per-block-adapter ViT-S/16 at 224 px with random
  weights (``vit_random_small``, an adapter after every block, no prefix cache) at PACS scale:
  4 clients, 3,000 training images, 200 test images per domain.

``--dry-run`` shrinks every size so the script runs on a CPU in seconds (the test suite runs it
that way, so the script is known to work before anyone spends GPU time).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protofl.config import ExperimentConfig
from protofl.data.features import cached_features, encode_batch_size
from protofl.engine.federated_data import ClientData, FederatedData
from protofl.engine.simulation import Simulation
from protofl.models.backbones import create_backbone
from protofl.models.device import describe_device, prepare_device

# --dry-run: a small client model on 64-d features (the real sizes: 1280-d, the defaults)
DRY_MODEL = {"backbone.proto_dim": 32, "backbone.adapter_hidden": 8}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Any) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _config(device: str, overrides: dict[str, Any]) -> ExperimentConfig:
    base = {
        "run.device": device,
        "run.progress": "false",
        "federation.checkpoint": "false",
        "federation.rounds": "3",
        "privacy.warn_min_count": "0",
    }
    base.update(
        {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in overrides.items()}
    )
    return ExperimentConfig().with_overrides([f"{k}={v}" for k, v in base.items()])


def synthetic_data(
    clients: int, per_client: int, dim: int, classes: int, test: int, seed: int = 0
) -> FederatedData:
    """Random features (four domains, each client ``per_client`` rows) in FederatedData form."""
    g = torch.Generator().manual_seed(seed)
    domains = ("d0", "d1", "d2", "d3")
    tests = [
        (torch.randn(test, dim, generator=g), torch.randint(0, classes, (test,), generator=g))
        for _ in domains
    ]
    out = []
    for i in range(clients):
        d = i % len(domains)
        out.append(
            ClientData(
                client=i,
                name=f"{domains[d]}-{i}",
                domain=d,
                domain_name=domains[d],
                train_z=torch.randn(per_client, dim, generator=g),
                train_y=torch.randint(0, classes, (per_client,), generator=g),
                test_z=tests[d][0],
                test_y=tests[d][1],
                train_indices=np.arange(per_client),
            )
        )
    return FederatedData(
        clients=out,
        classes=tuple(str(c) for c in range(classes)),
        domains=domains,
        feature_dim=dim,
        dataset="synthetic",
        real_domains={d: False for d in domains},
    )


def encode_section(device: torch.device, dry: bool) -> dict[str, Any]:
    n, size, name = (16, 32, "pixels") if dry else (2048, 224, "efficientnet_lite0")
    images = np.random.default_rng(0).integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    backbone = create_backbone(name, size)
    batch = encode_batch_size(backbone, images, device)

    def run() -> None:
        cached_features(
            Path("."), backbone, "gpu-check", "x", "train", images, use_cache=False, device=device
        )

    run()  # warm-up (kernels, the move to the device)
    wall = _timed(device, run)
    return {
        "backbone": name,
        "images": n,
        "size": size,
        "batch": batch,
        "wall_s": wall,
        "images_per_s": n / wall,
    }


def train_section(device: str, dev: torch.device, dry: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m, per, frozen in (
        ((4, 12, False), (8, 4, True))
        if dry
        else (
            (100, 91, False),
            (1000, 16, True),
        )
    ):
        over = {"federation.execution": "batched", "backbone.train_projection": not frozen}
        cfg = _config(device, {**over, **(DRY_MODEL if dry else {})})
        sim = Simulation(cfg, synthetic_data(m, per, 64 if dry else 1280, 10, 64 if dry else 500))
        clients = list(sim.clients)
        sim.train_active(clients)  # warm-up round
        wall = _timed(dev, lambda: sim.train_active(clients))  # noqa: B023
        out[f"M{m}"] = {
            "clients": m,
            "samples_per_client": per,
            "frozen_projection": frozen,
            "train_round_s": wall,
        }
    return out


def vpdr_section(device: str, dev: torch.device, dry: bool) -> dict[str, Any]:
    m, per = (4, 12) if dry else (100, 91)
    out: dict[str, Any] = {}
    for mech in ("igpp", "vpdr"):
        over = {"federation.execution": "batched", "privacy.mechanism": mech}
        cfg = _config(device, {**over, **(DRY_MODEL if dry else {})})
        sim = Simulation(cfg, synthetic_data(m, per, 64 if dry else 1280, 10, 64 if dry else 500))
        sim.run_round()  # warm-up
        out[mech] = {"round_s": _timed(dev, sim.run_round)}
    out["vpdr_over_igpp"] = out["vpdr"]["round_s"] / out["igpp"]["round_s"]
    return out


def vit_section(device: str, dev: torch.device, dry: bool) -> dict[str, Any]:
    name, size, train, test = (
        ("vit_random_micro", 32, 64, 16) if dry else ("vit_random_small", 224, 3000, 200)
    )
    cfg = _config(
        device,
        {
            "backbone.name": name,
            "backbone.image_size": size,
            "federation.batch_size": 32,
            "federation.local_epochs": 1,
        },
    )
    backbone = create_backbone(name, size)
    rng = np.random.default_rng(0)
    per = train // 4
    clients = []
    t_encode = 0.0
    for i in range(4):
        imgs = rng.integers(0, 256, (per + test, size, size, 3), dtype=np.uint8)
        t0 = time.perf_counter()
        z = cached_features(
            Path("."), backbone, "gpu-check", f"d{i}", "all", imgs, use_cache=False, device=dev
        )
        t_encode += time.perf_counter() - t0
        y = torch.from_numpy(rng.integers(0, 7, per + test)).long()
        clients.append(
            ClientData(
                client=i,
                name=f"d{i}",
                domain=i,
                domain_name=f"d{i}",
                train_z=z[:per],
                train_y=y[:per],
                test_z=z[per:],
                test_y=y[per:],
                train_indices=np.arange(per),
            )
        )
    data = FederatedData(
        clients=clients,
        classes=tuple(str(c) for c in range(7)),
        domains=tuple(f"d{i}" for i in range(4)),
        feature_dim=int(clients[0].train_z.shape[-1]),
        dataset="synthetic-pacs",
        real_domains={f"d{i}": False for i in range(4)},
    )
    sim = Simulation(cfg, data)
    wall = _timed(dev, sim.run_round)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    return {
        "backbone": name,
        "image_size": size,
        "clients": 4,
        "train_images": 4 * per,
        "test_images": 4 * test,
        "prefix_shape": list(clients[0].train_z.shape[1:]),
        "encode_s": t_encode,
        "round_s": wall,
        "avg_acc": sim.history[-1].avg_acc,
        "peak_gpu_gib": peak,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="run.device (default auto)")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes: checks the script on CPU")
    ap.add_argument("--out", default="benchmarks/results-gpu.json")
    ap.add_argument("--sections", default="encode,train,vpdr,vit")
    args = ap.parse_args(argv)
    dev = prepare_device(args.device)
    if dev.type != "cuda" and not args.dry_run:
        print(
            f"gpu_check: run.device={args.device} resolved to {dev}; no GPU here "
            "(use --dry-run to check the script on a CPU)",
            file=sys.stderr,
        )
        return 2
    results: dict[str, Any] = {
        "device": describe_device(dev),
        "dry_run": args.dry_run,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    sections = {
        "encode": lambda: encode_section(dev, args.dry_run),
        "train": lambda: train_section(args.device, dev, args.dry_run),
        "vpdr": lambda: vpdr_section(args.device, dev, args.dry_run),
        "vit": lambda: vit_section(args.device, dev, args.dry_run),
    }
    for key in args.sections.split(","):
        t0 = time.perf_counter()
        results[key] = sections[key]()
        results[key]["section_wall_s"] = time.perf_counter() - t0
        print(f"{key}: {json.dumps(results[key])}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
