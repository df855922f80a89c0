"""Noise keys against torch generators: one vectorised IGPP release of many clients.

Prints the time of ``release_many`` with protofl's 256-bit ``NoiseKey`` (SHAKE-256 keystream,
ratcheted per draw) and with torch CPU generators (the old 32-bit-seeded Mersenne Twister), in
the same process, interleaved, and their ratio.  Usage: ``python benchmarks/bench_noise.py
[--clients 1000] [--classes 10] [--dim 512] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import time

import torch

from protofl.privacy.base import create_mechanism
from protofl.privacy.config import PrivacyConfig
from protofl.privacy.noise import NoiseKey


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--per-class", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    m, c, d = args.clients, args.classes, args.dim
    cfg = PrivacyConfig(mechanism="igpp", epsilon=1.0, clip=5.0, warn_min_count=0)
    g = torch.Generator().manual_seed(0)
    n = c * args.per_class
    feats = [torch.randn(n, d, generator=g) for _ in range(m)]
    labels = [torch.arange(n) % c for _ in range(m)]
    names = [str(i) for i in range(m)]
    best = {"torch": float("inf"), "noisekey": float("inf")}
    for _ in range(args.repeats):
        for kind in best:
            mech = create_mechanism(cfg, rounds=10, dim=d)
            gens: list = (
                [torch.Generator().manual_seed(i) for i in range(m)]
                if kind == "torch"
                else [NoiseKey.derived(0, i) for i in range(m)]
            )
            start = time.perf_counter()
            mech.release_many(feats, labels, num_classes=c, generators=gens, clients=names)
            best[kind] = min(best[kind], time.perf_counter() - start)
    print(f"{m} clients x {c} classes x {d} dims, best of {args.repeats}:")
    print(f"  torch generators: {best['torch']:.3f} s")
    print(f"  NoiseKey (SHAKE-256): {best['noisekey']:.3f} s")
    print(f"  ratio NoiseKey / torch: {best['noisekey'] / best['torch']:.2f}x")


if __name__ == "__main__":
    main()
