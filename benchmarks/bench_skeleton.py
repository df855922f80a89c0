"""Skeleton benchmark: backbone throughput, and one round with cached vs recomputed features.

Prints ratios measured in one run (the machines are shared and noisy; never assert times).
Usage: python benchmarks/bench_skeleton.py [--dataset digits4] [--per-domain 500]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from protofl.config import ExperimentConfig
from protofl.data.cache import protofl_home
from protofl.engine.federated_data import build_federated_data, load_dataset
from protofl.engine.simulation import Simulation
from protofl.models.backbones import create_backbone


def backbone_throughput(size: int, n: int = 512) -> float:
    """Images per second of the frozen EfficientNet-Lite0 at ``size`` px."""
    backbone = create_backbone("efficientnet_lite0", size)
    images = np.random.default_rng(0).integers(0, 255, (n, 28, 28, 3), dtype=np.uint8)
    backbone.encode(images[:64])
    t0 = time.perf_counter()
    backbone.encode(images)
    return n / (time.perf_counter() - t0)


def round_times(config: ExperimentConfig) -> tuple[float, float]:
    """Seconds of one round's local training with cached features, and recomputing them."""
    home = protofl_home()
    dataset = load_dataset(config, home)
    data = build_federated_data(config, home, dataset=dataset)
    backbone = create_backbone(config.backbone.name, config.backbone.image_size)
    sim = Simulation(config, data)
    sim.global_state = sim.method.aggregate(sim.collect_uploads(), 0)
    t0 = time.perf_counter()
    for c in sim.clients:
        sim.train_client(c)
    cached = time.perf_counter() - t0

    # the same round, but every batch goes through the frozen backbone again
    images = {
        c.data.client: dataset.domain(c.data.domain_name).train.images[c.data.train_indices]
        for c in sim.clients
    }
    t0 = time.perf_counter()
    for c in sim.clients:
        imgs = images[c.data.client]
        bs = config.federation.batch_size
        for _ in range(config.federation.local_epochs):
            perm = torch.randperm(len(imgs), generator=c.train_gen)
            for start in range(0, len(imgs), bs):
                idx = perm[start : start + bs].numpy()
                with torch.no_grad():
                    z = backbone.encode_batch(backbone.preprocess(imgs[idx]))
                _, logits = c.model(z)
                loss = torch.nn.functional.cross_entropy(logits, c.data.train_y[idx])
                c.optimizer.zero_grad()
                loss.backward()
                c.optimizer.step()
    uncached = time.perf_counter() - t0
    return cached, uncached


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", default="digits4")
    parser.add_argument("--per-domain", type=int, default=500)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    results: dict[str, float] = {}
    for size in (32, 64):
        results[f"backbone_img_per_s_{size}px"] = backbone_throughput(size)
    config = ExperimentConfig().with_overrides(
        [
            f"data.name={args.dataset}",
            f"data.max_train_per_domain={args.per_domain}",
            "data.train_fraction=1",
            "federation.local_epochs=1",
            "run.progress=false",
        ]
    )
    torch.set_num_threads(1)  # as the engine trains (run.threads unset): see docs/performance.md
    cached, uncached = round_times(config)
    results.update(
        {"round_cached_s": cached, "round_uncached_s": uncached, "cache_speedup": uncached / cached}
    )
    for k, v in results.items():
        print(f"{k:28s} {v:10.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
