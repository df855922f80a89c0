"""The benchmark suite: one command (``make bench``), a table, and ``benchmarks/results.json``.

Every figure is a ratio of two timings measured in the same run, interleaved (the machines are
shared and noisy; nothing here asserts a time).  Training is timed with one intra-op thread, as
the engine trains.  Sections:

* ``train``: one round of local training (FedProto objective with global prototypes), batched
  (``federation.execution: batched``) versus sequential, at M = 20, 100 (default client model and
  the frozen-projection model) and 1000 (frozen projection; sequential timed on every 10th
  client and scaled by 10), and at M = 1000 one whole round of each engine (sequential and
  ``federation.execution: batched``, whose uploads and evaluation are batched too);
* ``kernel``: one local step of 50 clients three ways: the trainer's batched layers
  (``torch.bmm``, weight gradients into buffers), plain ``torch.bmm`` + autograd on stacked
  leaves, and ``torch.func.vmap`` of ``grad`` of ``functional_call``;
* ``mechanisms``: IGPP, VPP and VPDR (VPP + DCR) at M = 100: release time (vectorised
  ``release_many`` and the per-client loop) and whole-round time with the batched engine
  (overhead over IGPP from the best rounds, the median of paired ratios, and the extra time of
  the phases that differ);
* ``cache``: one round with cached features versus re-encoding every batch (bench_skeleton);
* ``roofline`` / ``roofline_m1000_frozen_proj``: the floor of one round of batched training
  (arithmetic at the measured bmm rate + AdamW traffic) at M = 100 and 1000, and the batched
  trainer's time over it (``batched_over_floor_*``); ``floor_shapes_s_1thread``: the same with
  every product at the rate measured for its own shape (``batched_over_shape_floor_*``);
* ``m1000``: 1000 clients x 20 rounds of FedProto + VPDR on a Dirichlet split of digits4 at
  64 px (``bench_m1000.py``, in its own process for its peak RSS), with a profile of one round;
  ``m1000_disk`` the same with ``run.client_state=disk`` (``offload_round_cost_m1000``: its
  rounds' time over the in-memory run's);
* ``m10000``: 10,000 clients, 10% participation, 20 rounds, client state on disk
  (``bench_m1000.py --scale m10000``): wall time, peak RSS, the store's size on disk, accuracy.
* ``flower``: the Flower engine (ServerApp and ClientApps over the in-process grid) against the
  in-process sequential engine at M = 100, 5 rounds (``bench_flower.py``, each in its own
  process; ``flower_over_sim_round``: its mean round over the in-process one);
  ``flower_m10000`` (not with ``--quick``): the same at 10,000 clients with the clients' state
  on disk, 2 rounds (``bench_flower.py --scale m10000``);
* ``fused``: a fused sweep of 3 seeds x 2 mechanisms against its 6 runs one by one and against
  one run (``bench_fused.py``, in its own process; ``fused_over_one_run``, target within 2x);
  ``fused_vpdr``: the same under VPDR's protocol (``bench_fused.py --preset vpdr``: a frozen
  projection, batches of 256; ``fused_over_one_run_vpdr_preset``).

Usage: python benchmarks/bench_suite.py [--out benchmarks/results.json] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_m1000 import M1000_OVERRIDES, _status_gb  # noqa: E402
from bench_skeleton import round_times  # noqa: E402
from engine_hooks import HookedSimulation  # noqa: E402

from protofl.config import ExperimentConfig  # noqa: E402
from protofl.data.cache import protofl_home  # noqa: E402
from protofl.engine.batched import BatchedTrainer  # noqa: E402
from protofl.engine.federated_data import FederatedData, build_federated_data  # noqa: E402
from protofl.engine.kernels import _BatchedLinear  # noqa: E402
from protofl.engine.store import release_free_memory  # noqa: E402
from protofl.privacy import create_mechanism  # noqa: E402
from protofl.privacy.prototype import release_many  # noqa: E402

BASE = [
    "data.name=digits4",
    "data.partition=dirichlet",
    "data.dirichlet_alpha=0.5",
    "backbone.image_size=32",
    "method.name=fedproto",
    "privacy.warn_min_count=0",
    "federation.checkpoint=false",
    "run.progress=false",
]
FROZEN = ["backbone.train_projection=false"]
_DATA: dict[str, FederatedData] = {}


def machine() -> dict[str, Any]:
    """Where the numbers come from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "train_threads": 1,
        "load_average_start": list(os.getloadavg()),
    }


def config(*overrides: str) -> ExperimentConfig:
    return ExperimentConfig().with_overrides([*BASE, *overrides])


