"""1000 (or 10,000) clients x 20 rounds of FedProto + VPDR on a Dirichlet split of digits4.

Run in its own process so that its peak RSS is its own; prints one JSON line (wall times,
accuracy, peak RSS, per-round times and a cProfile of one round).  ``bench_suite.py`` runs it.

The configuration (``M1000_OVERRIDES``) is the default one except:

* ``data.clients_per_domain=250`` (1000 clients), ``data.partition=dirichlet`` (alpha 0.5);
* ``data.train_fraction=1`` with ``data.max_train_per_domain=5000``: optdigits has 1,437
  training images, the least of the four domains; all of them give each of its 250 clients at
  least one sample (the split's smallest client has 1), the other domains are capped at 5,000
  (16,437 training samples in all, 16 per client on average);
* ``data.max_test_per_domain=500``: every client is evaluated every round on its domain's
  test set; 500 per domain (optdigits: its 360) keeps that at 0.47 M predictions a round;
* ``backbone.train_projection=false``: the 1280 -> 512 projection is frozen and shared (one
  2.6 MB copy instead of one per client); the adapter (1280 -> 64 -> 1280) and head train;
  with the trainable projection the AdamW state alone would be 1000 x 9.9 MB;
* ``backbone.image_size=64`` (the default): at 32 px 98.5% of EfficientNet-Lite0's pooled
  features of digits4 are exactly zero (1.4% non-zero, against 22.6% at 64 px), so an accuracy
  measured there says little;
* ``privacy.warn_min_count=0``: thousands of tiny clients would log a small-class warning for
  most releases;
* ``federation.execution=batched`` (batched training, uploads and evaluation; frozen
  parameters pooled; each distinct ledger accounted once).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_hooks import HookedSimulation

from protofl.config import ExperimentConfig
from protofl.data.cache import protofl_home
from protofl.engine.federated_data import build_federated_data
from protofl.engine.store import _Store

M1000_OVERRIDES = [
    "data.name=digits4",
    "data.clients_per_domain=250",
    "data.partition=dirichlet",
    "data.dirichlet_alpha=0.5",
    "data.train_fraction=1",
    "data.max_train_per_domain=5000",
    "data.max_test_per_domain=500",
    "backbone.image_size=64",
    "backbone.train_projection=false",
    "method.name=fedproto",
    "privacy.mechanism=vpdr",
    "privacy.warn_min_count=0",
    "federation.rounds=20",
    "federation.execution=batched",
    "federation.checkpoint=false",
    "run.progress=false",
]


M10000_OVERRIDES = [
    *(o for o in M1000_OVERRIDES if not o.startswith(("data.clients_per_domain", "data.part"))),
    # 10,000 clients over the four domains in proportion to their data (optdigits has 1,437
    # training images); client-wise Dirichlet label skew, since the per-class split leaves
    # clients empty at a few samples per client
    "data.allocation={mnist: 3900, optdigits: 200, syndigits: 2000, mnistm: 3900}",
    "data.partition=dirichlet_labels",
    "data.max_train_per_domain=20000",  # mnist 20,000, syndigits 10,000, mnistm 20,000
    "federation.participation=0.1",
    # every 5th round on a 100-sample subsample of each test set, the last 5 on all of it
    "federation.eval_every=5",
    "federation.eval_samples=100",
    # parameters and AdamW moments of 10,000 clients are ~20 GB: in mapped files, paged in
    # for the clients a round touches
    "run.client_state=disk",
]
"""The cross-device benchmark: 10,000 clients, 10% participation, state off the heap."""

SCALES = {"m1000": M1000_OVERRIDES, "m10000": M10000_OVERRIDES}


def _status_gb(field: str, path: str = "/proc/self/status") -> float | None:
    """A memory field (kB) of ``/proc/self/status`` (or ``/proc/meminfo``) in GB (Linux),
    else None."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def peak_rss_gb() -> float:
    """Peak resident set size of this process: VmHWM (Linux; unlike ru_maxrss it is not
    inherited from the parent across fork + exec), else ru_maxrss."""
    peak = _status_gb("VmHWM")
    if peak is not None:
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def current_rss_gb() -> float:
    """Resident set size now (VmRSS; Linux), else nan."""
    now = _status_gb("VmRSS")
    return float("nan") if now is None else now


def state_bytes(sim: HookedSimulation) -> int:
    """Bytes the mapped client store occupies on disk (allocated blocks: the files are sparse)."""
    if sim.state_dir is None:
        return 0
    return sum(p.stat().st_blocks * 512 for p in Path(sim.state_dir).iterdir())


def profile_top(stats: pstats.Stats, n: int) -> list[str]:
    """The n entries with the largest own time, as 'tottime cumtime calls function'."""
    rows = []
    for (file, line, func), (_, calls, tot, cum, _) in sorted(
        stats.stats.items(),  # type: ignore[attr-defined]
        key=lambda kv: kv[1][2],
        reverse=True,
    )[:n]:
        where = f"{Path(file).name}:{line}({func})" if line else func
        rows.append(f"{tot:7.3f}s own {cum:7.3f}s cum {calls:7d} calls  {where}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--scale", choices=sorted(SCALES), default="m1000")
    parser.add_argument("--set", action="append", default=[], help="extra key=value overrides")
    parser.add_argument(
        "--no-prefetch",
        action="store_true",
        help="do not advise a mapped store's rows into the page cache before their first "
        "gather (to measure what the advice gains)",
    )
    args = parser.parse_args()
    if args.no_prefetch:
        _Store.PREFETCH = False
    torch.set_num_threads(args.threads)
    overrides = SCALES[args.scale]
    cfg = ExperimentConfig().with_overrides(
        [*overrides, f"federation.rounds={args.rounds}", *args.set]
    )
    t0 = time.perf_counter()
    data = build_federated_data(cfg, protofl_home())
    t_data = time.perf_counter() - t0
    t1 = time.perf_counter()
    sim = HookedSimulation(cfg, data)
    t_build = time.perf_counter() - t1
    rss_built = current_rss_gb()
    rounds = []
    profile: list[str] = []
    for r in range(args.rounds):
        if r == 1:
            prof = cProfile.Profile()
            prof.enable()
            m = sim.run_round()
            prof.disable()
            profile = profile_top(pstats.Stats(prof, stream=io.StringIO()), 15)
        else:
            m = sim.run_round()
        rounds.append(
            {
                "round": m.round,
                "wall_s": m.wall_s,
                "avg_acc": m.avg_acc,
                "evaluation": m.evaluation,
                "participants": len(m.participants),
                "rss_gb": current_rss_gb(),
            }
        )
    wall = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "clients": len(sim.clients),
                "train_samples": sum(c.data.num_train for c in sim.clients),
                "smallest_client": min(c.data.num_train for c in sim.clients),
                "data_s": t_data,
                "build_s": t_build,
                "rounds_s": sum(x["wall_s"] for x in rounds),
                "wall_s": wall,
                "avg_acc": rounds[-1]["avg_acc"],
                "peak_rss_gb": peak_rss_gb(),
                "rss_after_build_gb": rss_built,
                "client_state": cfg.run.client_state,
                "state_on_disk_gb": state_bytes(sim) / 2**30,
                "rounds": rounds,
                "profile_round2": profile,
                "scale": args.scale,
                "prefetch": _Store.PREFETCH,
                "overrides": [*overrides, *args.set],
            }
        )
    )


if __name__ == "__main__":
    main()
