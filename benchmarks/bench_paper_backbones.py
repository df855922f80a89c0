"""Seconds per training step of the papers' backbones on this machine, and what one PACS-scale
round would take at that speed.

* VPDR: ViT-S/16 (``vit_random_small``: random weights, ViT-S's shape) at 224 px, an adapter
  after every block (the cached prefix is the patch embedding only), batch 32: forward through
  all 12 blocks, backward through all of them to every adapter, one AdamW step (the vpdr
  preset's optimiser);
* FedDAP: ResNet-10 (``resnet10``) at 32 px trained from scratch, batch 64, with its crop/flip
  augmentation, one SGD step (the feddap preset's optimiser).

The loss is plain cross-entropy (a method's prototype terms cost next to nothing beside the
network). Each step is timed after one warm-up step; the medians are reported, with the load
average before and after (the machine may be shared). The round estimate scales the measured
per-image costs to ``--train-images`` training images (the paper's PACS scale: 4 clients, about
3,000 images) times the preset's local epochs, plus one forward pass over the training images
(the prototype upload) and over ``--test-images`` (evaluation).

Usage: python benchmarks/bench_paper_backbones.py [--vit-steps 3] [--resnet-steps 10]
(one JSON line).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from protofl.config import ExperimentConfig
from protofl.engine.optimizers import make_optimizer
from protofl.models.backbones import backbone_class

NUM_CLASSES = 7  # PACS


def _preset_config(preset: str, backbone: str, image_size: int) -> ExperimentConfig:
    return ExperimentConfig.from_dict(
        {
            "preset": preset,
            "data": {"name": "pacs"},
            "backbone": {"name": backbone, "image_size": image_size},
        }
    )


def _timed(fn: Any, repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure(preset: str, backbone: str, image_size: int, batch: int, steps: int) -> dict[str, Any]:
    """Train-step and forward-only seconds per batch of one paper's backbone."""
    config = _preset_config(preset, backbone, image_size)
    cls = backbone_class(config.backbone)
    frozen = cls(image_size)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (batch, image_size, image_size, 3), dtype=np.uint8)
    labels = torch.from_numpy(rng.integers(0, NUM_CLASSES, batch)).long()
    t0 = time.perf_counter()
    z = frozen.encode(images).clone()  # the cached prefix (done once per data set)
    encode_s = time.perf_counter() - t0
    model = cls.client_model(
        frozen.feature_dim, NUM_CLASSES, config.backbone, torch.Generator().manual_seed(0)
    )
    trainable = model.trainable_parameters()  # type: ignore[operator]
    opt = make_optimizer(trainable, config.federation)

    def step() -> None:
        model.train()
        _, logits = model(z)
        loss = F.cross_entropy(logits, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def forward() -> None:
        model.eval()
        with torch.no_grad():
            model(z)

    step_s = _timed(step, steps)
    forward_s = _timed(forward, max(1, steps // 2))
    return {
        "backbone": backbone,
        "preset": preset,
        "image_size": image_size,
        "batch": batch,
        "cached_prefix_shape": list(z.shape[1:]),
        "trainable_params": sum(p.numel() for p in trainable),
        "optimizer": config.federation.optimizer,
        "local_epochs": config.federation.local_epochs,
        "encode_s_per_batch": round(encode_s, 3),
        "train_step_s": round(statistics.median(step_s), 3),
        "train_step_s_all": [round(t, 3) for t in step_s],
        "forward_s_per_batch": round(statistics.median(forward_s), 3),
    }


def round_estimate(m: dict[str, Any], train_images: int, test_images: int) -> dict[str, Any]:
    """One round at ``train_images`` / ``test_images`` from the measured per-image costs."""
    per_train = m["train_step_s"] / m["batch"]
    per_forward = m["forward_s_per_batch"] / m["batch"]
    train = train_images * m["local_epochs"] * per_train
    other = (train_images + test_images) * per_forward  # prototype upload + evaluation
    return {
        "train_images": train_images,
        "test_images": test_images,
        "local_epochs": m["local_epochs"],
        "train_s": round(train, 1),
        "upload_and_eval_s": round(other, 1),
        "round_s": round(train + other, 1),
        "round_h": round((train + other) / 3600, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vit-steps", type=int, default=3, help="timed ViT-S steps (after 1 warm-up)")
    ap.add_argument("--resnet-steps", type=int, default=10, help="timed ResNet-10 steps")
    ap.add_argument("--train-images", type=int, default=3000, help="PACS scale (4 clients)")
    ap.add_argument("--test-images", type=int, default=2000, help="VPDR: 20%% of PACS's 9,991")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    vit = measure("vpdr", "vit_random_small", 224, 32, args.vit_steps)
    resnet = measure("feddap", "resnet10", 32, 64, args.resnet_steps)
    load_after = os.getloadavg()
    out = {
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "processor": platform.processor() or platform.machine(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in load_after],
        },
        "vpdr_vit_small_224": {
            **vit,
            "pacs_round": round_estimate(vit, args.train_images, args.test_images),
        },
        "feddap_resnet10_32": {
            **resnet,
            "pacs_round": round_estimate(resnet, args.train_images, args.test_images),
        },
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