def data_for(cfg: ExperimentConfig) -> FederatedData:
    key = repr(cfg.data) + repr(cfg.backbone)
    if key not in _DATA:
        _DATA[key] = build_federated_data(cfg, protofl_home())
    return _DATA[key]


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
def train_overrides(m: int, model: Sequence[str] = ()) -> list[str]:
    """The config of the training rows at M = ``m`` (``model``: e.g. FROZEN); from M = 1000 on,
    the data of the 1000-client run."""
    extra = [f"data.clients_per_domain={m // 4}", *model]
    if m >= 1000:
        extra += [o for o in M1000_OVERRIDES if o.startswith(("data.train_f", "data.max_"))]
    return extra


def train_round(
    m: int,
    model: list[str],
    *,
    reps: int,
    sample_every: int = 1,
    two_threads: bool = False,
    whole_round: bool = False,
) -> dict[str, Any]:
    """Seconds of one round of local training, sequential versus batched (interleaved)."""
    extra = train_overrides(m, model)
    seq = HookedSimulation(config(*extra), data_for(config(*extra)))
    bat = HookedSimulation(config(*extra, "federation.execution=batched"), data_for(config(*extra)))
    seq.global_state = seq.method.aggregate(seq.collect_uploads(), 0)
    bat.global_state = copy.deepcopy(seq.global_state)
    bat.batched = BatchedTrainer(bat)
    bat.batched.train(bat.clients)  # warm-up: adopts the clients into the stacked storage
    sample = seq.clients[::sample_every]
    scale = len(seq.clients) / len(sample)
    t_seq, t_bat = [], []
    for _ in range(reps):
        t_seq.append(scale * timed(lambda: [seq.train_client(c) for c in sample]))
        t_bat.append(timed(lambda: bat.batched.train(bat.clients)))
    s, b = statistics.median(t_seq), statistics.median(t_bat)
    out = {
        "clients": len(seq.clients),
        "train_samples": sum(c.data.num_train for c in seq.clients),
        "sequential_s": s,
        "batched_s": b,
        "speedup": s / b,
        "sequential_extrapolated_from": len(sample),
    }
    if whole_round:  # a full round: uploads, aggregation, training, evaluation, accounting
        out["round_sequential_s"] = seq.run_round().wall_s
        out["round_batched_s"] = bat.run_round().wall_s
        out["round_speedup"] = out["round_sequential_s"] / out["round_batched_s"]
    if two_threads:  # intra-op threads on a shared machine (the engine trains on one)
        torch.set_num_threads(2)
        try:
            out["batched_2threads_s"] = timed(lambda: bat.batched.train(bat.clients))
            out["sequential_2threads_s"] = scale * timed(
                lambda: [seq.train_client(c) for c in sample]
            )
        finally:
            torch.set_num_threads(1)
    return out


def kernel_step(k: int = 50, rows: int = 64, reps: int = 5) -> dict[str, float]:
    """One forward+backward of k default client models three ways (seconds per step)."""
    from torch.func import functional_call, grad, vmap

    from protofl.config import BackboneConfig
    from protofl.models.client import build_client_model

    g = torch.Generator().manual_seed(0)
    model = build_client_model(1280, 10, BackboneConfig(), g)
    names = [n for n, _ in model.named_parameters()]
    stacked = {
        n: p.detach().unsqueeze(0).repeat(k, *[1] * p.ndim) for n, p in model.named_parameters()
    }
    for t in stacked.values():
        t.add_(0.01 * torch.randn(t.shape, generator=g))
    z = torch.randn(k, rows, 1280, generator=g)
    y = torch.randint(0, 10, (k, rows), generator=g)
    grads = {n: torch.empty_like(t) for n, t in stacked.items()}
    anchor = torch.zeros((), requires_grad=True)

    def lin(n: str, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        b = stacked[n + ".bias"] if bias else None
        gb = grads[n + ".bias"] if bias else None
        return _BatchedLinear.apply(x, stacked[n + ".weight"], b, grads[n + ".weight"], gb, anchor)

    def ours() -> None:
        h = torch.relu(lin("adapter.down", z, bias=False))
        f = lin("proj", z + lin("adapter.up", h, bias=False))
        logits = lin("head", f)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 10), y.reshape(-1))
        loss.backward()

    def plain() -> None:
        p = {n: t.detach().requires_grad_() for n, t in stacked.items()}
        h = torch.relu(torch.bmm(z, p["adapter.down.weight"].transpose(1, 2)))
        a = z + torch.bmm(h, p["adapter.up.weight"].transpose(1, 2))
        f = torch.baddbmm(p["proj.bias"].unsqueeze(1), a, p["proj.weight"].transpose(1, 2))
        logits = torch.baddbmm(p["head.bias"].unsqueeze(1), f, p["head.weight"].transpose(1, 2))
        torch.nn.functional.cross_entropy(logits.reshape(-1, 10), y.reshape(-1)).backward()

    def loss_one(params: dict[str, torch.Tensor], zi: torch.Tensor, yi: torch.Tensor) -> Any:
        _, logits = functional_call(model, params, (zi,))
        return torch.nn.functional.cross_entropy(logits, yi)

    per_client = vmap(grad(loss_one))

    def vmapped() -> None:
        per_client({n: stacked[n] for n in names}, z, y)

    out = {}
    for name, fn in (("batched_layers", ours), ("bmm_autograd", plain), ("vmap_grad", vmapped)):
        fn()
        out[f"{name}_s"] = min(timed(fn) for _ in range(reps))
    out["vmap_over_batched"] = out["vmap_grad_s"] / out["batched_layers_s"]
    return out


def mechanisms(m: int, *, rounds: int) -> dict[str, Any]:
    """IGPP / VPP / VPDR: release time and round time (batched engine with hooks)."""
    base = [f"data.clients_per_domain={m // 4}", "federation.execution=batched"]
    sims = {
        mech: HookedSimulation(config(*base, f"privacy.mechanism={mech}"), data_for(config(*base)))
        for mech in ("igpp", "vpp", "vpdr")
    }
    for sim in sims.values():
        sim.run_round()  # warm-up (adoption, caches)
    walls: dict[str, list[float]] = {k: [] for k in sims}
    uploads: dict[str, list[float]] = {k: [] for k in sims}
    trains: dict[str, list[float]] = {k: [] for k in sims}
    for _ in range(rounds):
        for mech, sim in sims.items():
            walls[mech].append(sim.run_round().wall_s)
            uploads[mech].append(sim.upload_s[-1])
            trains[mech].append(sim.train_s[-1])
    # accounting after the last round: every client's ledger composed on its own (what the
    # engine did before it kept one composition per distinct ledger; the accountant's own
    # cache of compositions is emptied before each) versus privacy_status
    from protofl.privacy.accounting import _compose

    status_s, memo_s = {}, {}
    for mech, sim in sims.items():
        for c in sim.clients:
            c.ledger._cache = None
        elapsed = 0.0
        for c in sim.clients:
            _compose.cache_clear()
            t0 = time.perf_counter()
            c.ledger.epsilon_spent()
            elapsed += time.perf_counter() - t0
        status_s[mech] = elapsed
        for c in sim.clients:
            c.ledger._cache = None
        _compose.cache_clear()
        t0 = time.perf_counter()
        sim.privacy_status()
        memo_s[mech] = time.perf_counter() - t0
    # the mechanisms alone, on the same features (the igpp simulation's current ones)
    ref = sims["igpp"]
    assert ref.batched is not None
    feats = ref.batched.features_many(ref.clients)
    labels = [c.data.train_y for c in ref.clients]
    names = [c.data.name for c in ref.clients]
    release: dict[str, dict[str, float]] = {}
    for mech in ("igpp", "vpp"):
        cfg = config(*base, f"privacy.mechanism={mech}").privacy
        many, loop = [], []
        for _ in range(3):
            mk = create_mechanism(cfg, rounds=10, dim=feats[0].shape[1])
            gens = [torch.Generator().manual_seed(i) for i in range(len(feats))]
            t0 = time.perf_counter()
            release_many(mk, feats, labels, num_classes=10, generators=gens, clients=names)
            t1 = time.perf_counter()
            for f, y, g, n in zip(feats, labels, gens, names):
                mk.release(f, y, num_classes=10, generator=g, client=n)
            many.append(t1 - t0)
            loop.append(time.perf_counter() - t1)
        release[mech] = {"many": min(many), "loop": min(loop)}
    # three estimates of the overhead of a round over IGPP's: the median of the interleaved
    # per-round ratios (the headline), the best rounds (min of each), and the extra time of the
    # two phases that differ (uploads: VPP's scores and selection; training: DCR) over IGPP's
    # round, medians of per-round differences (evaluation, ~85% of these rounds, is the same
    # work for all three and only adds noise)
    best = {mech: min(walls[mech]) / min(walls["igpp"]) - 1 for mech in ("vpp", "vpdr")}
    median = {
        mech: statistics.median(w / i for w, i in zip(walls[mech], walls["igpp"])) - 1
        for mech in ("vpp", "vpdr")
    }
    phases = {
        mech: (
            statistics.median(a - b for a, b in zip(uploads[mech], uploads["igpp"]))
            + statistics.median(a - b for a, b in zip(trains[mech], trains["igpp"]))
        )
        / statistics.median(walls["igpp"])
        for mech in ("vpp", "vpdr")
    }
    return {
        "clients": m,
        "rounds": rounds,
        "round_s": {k: min(v) for k, v in walls.items()},
        "round_median_s": {k: statistics.median(v) for k, v in walls.items()},
        "upload_s": {k: statistics.median(v) for k, v in uploads.items()},
        "train_s": {k: statistics.median(v) for k, v in trains.items()},
        "release_many_s": {k: v["many"] for k, v in release.items()},
        "release_loop_s": {k: v["loop"] for k, v in release.items()},
        "privacy_status_unmemoised_s": status_s,
        "privacy_status_s": memo_s,
        "vpp_round_overhead": median["vpp"],
        "vpdr_round_overhead": median["vpdr"],
        "vpdr_round_overhead_best_rounds": best["vpdr"],
        "vpdr_round_overhead_phases": phases["vpdr"],
        "vpp_round_overhead_phases": phases["vpp"],
        "vpp_release_overhead": release["vpp"]["many"] / release["igpp"]["many"] - 1,
    }


def cache(per_domain: int) -> dict[str, float]:
    """bench_skeleton's round with cached features versus recomputing them."""
    cfg = ExperimentConfig().with_overrides(
        [
            "data.name=digits4",
            f"data.max_train_per_domain={per_domain}",
            "data.train_fraction=1",
            "federation.local_epochs=1",
            "run.progress=false",
        ]
    )
    # one thread for both, as the engine trains (two threads on a loaded 2-core machine made
    # the cached round 40x slower in one run: the ratio then measures oversubscription)
    cached, uncached = round_times(cfg)
    return {"round_cached_s": cached, "round_uncached_s": uncached, "speedup": uncached / cached}


def train_macs_per_row(cfg: ExperimentConfig, data: FederatedData) -> int:
    """Multiply-adds of one training row of the client model (residual adapter ``d_in -> hidden
    -> d_in``, projection ``d_in -> d``, linear head ``d -> k``): the forward, the input
    gradient of every layer but the first (the cached features need none), and the weight
    gradient of every trainable layer (none of a frozen projection).  Exactly what the batched
    trainer multiplies when no step is padded (tests/test_benchmarks.py counts it)."""
    if cfg.backbone.head != "linear":
        raise ValueError(
            f"train_macs_per_row counts a linear head, not backbone.head={cfg.backbone.head!r}"
        )
    d_in, d, hidden = data.feature_dim, cfg.backbone.proto_dim, cfg.backbone.adapter_hidden
    down, up, proj, head = d_in * hidden, hidden * d_in, d_in * d, d * data.num_classes
    forward = down + up + proj + head
    input_grads = up + proj + head
    weight_grads = down + up + (proj if cfg.backbone.train_projection else 0) + head
    return forward + input_grads + weight_grads


def roofline(m: int = 100, model: Sequence[str] = ()) -> dict[str, Any]:
    """What bounds one round of batched training at M = ``m`` (the default model, or ``model``
    =FROZEN: a frozen projection): its arithmetic (:func:`train_macs_per_row`: forward and
    backward, no input gradient into the first layer, no weight gradient of a frozen
    projection; until 2026-12-03 the count also charged the first layer's input gradient,
    3-4% more than the trainer computes) at the rate ``torch.bmm``
    reaches on projection-shaped products, plus its AdamW memory traffic (trainable parameters)
    at the rate the fused kernel reaches; with one and two intra-op threads.  The data is
    ``train_round``'s for the same ``m`` and ``model``."""
    extra = train_overrides(m, model)
    cfg = config(*extra)
    data = data_for(cfg)
    n = sum(c.num_train for c in data.clients)
    d_in, d, hidden = data.feature_dim, cfg.backbone.proto_dim, cfg.backbone.adapter_hidden
    k = data.num_classes
    trained_proj = cfg.backbone.train_projection
    gflop = 2 * train_macs_per_row(cfg, data) * n / 1e9
    params = (d_in * d + d if trained_proj else 0) + 2 * d_in * hidden + d * k + k
    bs = cfg.federation.batch_size
    steps = sum(-(-c.num_train // bs) for c in data.clients) / len(data.clients)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, bs, d_in, generator=g)
    w = torch.randn(m, d, d_in, generator=g)
    flat = m * params
    p, gr, mo, v = (torch.rand(flat, generator=g) for _ in range(4))
    step_t = torch.tensor(1.0)

    def adamw() -> None:
        torch._fused_adamw_(
            [p], [gr], [mo], [v], [], [step_t], lr=1e-3, beta1=0.9, beta2=0.999,
            weight_decay=1e-5, eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip

    out: dict[str, Any] = {
        "clients": m,
        "train_samples": n,
        "gflop_per_round": gflop,
        "adamw_params": flat,
        "adamw_steps_per_client": steps,
    }
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            torch.bmm(a, w.transpose(1, 2))
            t = min(timed(lambda: torch.bmm(a, w.transpose(1, 2))) for _ in range(5))
            rate = 2 * m * bs * d_in * d / t / 1e9
            adamw()
            t_adam = min(timed(adamw) for _ in range(3))
            out[f"bmm_gflops_{threads}thread"] = rate
            out[f"adamw_step_s_{threads}thread"] = t_adam
            out[f"floor_s_{threads}thread"] = gflop / rate + steps * t_adam
    finally:
        torch.set_num_threads(1)
    out.update(shape_floor(cfg, data, m, float(out["adamw_step_s_1thread"])))
    return out


def shape_floor(
    cfg: ExperimentConfig, data: FederatedData, m: int, t_adam: float
) -> dict[str, Any]:
    """The floor with every product at the rate ``torch.bmm`` reaches for ITS shape (one
    thread): the trainer's calls, layer by layer (forward ``x W^T``, weight gradient
    ``g^T x`` into the parameters' layout, input gradient ``g W``; none into the first layer),
    over ``m`` clients and the mean width of a step, each timed alone on random data, weighted
    by the round's multiply-adds; a frozen shared projection is one ``F.linear`` over all rows
    (forward and input gradient).  Plus the same AdamW traffic as :func:`roofline`.  Unlike
    ``floor_s_1thread`` (every product at the projection's rate), this floor is what the
    processor does with the products this model needs."""
    n = sum(c.num_train for c in data.clients)
    bs = cfg.federation.batch_size
    steps = sum(-(-c.num_train // bs) for c in data.clients)
    width = max(1, round(n / steps))  # rows of a mean step of one client
    d_in, d, hidden = data.feature_dim, cfg.backbone.proto_dim, cfg.backbone.adapter_hidden
    layers = [("down", d_in, hidden, False), ("up", hidden, d_in, True)]
    if cfg.backbone.train_projection:
        layers.append(("proj", d_in, d, True))
    layers.append(("head", d, data.num_classes, True))
    g = torch.Generator().manual_seed(0)
    k = min(m, 100)

    def best(fn: Callable[[], Any]) -> float:
        return min(timed(fn) for _ in range(5))

    seconds = 0.0
    detail: dict[str, float] = {}
    for name, i, o, input_grad in layers:
        x = torch.randn(k, width, i, generator=g)
        w = torch.randn(k, o, i, generator=g)
        gr = torch.randn(k, width, o, generator=g)
        gw = torch.empty(k, o, i)
        kinds = {
            "fwd": lambda x=x, w=w: torch.bmm(x, w.transpose(1, 2)),
            "dW": lambda x=x, gr=gr, gw=gw: torch.bmm(gr.transpose(1, 2), x, out=gw),
        }
        if input_grad:
            kinds["dx"] = lambda gr=gr, w=w: torch.bmm(gr, w)
        for kind, fn in kinds.items():
            fn()
            rate = 2 * k * width * i * o / best(fn)  # FLOP/s at this shape
            t = 2 * n * i * o / rate
            detail[f"{name}_{kind}_gflops"] = rate / 1e9
            seconds += t
    if not cfg.backbone.train_projection:  # one shared product over every row
        rows = min(n, 8192)
        x = torch.randn(rows, d_in, generator=g)
        w = torch.randn(d, d_in, generator=g)
        gr = torch.randn(rows, d, generator=g)
        for kind, fn in {
            "fwd": lambda: torch.nn.functional.linear(x, w),
            "dx": lambda: gr @ w,
        }.items():
            fn()
            rate = 2 * rows * d_in * d / best(fn)
            detail[f"shared_proj_{kind}_gflops"] = rate / 1e9
            seconds += 2 * n * d_in * d / rate
    mean_steps = steps / len(data.clients)
    return {
        "step_width": width,
        "shape_rates": detail,
        "floor_shapes_s_1thread": seconds + mean_steps * t_adam,
    }


def m1000(rounds: int, scale: str = "m1000", *overrides: str) -> dict[str, Any]:
    """The 1000- (or 10,000-) client run, in its own process (its own peak RSS); with the
    suite process's own resident memory and the machine's available memory at its start
    (what is left for the page cache of a run whose client state is on disk)."""
    sets = [a for o in overrides for a in ("--set", o)]
    # what the suite freed (its data, earlier benchmarks' simulations) goes back to the system
    # before the run starts: resident heap the suite no longer uses would only take page cache
    # from a run whose client state is on disk
    gc.collect()
    release_free_memory()
    suite_rss, available = _status_gb("VmRSS"), _status_gb("MemAvailable", "/proc/meminfo")
    out = subprocess.run(
        [
            sys.executable,
            str(HERE / "bench_m1000.py"),
            "--rounds",
            str(rounds),
            "--scale",
            scale,
            *sets,
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["suite_rss_gb_at_start"] = suite_rss
    result["mem_available_gb_at_start"] = available
    return result


def flower(clients: int, rounds: int, *scale: str) -> dict[str, Any]:
    """bench_flower.py: the Flower engine against the in-process one (their own processes);
    ``scale``: e.g. ``"--scale", "m10000"`` (then ``clients`` is ignored)."""
    cmd = [sys.executable, str(HERE / "bench_flower.py"), "--clients", str(clients), *scale]
    out = subprocess.run(
        [*cmd, "--rounds", str(rounds)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def fused(rounds: int, repeat: int, *preset: str) -> dict[str, Any]:
    """bench_fused.py's fused sweep against separate runs, in its own process (its own workers);
    ``preset``: e.g. ``"--preset", "vpdr"``."""
    cmd = [sys.executable, str(HERE / "bench_fused.py"), "--rounds", str(rounds), *preset]
    cmd += ["--repeat", str(repeat), "--jobs", str(min(2, os.cpu_count() or 1))]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "results.json"))
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    reps = 1 if args.quick else 3
    t0 = time.perf_counter()
    results: dict[str, Any] = {"machine": machine()}
    results["command"] = "make bench  # python benchmarks/bench_suite.py" + (
        " --quick" if args.quick else ""
    )

    def step(name: str, fn: Callable[[], Any]) -> Any:
        print(f"... {name}", file=sys.stderr, flush=True)
        return fn()

    train: dict[str, Any] = {}
    train["m20_default"] = step("train M=20", lambda: train_round(20, [], reps=reps))
    train["m100_default"] = step(
        "train M=100", lambda: train_round(100, [], reps=reps, two_threads=True)
    )
    train["m100_frozen_proj"] = step(
        "train M=100 frozen", lambda: train_round(100, FROZEN, reps=reps)
    )
    train["m1000_frozen_proj"] = step(
        "train M=1000 frozen",
        lambda: train_round(1000, FROZEN, reps=max(1, reps - 1), sample_every=10, whole_round=True),
    )
    _DATA.clear()
    results["train"] = train
    results["kernel"] = step("kernel", kernel_step)
    results["roofline"] = step("roofline", roofline)
    results["roofline_m1000_frozen_proj"] = step(
        "roofline M=1000 frozen", lambda: roofline(1000, FROZEN)
    )
    results["mechanisms"] = step(
        "mechanisms", lambda: mechanisms(100, rounds=3 if args.quick else 6)
    )
    _DATA.clear()
    results["cache"] = step("cache", lambda: cache(100 if args.quick else 200))
    rounds = 5 if args.quick else 20
    results["m1000"] = step("m1000", lambda: m1000(rounds))
    # the same run with the clients' state in mapped files (run.client_state=disk)
    results["m1000_disk"] = step(
        "m1000 disk", lambda: m1000(rounds, "m1000", "run.client_state=disk")
    )
    results["m10000"] = step("m10000", lambda: m1000(rounds, "m10000"))
    results["flower"] = step("flower", lambda: flower(100, 3 if args.quick else 5))
    if not args.quick:  # ~8 minutes: 10,000 clients on Flower, state on disk, 2 rounds
        results["flower_m10000"] = step("flower m10000", lambda: flower(0, 2, "--scale", "m10000"))
    results["fused"] = step(
        "fused sweep", lambda: fused(3 if args.quick else 5, 1 if args.quick else 2)
    )
    results["fused_vpdr"] = step(
        "fused sweep, VPDR preset",
        lambda: fused(3 if args.quick else 5, 1, "--preset", "vpdr"),
    )
    results["machine"]["load_average_end"] = list(os.getloadavg())
    results["suite_wall_s"] = time.perf_counter() - t0
    results.update(
        {
            "batched_speedup_m100": train["m100_default"]["speedup"],
            "batched_floor_speedup_m100": train["m100_default"]["sequential_s"]
            / results["roofline"]["floor_s_1thread"],
            # batched training time over its floor (target: within 1.25x)
            "batched_over_floor_m100": train["m100_default"]["batched_s"]
            / results["roofline"]["floor_s_1thread"],
            "batched_over_floor_m1000_frozen_proj": train["m1000_frozen_proj"]["batched_s"]
            / results["roofline_m1000_frozen_proj"]["floor_s_1thread"],
            # ... over the floor whose every product runs at its own shape's rate
            "batched_over_shape_floor_m100": train["m100_default"]["batched_s"]
            / results["roofline"]["floor_shapes_s_1thread"],
            "batched_over_shape_floor_m1000_frozen_proj": train["m1000_frozen_proj"]["batched_s"]
            / results["roofline_m1000_frozen_proj"]["floor_shapes_s_1thread"],
            "batched_speedup_m100_frozen_proj": train["m100_frozen_proj"]["speedup"],
            "batched_speedup_m1000": train["m1000_frozen_proj"]["speedup"],
            "round_speedup_m1000": train["m1000_frozen_proj"].get("round_speedup"),
            "vpdr_round_overhead": results["mechanisms"]["vpdr_round_overhead"],
            "cache_speedup": results["cache"]["speedup"],
            "m1000_wall_s": results["m1000"]["wall_s"],
            "m1000_peak_rss_gb": results["m1000"]["peak_rss_gb"],
            "m1000_avg_acc": results["m1000"]["avg_acc"],
            # state offloading's cost per round at M = 1000 (disk over memory, rounds only)
            "offload_round_cost_m1000": results["m1000_disk"]["rounds_s"]
            / results["m1000"]["rounds_s"],
            "m1000_disk_peak_rss_gb": results["m1000_disk"]["peak_rss_gb"],
            "m10000_wall_s": results["m10000"]["wall_s"],
            "m10000_peak_rss_gb": results["m10000"]["peak_rss_gb"],
            "m10000_avg_acc": results["m10000"]["avg_acc"],
            # the Flower engine's mean round over the in-process engine's, M = 100
            "flower_over_sim_round": results["flower"]["flower_over_sim_round"],
            "flower_peak_rss_gb": results["flower"]["flower"]["peak_rss_gb"],
            # ... at 10,000 clients with run.client_state=disk (not with --quick)
            **(
                {
                    "flower_m10000_over_sim_round": results["flower_m10000"][
                        "flower_over_sim_round"
                    ],
                    "flower_m10000_peak_rss_gb": results["flower_m10000"]["flower"]["peak_rss_gb"],
                }
                if "flower_m10000" in results
                else {}
            ),
            # a fused 3 seeds x 2 mechanisms sweep over one run's wall time (target: 2x)
            "fused_over_one_run": results["fused"]["fused_over_one_run"],
            # the same as whole commands: protofl sweep (fused) over protofl run
            "fused_over_one_run_cli": results["fused"]["cli_fused_over_one_run"],
            "separate_over_one_run": results["fused"]["separate_over_one_run"],
            "fused_over_one_run_vpdr_preset": results["fused_vpdr"]["fused_over_one_run"],
            "separate_over_fused_vpdr_preset": results["fused_vpdr"]["separate_over_fused"],
        }
    )
    print_table(results)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwritten {args.out}")


def print_table(r: dict[str, Any]) -> None:
    """The human-readable summary."""
    mach = r["machine"]
    load = f"{mach['load_average_start'][0]:.1f} -> {mach['load_average_end'][0]:.1f}"
    print(f"\nmachine: {mach['cpu']}, {mach['cores']} cores, torch {mach['torch']}, load {load}")
    print(
        f"\n{'local training, one round (1 thread)':36s} {'seq s':>7s} {'batched s':>9s} {'x':>6s}"
    )
    for name, t in r["train"].items():
        n, k = t["clients"], t["sequential_extrapolated_from"]
        note = f"  (seq: {k} clients x{n // k})" if k < n else ""
        print(
            f"{name:36s} {t['sequential_s']:7.2f} {t['batched_s']:9.2f} {t['speedup']:6.2f}{note}"
        )
    t = r["train"]["m1000_frozen_proj"]
    if "round_speedup" in t:
        print(
            f"whole round at M=1000 (uploads, training, evaluation): sequential engine "
            f"{t['round_sequential_s']:.1f} s, batched engine {t['round_batched_s']:.1f} s "
            f"(x{t['round_speedup']:.1f})"
        )
    k = r["kernel"]
    print(
        f"\none step of 50 clients: batched layers {k['batched_layers_s'] * 1e3:.0f} ms, "
        f"bmm+autograd {k['bmm_autograd_s'] * 1e3:.0f} ms, "
        f"vmap(grad) {k['vmap_grad_s'] * 1e3:.0f} ms"
    )
    rl = r["roofline"]
    print(
        f"\nroofline at M={rl['clients']}: {rl['gflop_per_round']:.1f} GFLOP per round at "
        f"{rl['bmm_gflops_1thread']:.0f} GFLOP/s (bmm, 1 thread; "
        f"{rl['bmm_gflops_2thread']:.0f} on 2) + {rl['adamw_steps_per_client']:.1f} AdamW steps "
        f"of {rl['adamw_params'] / 1e6:.1f} M parameters at {rl['adamw_step_s_1thread']:.3f} s: "
        f"floor {rl['floor_s_1thread']:.2f} s (1 thread), {rl['floor_s_2thread']:.2f} s (2); "
        f"sequential / floor = {r['batched_floor_speedup_m100']:.2f}x"
    )
    mech = r["mechanisms"]
    print(
        f"\n{'M=100, batched engine':22s} {'round s':>8s} {'uploads s':>10s} "
        f"{'release many/loop s':>20s}"
    )
    for name in ("igpp", "vpp", "vpdr"):
        key = "vpp" if name == "vpdr" else name
        rel, loop = mech["release_many_s"][key], mech["release_loop_s"][key]
        print(
            f"{name:22s} {mech['round_s'][name]:8.2f} {mech['upload_s'][name]:10.2f} "
            f"{rel:11.3f} / {loop:.3f}"
        )
    print(
        f"round overhead vs IGPP (median paired ratio): VPP {mech['vpp_round_overhead']:+.1%}, "
        f"VPDR {mech['vpdr_round_overhead']:+.1%}; VPDR from best rounds "
        f"{mech['vpdr_round_overhead_best_rounds']:+.1%}, from its extra upload+training time "
        f"{mech['vpdr_round_overhead_phases']:+.1%}"
    )
    st, sm = mech["privacy_status_unmemoised_s"], mech["privacy_status_s"]
    print(
        f"accounting per round, every ledger on its own: IGPP {st['igpp']:.2f} s, VPDR "
        f"{st['vpdr']:.2f} s; the engine (once per distinct ledger): IGPP {sm['igpp']:.2f} s, "
        f"VPDR {sm['vpdr']:.2f} s"
    )
    c = r["cache"]
    print(
        f"\ncached vs uncached round: {c['round_cached_s']:.2f} s vs "
        f"{c['round_uncached_s']:.2f} s (x{c['speedup']:.1f})"
    )
    m = r["m1000"]
    print(
        f"\n1000 clients x {len(m['rounds'])} rounds FedProto+VPDR: {m['wall_s']:.0f} s "
        f"(data {m['data_s']:.0f} s, build {m['build_s']:.0f} s, rounds {m['rounds_s']:.0f} s), "
        f"peak RSS {m['peak_rss_gb']:.2f} GB, avg acc {m['avg_acc']:.3f}"
    )
    print("profile of one round (own time):")
    for line in m["profile_round2"][:8]:
        print("  " + line)
    d = r["m1000_disk"]
    print(
        f"the same with run.client_state=disk: rounds {d['rounds_s']:.0f} s "
        f"(x{r['offload_round_cost_m1000']:.2f}), peak RSS {d['peak_rss_gb']:.2f} GB, "
        f"avg acc {d['avg_acc']:.3f}"
    )
    x = r["m10000"]
    print(
        f"\n{x['clients']} clients x {len(x['rounds'])} rounds, 10% participation, state on disk: "
        f"{x['wall_s']:.0f} s (data {x['data_s']:.0f} s, build {x['build_s']:.0f} s, rounds "
        f"{x['rounds_s']:.0f} s), peak RSS {x['peak_rss_gb']:.2f} GB, store "
        f"{x['state_on_disk_gb']:.1f} GB on disk, avg acc {x['avg_acc']:.3f}"
    )
    fl = r["flower"]
    print(
        f"\nFlower engine (inline grid) at M={fl['clients']}, {fl['rounds']} rounds: round "
        f"{fl['flower_round_s']:.2f} s against {fl['sim_round_s']:.2f} s in process "
        f"(x{fl['flower_over_sim_round']:.2f}), peak RSS {fl['flower']['peak_rss_gb']:.2f} GB "
        f"against {fl['sim']['peak_rss_gb']:.2f} GB, final avg acc {fl['final_acc']:.3f}"
    )
    if "flower_m10000" in r:
        fx = r["flower_m10000"]
        print(
            f"Flower engine at {fx['clients']} clients, {fx['rounds']} rounds, state on disk: "
            f"round {fx['flower_round_s']:.0f} s against {fx['sim_round_s']:.0f} s in process "
            f"(x{fx['flower_over_sim_round']:.2f}), peak RSS "
            f"{fx['flower']['peak_rss_gb']:.2f} GB against {fx['sim']['peak_rss_gb']:.2f} GB"
        )
    f = r["fused"]
    print(
        f"\nsweep of 3 seeds x 2 mechanisms, {f['jobs']} jobs: one run {f['one_run_s']} s, "
        f"6 runs separately {f['separate_s']:.1f} s (x{f['separate_over_one_run']:.2f} one run), "
        f"fused {f['fused_s']:.1f} s (x{f['fused_over_one_run']:.2f}); as whole commands: "
        f"protofl run {f['cli_one_run_s']} s, protofl sweep {f['cli_fused_s']:.1f} s "
        f"(x{f['cli_fused_over_one_run']:.2f})"
    )
    print(
        f"batched training over its floor: M=100 {r['batched_over_floor_m100']:.2f}x, "
        f"M=1000 (frozen projection) {r['batched_over_floor_m1000_frozen_proj']:.2f}x; over the "
        f"floor at each product's own rate: {r['batched_over_shape_floor_m100']:.2f}x, "
        f"{r['batched_over_shape_floor_m1000_frozen_proj']:.2f}x"
    )


if __name__ == "__main__":
    main()
