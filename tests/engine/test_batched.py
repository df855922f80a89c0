"""Batched multi-client training agrees with the sequential engine (federation.execution)."""

from __future__ import annotations

import copy
import io
import itertools
import logging
import math
import sys
from pathlib import Path

import pytest
import torch

from protofl.attacks.mia import diagnostics_for
from protofl.config import ConfigError, ExperimentConfig
from protofl.data.cache import protofl_home
from protofl.data.partition import PartitionError
from protofl.engine.batched import BatchedTrainer
from protofl.engine.federated_data import FederatedData, build_federated_data
from protofl.engine.simulation import Simulation
from protofl.engine.store import FrozenParameterPool, FrozenProjections
from protofl.methods.base import Batch, ClientState, GlobalState
from protofl.methods.baselines import FedAvg
from protofl.models.client import build_client_model
from protofl.privacy import create_mechanism
from protofl.privacy.config import PrivacyConfig
from protofl.privacy.prototype import release_many
from tests.engine.helpers import run_stopped_in_round

# parameters after 3 rounds: batched and per-client products sum in different orders, so the
# two modes agree to float rounding, not bitwise
ATOL = 1e-5


def _config(**extra: str) -> ExperimentConfig:
    over = {
        "data.name": "toy",
        "data.train_fraction": "1",
        "data.clients_per_domain": "3",
        "data.partition": "dirichlet",  # unequal client sizes (13 to 92 samples)
        "data.dirichlet_alpha": "0.5",
        "backbone.name": "pixels",
        "backbone.image_size": "16",
        "backbone.proto_dim": "32",
        "federation.rounds": "3",
        "federation.batch_size": "16",
        "federation.local_epochs": "2",
        "run.progress": "false",
    }
    over.update(extra)
    return ExperimentConfig().with_overrides([f"{k}={v}" for k, v in over.items()])


_DATA: dict[str, FederatedData] = {}


def _data(cfg: ExperimentConfig) -> FederatedData:
    key = repr((cfg.data, cfg.backbone.name, cfg.backbone.image_size, cfg.seed))
    if key not in _DATA:
        _DATA[key] = build_federated_data(cfg, protofl_home())
    return _DATA[key]


def _pair(**extra: str) -> tuple[Simulation, Simulation]:
    seq = _config(**extra)
    bat = _config(**extra, **{"federation.execution": "batched"})
    return Simulation(seq, _data(seq)), Simulation(bat, _data(bat))


def _max_diff(a: Simulation, b: Simulation) -> float:
    worst = 0.0
    for ca, cb in zip(a.clients, b.clients):
        for p, q in zip(ca.model.state_dict().values(), cb.model.state_dict().values()):
            worst = max(worst, float((p - q).abs().max()))
        sa, sb = ca.optimizer.state_dict()["state"], cb.optimizer.state_dict()["state"]
        for key in sa.keys() | sb.keys():
            # a parameter that never had a gradient has no state in torch's optimizer; the
            # batched store holds it as torch would create it (zero moments, step 0)
            a, b = sa.get(key) or _fresh(sb[key]), sb.get(key) or _fresh(sa[key])
            assert a.keys() == b.keys()
            for name in a:  # AdamW's moments and step, or SGD's momentum buffer
                diff = (a[name].float() - b[name].float()).abs().max()
                worst = max(worst, float(diff))
        if ca.dcr is not None:
            assert ca.dcr.steps == cb.dcr.steps
            for p, q in zip(ca.dcr.teacher.parameters(), cb.dcr.teacher.parameters()):
                worst = max(worst, float((p - q).abs().max()))
    return worst


def _fresh(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The optimizer state of a parameter that never stepped: zeros shaped like ``state``."""
    return {k: torch.zeros_like(v) for k, v in state.items()}


CASES = {
    "local": {"method.name": "local"},
    "fedproto": {},
    "fedproto-vpdr-mlp": {"privacy.mechanism": "vpdr", "backbone.head": "mlp"},
    "fedproto-frozen-proj-partial": {
        "backbone.train_projection": "false",
        "federation.participation": "0.5",
        "privacy.mechanism": "vpp",
    },
    # the VPDR preset's model: frozen projection, MLP head, DCR
    "fedproto-vpdr-frozen-proj-mlp": {
        "backbone.train_projection": "false",
        "backbone.head": "mlp",
        "privacy.mechanism": "vpdr",
    },
    "fedavg": {"method.name": "fedavg"},
    "fedprox-partial": {
        "method.name": "fedprox",
        "method.params.mu": "0.5",
        "federation.participation": "0.5",
    },
    # FedDAP's protocol: SGD with momentum and weight decay, weights averaged.  Its CPCL
    # temperature 0.02 multiplies float-rounding differences by ~50 per step (3 rounds: 4e-3
    # apart, with AdamW too); at temperature 1 the two modes agree to 2e-7
    "feddap-sgd": {
        "method.name": "feddap",
        "method.params.tau_cross": "1.0",
        "method.params.tau_agg": "1.0",
        "federation.optimizer": "sgd",
        "federation.lr": "0.01",
        "federation.weight_decay": "1e-5",
    },
    "fedproto-sgd-nesterov-free": {
        "federation.optimizer": "sgd",
        "federation.momentum": "0",
        "federation.lr": "0.05",
    },
    # federation.grad_clip_norm, tight enough to clip every step, under both optimisers
    "fedavg-sgd-clipped": {
        "method.name": "fedavg",
        "federation.optimizer": "sgd",
        "federation.lr": "0.05",
        "federation.grad_clip_norm": "0.05",
    },
    "fedproto-vpdr-clipped": {"privacy.mechanism": "vpdr", "federation.grad_clip_norm": "0.05"},
    "fedtgp-igpp": {
        "method.name": "fedtgp",
        "method.params.budget": "reference",
        "method.params.server_epochs": "5",
        "privacy.mechanism": "igpp",
    },
    # the methods whose objectives need more than f and the logits (issue 19: every method
    # batches): cluster prototypes and cosine evaluation, per-client prototype tables and
    # a head without cross-entropy, reference models, a server teacher, frozen heads and an
    # input transform
    "fpl-prototype-eval": {
        "method.name": "fpl",
        "method.params.temperature": "0.5",
        "method.params.eval": "prototype",
        "privacy.mechanism": "igpp",
    },
    # alpha = 1 for the reason given below (with the SHAKE-256 noise draws, alpha = 0.25 grows
    # one client's rounding differences to 6e-4 in three rounds)
    "fedplvm-igpp": {
        "method.name": "fedplvm",
        "method.params.eval": "prototype",
        "method.params.alpha": "1.0",
        "privacy.mechanism": "igpp",
    },
    # alpha = 0.25 makes |s|^alpha's gradient ~1e4 near s = 0, which grows float-rounding
    # differences past the tolerance within three rounds (like FedDAP's tau 0.02 below);
    # alpha = 1 checks the same code paths
    "fedplvm-vpdr-supcon": {
        "method.name": "fedplvm",
        "method.params.contrast": "supcon",
        "method.params.correction": "abs_sum",
        "method.params.alpha": "1.0",
        "method.params.eval": "prototype",
        "privacy.mechanism": "vpdr",
    },
    "fedplvm-shared-weights": {
        "method.name": "fedplvm",
        "method.params.share_weights": "true",
        "federation.optimizer": "sgd",
        "federation.lr": "0.01",
    },
    "fedpcl-no-ce": {"method.name": "fedpcl", "privacy.mechanism": "igpp"},
    "fedpcl-no-ce-sgd": {
        "method.name": "fedpcl",
        "federation.optimizer": "sgd",
        "federation.lr": "0.05",
        "federation.grad_clip_norm": "0.5",
    },
    "fedpcl-ce-vpdr": {
        "method.name": "fedpcl",
        "method.params.ce_weight": "0.5",
        "method.params.tau": "0.5",
        "method.params.eval": "classifier",
        "privacy.mechanism": "vpdr",
    },
    "moon": {"method.name": "moon", "method.params.mu": "1.0"},
    "mpft": {"method.name": "mpft", "method.params.server_epochs": "2"},
    "mpft-feature-source-frozen-proj": {
        "method.name": "mpft",
        "method.params.server_epochs": "2",
        "method.params.prototype_source": "feature",
        "method.params.teacher": "head",
        "backbone.train_projection": "false",
    },
    "copa": {"method.name": "copa"},
    "copa-own-mlp": {"method.name": "copa", "method.params.eval": "own", "backbone.head": "mlp"},
    "fedrdn": {"method.name": "fedrdn", "method.params.include_self": "false"},
    "fedrdn-federation-stats": {
        "method.name": "fedrdn",
        "method.params.eval_stats": "federation",
        "method.params.statistics": "scalar",
    },
    "feddap-prototype-eval": {
        "method.name": "feddap",
        "method.params.tau_cross": "1.0",
        "method.params.eval": "prototype",
    },
}


@pytest.mark.parametrize("case", list(CASES))
def test_batched_matches_sequential(case: str) -> None:
    seq, bat = _pair(**CASES[case])
    hs, hb = seq.run(), bat.run()
    assert bat.batched is not None and bat.batched.supported
    assert [h.client_acc for h in hs] == [h.client_acc for h in hb]
    assert [h.participants for h in hs] == [h.participants for h in hb]
    for x, y in zip(hs, hb):
        assert math.isclose(x.train_loss, y.train_loss, rel_tol=1e-5)
    assert _max_diff(seq, bat) < ATOL
    sizes = [c.data.num_train for c in seq.clients]
    assert len(set(sizes)) > 3  # unequal clients: some are masked on padded steps


@pytest.mark.parametrize(
    "case",
    [
        "fedproto-frozen-proj-partial",
        "fedproto-vpdr-frozen-proj-mlp",
        "mpft-feature-source-frozen-proj",
    ],
)
def test_reassociated_frozen_projection_matches_sequential(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BatchedTrainer.REASSOCIATE: proj(z) once a round and (P U) h per step instead of P over
    the step's rows gives what the sequential engine gives (to float rounding)."""
    monkeypatch.setattr(BatchedTrainer, "REASSOCIATE", True)
    used = []
    times_up = FrozenProjections.times_up
    monkeypatch.setattr(
        FrozenProjections,
        "times_up",
        lambda self, u, which: used.append(len(which)) or times_up(self, u, which),
    )
    seq, bat = _pair(**CASES[case])
    hs, hb = seq.run(), bat.run()
    assert used  # the re-associated products ran
    assert [h.client_acc for h in hs] == [h.client_acc for h in hb]
    for x, y in zip(hs, hb):
        assert math.isclose(x.train_loss, y.train_loss, rel_tol=1e-5)
    # (P U) h sums in another order than P (U h): the rounding differences reach 2.2e-5 in
    # three rounds with some noise draws (measured with the SHAKE-256 noise keys)
    assert _max_diff(seq, bat) < 5 * ATOL


def test_reassociation_pays_for_wide_steps_only() -> None:
    """The count behind REASSOCIATE at 1280 -> 512 with H = 64: the VPDR preset's steps of 256
    rows re-associate, the 1000-client benchmark's of ~16 rows do not, and neither do steps of
    64 rows that pay proj(z) for one epoch only."""
    cfg = _config(**{"backbone.train_projection": "false"})
    trainer = BatchedTrainer(Simulation(cfg, _data(cfg)))
    trainer.shapes = {"proj.weight": (512, 1280), "adapter.down.weight": (64, 1280)}
    use, narrowest = trainer._reassociation(torch.tensor([[256, 256, 100], [145, 0, 0]]))
    assert use and 50 < narrowest < 70
    assert not trainer._reassociation(torch.tensor([[16, 16], [9, 16]]))[0]
    trainer.sim.config = cfg.with_overrides(["federation.local_epochs=1"])
    assert not trainer._reassociation(torch.tensor([[64], [64]]))[0]


def _trainable(model: torch.nn.Module) -> torch.Tensor:
    """A copy of the model's trainable parameters, flattened into one vector."""
    return torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_grad_clip_norm_bounds_every_local_step(execution: str) -> None:
    """federation.grad_clip_norm: with plain SGD (no momentum, no weight decay) a step moves a
    client's trainable parameters by lr * min(|g|, clip), so a round of s steps moves them by at
    most s * lr * clip; unclipped, the same round moves them further."""
    over = {
        "federation.optimizer": "sgd",
        "federation.momentum": "0",
        "federation.weight_decay": "0",
        "federation.lr": "0.05",
        "federation.rounds": "1",
        "federation.execution": execution,
        "method.name": "local",
    }
    moved = {}
    for clip in ("0", "0.01"):
        cfg = _config(**over, **{"federation.grad_clip_norm": clip})
        sim = Simulation(cfg, _data(cfg))
        before = [_trainable(c.model) for c in sim.clients]
        sim.run()
        moved[clip] = [float((_trainable(c.model) - b).norm()) for c, b in zip(sim.clients, before)]
        steps = [2 * math.ceil(c.data.num_train / 16) for c in sim.clients]  # 2 epochs, batch 16
    for d, s in zip(moved["0.01"], steps):
        assert d <= s * 0.05 * 0.01 * (1 + 1e-4)
    assert all(a > 2 * b for a, b in zip(moved["0"], moved["0.01"]))


def test_reference_optimizer_and_dcr_warmup() -> None:
    extra = {"privacy.mechanism": "vpdr", "privacy.dcr_warmup_steps": "3"}
    seq, bat = _pair(**extra)
    bat.batched = BatchedTrainer(bat, optimizer="reference", memory_budget=1)  # 1 client/group
    hs, hb = seq.run(), bat.run()
    assert [h.client_acc for h in hs] == [h.client_acc for h in hb]
    assert _max_diff(seq, bat) < ATOL


def test_engine_hooks_match_sequential() -> None:
    """Uploads from the trainer's features, evaluate and evaluate_holdout against the engine's."""
    cfg = _config(
        **{
            "privacy.mechanism": "vpp",
            "backbone.train_projection": "false",
            "data.holdout_domain": "grey",
            "federation.rounds": "2",
            "federation.poison": "{red-1: 5.0}",
            "run.mia_every": "2",
        }
    )
    sim = Simulation(cfg, _data(cfg), upload_hooks=diagnostics_for(cfg))
    sim.run_round()
    twin = Simulation(cfg, _data(cfg), upload_hooks=diagnostics_for(cfg))
    buf = io.BytesIO()
    torch.save(sim.state_dict(), buf)
    buf.seek(0)
    twin.load_state_dict(torch.load(buf, weights_only=False))
    trainer = BatchedTrainer(twin)
    assert trainer.evaluate() == sim.evaluate()
    assert trainer.evaluate_holdout() == pytest.approx(sim.evaluate_holdout())
    active = [i % 3 != 0 for i in range(len(sim.clients))]
    ups = sim.collect_uploads(active)
    ups_b = twin.upload(active, trainer.features_many, vectorise=True)
    assert [u.client for u in ups] == [u.client for u in ups_b]
    for u, v in zip(ups, ups_b):
        assert u.release is not None and v.release is not None
        assert torch.equal(u.release.classes, v.release.classes)
        assert torch.equal(u.release.noise_std, v.release.noise_std)
        assert u.release.info == v.release.info and u.release.events == v.release.events
        assert torch.allclose(u.release.prototypes, v.release.prototypes, atol=1e-4)
    assert [r is None for r in sim.releases[-1]] == [r is None for r in twin.releases[-1]]
    for name, stats in sim.last_feature_norms.items():
        assert twin.last_feature_norms[name] == pytest.approx(stats, rel=1e-5)
    assert sim.last_mia and sim.last_mia.keys() == twin.last_mia.keys()
    for name, scores in sim.last_mia.items():
        assert twin.last_mia[name] == pytest.approx(scores, rel=1e-3, abs=1e-3)
    for c, d in zip(sim.clients, twin.clients):
        assert c.privacy.ledger.state_dict() == d.privacy.ledger.state_dict()
        assert c.privacy.key.state_dict() == d.privacy.key.state_dict()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_checkpoint_resume_in_batched_mode(optimizer: str) -> None:
    cfg = _config(
        **{
            "federation.execution": "batched",
            "privacy.mechanism": "vpdr",
            "federation.optimizer": optimizer,
        }
    )
    full = Simulation(cfg, _data(cfg))
    full.run()
    part = Simulation(cfg, _data(cfg))
    part.run(rounds=2)
    buf = io.BytesIO()
    torch.save(part.state_dict(), buf)
    size = buf.tell()
    resumed = Simulation(cfg, _data(cfg))
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=False))
    resumed.run()
    assert [h.client_acc for h in resumed.history] == [h.client_acc for h in full.history]
    assert _max_diff(full, resumed) < ATOL
    # the checkpoint holds each client's rows once, not the stacked storage per client
    own = sum(p.numel() * 4 * 3 for c in part.clients for p in c.model.trainable_parameters())
    assert size < 2 * own + 2**20


class _OwnLoss(FedAvg):
    """A method whose objective only its ``client_loss`` knows (no declaration)."""

    name = "own-loss"

    def client_loss(
        self, batch: Batch, global_state: GlobalState, state: ClientState
    ) -> torch.Tensor:
        return 2.0 * torch.nn.functional.cross_entropy(batch.logits, batch.y)


def test_every_registered_method_batches() -> None:
    """Issue 19: every method declares its objective and evaluation rule."""
    from protofl.methods import METHOD_REGISTRY, create_method

    for name in METHOD_REGISTRY.names():
        for params in ({}, {"eval": "prototype"}):
            try:
                m = create_method(name, params, num_classes=4, num_domains=2, proto_dim=8)
            except ValueError:  # no such evaluation mode
                continue
            assert m.batchable, f"{name} {params} does not batch"


def test_unsupported_method_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    seq, bat = _pair(**{"method.name": "fedavg", "federation.rounds": "2"})
    for sim in (seq, bat):
        sim.method = _OwnLoss(
            {}, num_classes=sim.data.num_classes, num_domains=4, proto_dim=32, seed=0
        )
    with caplog.at_level(logging.INFO, logger="protofl.engine.batched"):
        hb = bat.run()
    assert "method own-loss cannot batch; falling back to sequential" in caplog.text
    assert not bat.batched.supported
    assert [h.client_acc for h in seq.run()] == [h.client_acc for h in hb]


def test_unsupported_model_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    cfg = _config(**{"federation.execution": "batched"})
    sim = Simulation(cfg, _data(cfg))
    sim.clients[2].model.head = torch.nn.Sequential(
        torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )
    with caplog.at_level(logging.INFO, logger="protofl.engine.batched"):
        trainer = BatchedTrainer(sim)
    assert not trainer.supported
    assert "cannot batch; falling back to sequential" in caplog.text
    assert sim.clients[2].data.name in caplog.text


def test_too_many_clients_fail_with_the_partitioner_numbers() -> None:
    cfg = _config(**{"data.clients_per_domain": "500", "federation.execution": "batched"})
    with pytest.raises(PartitionError, match=r"160 samples cannot give 500 clients"):
        build_federated_data(cfg, protofl_home())


def test_frozen_projection_is_shared() -> None:
    cfg = _config(**{"backbone.train_projection": "false", "federation.execution": "batched"})
    sim = Simulation(cfg, _data(cfg))
    # homogeneous clients are copies of one built model, holding its frozen tensors from the
    # start (nothing for the pool to free)
    first = sim.clients[0].model.proj.weight
    assert all(c.model.proj.weight is first for c in sim.clients)
    assert sim.frozen_pool.shared_bytes == 0
    # models built one by one (a backbone that builds each client) are pooled as they come
    built = [
        build_client_model(first.shape[1], 3, cfg.backbone, torch.Generator().manual_seed(0))
        for _ in range(3)
    ]
    pool = FrozenParameterPool()
    for model in built:
        pool.share(model)
    assert all(m.proj.weight is built[0].proj.weight for m in built)
    assert pool.shared_bytes == 2 * (first.numel() + 32) * 4
    # trainable parameters stay per client
    heads = {id(c.model.head.weight) for c in sim.clients}
    assert len(heads) == len(sim.clients)
    pool = FrozenParameterPool()  # pooling again finds nothing left to share
    for c in sim.clients:
        pool.share(c.model)
    assert pool.shared_bytes == 0
    sim.run(rounds=1)  # trains, evaluates, releases with the shared tensor
    assert all(c.model.proj.weight is first for c in sim.clients)


@pytest.mark.parametrize(
    "settings",
    [
        {"mechanism": "igpp"},
        {"mechanism": "igpp", "igpp_group_clip": True},
        {"mechanism": "vpp"},
        {"mechanism": "vpp", "vpp_variant": "normalized_once"},
        {"mechanism": "vpp", "vpp_variant": "history", "neighbouring": "add_remove"},
        {"mechanism": "vpp", "neighbouring": "add_remove", "addremove_counts": "noisy"},
        {"mechanism": "none"},
    ],
)
def test_release_many_matches_per_client_releases(settings: dict[str, object]) -> None:
    gen = torch.Generator().manual_seed(0)
    sizes = [0, 1, 3, 17, 40, 7, 25]
    feats = [3 * torch.randn(n, 16, generator=gen) for n in sizes]
    labels = [torch.randint(0, 5, (n,), generator=gen) for n in sizes]
    names = [f"c{i}" for i in range(len(sizes))]
    cfg = PrivacyConfig(warn_min_count=2, **settings)  # type: ignore[arg-type]
    a = create_mechanism(cfg, rounds=2, dim=16)
    b = copy.deepcopy(a)
    gens_a = [torch.Generator().manual_seed(i) for i in range(len(sizes))]
    gens_b = [torch.Generator().manual_seed(i) for i in range(len(sizes))]
    for _ in range(2):
        ra = [
            a.release(f, y, num_classes=5, generator=g, client=n)
            for f, y, g, n in zip(feats, labels, gens_a, names)
        ]
        rb = release_many(b, feats, labels, num_classes=5, generators=gens_b, clients=names)
        for x, y in zip(ra, rb):
            assert torch.equal(x.classes, y.classes) and torch.equal(x.counts, y.counts)
            assert torch.equal(x.sensitivity, y.sensitivity)
            assert torch.equal(x.noise_std, y.noise_std)
            assert x.info == y.info and x.events == y.events and x.mechanism == y.mechanism
            assert torch.allclose(x.prototypes, y.prototypes, atol=1e-5)
        for g, h in zip(gens_a, gens_b):
            assert torch.equal(g.get_state(), h.get_state())
    if hasattr(a, "state_dict"):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.get("released") == sb.get("released")
        assert sa.get("partitions") == sb.get("partitions")
    if settings["mechanism"] != "none":  # the budget guard, as release's
        with pytest.raises(RuntimeError, match="already made the 2 releases"):
            release_many(b, feats, labels, num_classes=5, generators=gens_b, clients=names)


def test_release_many_rejects_bad_features_like_release() -> None:
    mech = create_mechanism(PrivacyConfig(mechanism="vpp"), rounds=1, dim=8)
    good = torch.randn(4, 8)
    bad = good.clone()
    bad[1, 2] = math.nan
    labels = [torch.tensor([0, 1, 0, 1])] * 2
    gens = [torch.Generator(), torch.Generator()]
    with pytest.raises(ValueError, match="client 'b': 1 feature vectors are not finite"):
        release_many(mech, [good, bad], labels, num_classes=2, generators=gens, clients=["a", "b"])


def test_float16_cached_features_train_and_evaluate_batched() -> None:
    """The batched paths upcast float16 features (half the feature memory)."""
    cfg = _config(**{"backbone.train_projection": "false", "federation.rounds": "2"})
    full = Simulation(cfg, _data(cfg))
    half_data = copy.copy(_data(cfg))
    half_data.clients = [copy.copy(c) for c in half_data.clients]
    tests: dict[int, torch.Tensor] = {}
    for c in half_data.clients:
        c.train_z = c.train_z.half()
        c.test_z = tests.setdefault(id(c.test_z), c.test_z.half())
    half = Simulation(cfg, half_data)
    for sim in (full, half):
        trainer = BatchedTrainer(sim)
        for _ in range(2):
            ups = sim.upload(None, trainer.features_many, vectorise=True)
            sim.global_state = sim.method.aggregate(ups, sim.round)
            trainer.train(sim.clients)
            sim.round += 1
        sim.history_acc = trainer.evaluate()  # type: ignore[attr-defined]
    a, b = full.history_acc, half.history_acc  # type: ignore[attr-defined]
    assert abs(sum(a.values()) - sum(b.values())) / len(a) < 0.05


def test_privacy_status_accounts_each_distinct_ledger_once() -> None:
    from protofl.privacy import accounting

    cfg = _config(**{"privacy.mechanism": "igpp", "federation.rounds": "1"})
    sim = Simulation(cfg, _data(cfg))
    real = accounting.epsilon_spent
    accounting._compose.cache_clear()
    sim.run_round()
    eps = sim.history[-1].privacy["epsilon_spent"]
    # every client made the same kind of release (same sigma, same sensitivity): one composition
    compositions = accounting._compose.cache_info().misses
    assert len(set(eps.values())) == 1 and compositions == 1
    fresh = {
        c.data.name: real(c.privacy.ledger.events(), delta=c.privacy.ledger.delta)
        for c in sim.clients
    }
    assert eps == pytest.approx(fresh)
    # a client whose ledger differs (it sat out a round) is accounted on its own
    sim.clients[0].privacy.ledger.entries.pop()
    sim.clients[0].privacy.ledger._cache = None
    status = sim.privacy_status()
    assert status["epsilon_spent"][sim.clients[0].data.name] == 0.0
    assert status["epsilon_spent"][sim.clients[1].data.name] == eps[sim.clients[1].data.name]


def test_batched_engine_uses_the_batched_uploads_and_evaluation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seq, bat = _pair(**{"privacy.mechanism": "vpp", "data.holdout_domain": "grey"})
    used: list[str] = []
    for name in ("features_many", "evaluate", "evaluate_holdout"):
        real = getattr(BatchedTrainer, name)

        def spy(self: BatchedTrainer, *a: object, _real: object = real, _n: str = name) -> object:
            used.append(_n)
            return _real(self, *a)  # type: ignore[operator]

        monkeypatch.setattr(BatchedTrainer, name, spy)
    hs, hb = seq.run(), bat.run()
    assert set(used) == {"features_many", "evaluate", "evaluate_holdout"}
    assert [h.client_acc for h in hs] == [h.client_acc for h in hb]
    assert [h.holdout_acc for h in hs] == pytest.approx([h.holdout_acc for h in hb])
    assert [h.privacy for h in hs] == [h.privacy for h in hb]


# --------------------------------------------------------------------------------------------
# run.client_state=disk: the store in memory-mapped files
# --------------------------------------------------------------------------------------------
def _resident_kb() -> int:
    """This process's resident set (kB), from /proc."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux")
def test_a_mapped_tensor_keeps_its_values_when_its_pages_leave_the_resident_set(
    tmp_path: Path,
) -> None:
    from protofl.engine.store import drop_pages, mapped_tensor

    t = mapped_tensor(tmp_path / "rows.f32", (64, 256, 1024))  # 64 rows of 1 MB, sparse
    assert (tmp_path / "rows.f32").stat().st_size == 64 * 2**20
    before = _resident_kb()
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))
    touched = _resident_kb()
    assert touched - before > 48 * 1024  # the written pages are resident
    drop_pages(t.data_ptr(), t.data_ptr() + t.numel() * 4)
    assert touched - _resident_kb() > 48 * 1024  # and leave the resident set
    assert torch.equal(t, torch.arange(t.numel(), dtype=torch.float32).view(t.shape))


def _offload_config(state: str, *extra: str) -> ExperimentConfig:
    over = {
        "federation.execution": "batched",
        "federation.participation": "0.5",
        "privacy.mechanism": "vpdr",  # with DCR: teachers live in the store too
        "run.client_state": state,
    }
    over.update(e.split("=", 1) for e in extra)
    return _config(**over)


@pytest.mark.parametrize("variant", ["adamw", "frozen-reassociated", "sgd-momentum", "gathered"])
def test_offloaded_and_in_memory_runs_give_identical_summaries(
    tmp_path: Path, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also with a frozen projection re-associated (in memory its proj(z) is cached per client
    across rounds, on disk it is computed each round: resident memory stays with the round),
    and with SGD's momentum buffers (in the store's ``exp_avg`` rows, never written before a
    client's first step on disk), and with gathered groups (gaps in their rows) that mix
    never-stepped clients with stepped ones."""
    from protofl.engine.runner import STATE_DIR, run_experiment

    extra = ["run.save_releases=false"]
    if variant == "frozen-reassociated":
        monkeypatch.setattr(BatchedTrainer, "REASSOCIATE", True)
        extra.append("backbone.train_projection=false")
    if variant == "sgd-momentum":
        extra += ["federation.optimizer=sgd", "federation.momentum=0.9"]
    if variant == "gathered":  # groups with gaps in their rows, fresh and stepped clients mixed
        extra += [
            "data.clients_per_domain=6",
            "federation.participation=0.4",
            "federation.rounds=4",
        ]
    runs = {}
    for state in ("memory", "disk"):
        cfg = _offload_config(state, *extra)
        runs[state] = run_experiment(cfg, out=tmp_path / state, data=_data(cfg))
    drop = ("wall_s", "setup_s", "environment")
    same = [{k: v for k, v in r.summary.items() if k not in drop} for r in runs.values()]
    assert same[0] == same[1]
    assert [m.avg_acc for m in runs["memory"].history] == [m.avg_acc for m in runs["disk"].history]
    # the mapped store is gone once the run has finished (its last checkpoint holds it)
    assert not (runs["disk"].run_dir / STATE_DIR).exists()


def test_offloaded_clients_point_into_the_mapped_files(tmp_path: Path) -> None:
    cfg = _offload_config("disk")
    sim = Simulation(cfg, _data(cfg), state_dir=tmp_path / "state")
    sim.run(1)
    store = sim.batched.store
    assert store.mapped and sorted(p.name for p in (tmp_path / "state").iterdir())
    for c in sim.clients:
        r = store.row[c.data.client]
        assert c.model.head.weight.data_ptr() == store.param["head.weight"][r].data_ptr()
        assert c.dcr.teacher.weight.data_ptr() == store.teacher["weight"][r].data_ptr()


def test_a_first_adoption_leaves_the_mapped_moments_unwritten(tmp_path: Path) -> None:
    """A fresh mapped store reads as zeros: adopting a never-stepped client points its AdamW
    state at its rows without writing them (the moment files stay sparse; the run itself
    equals the in-memory one, test_offloaded_and_in_memory_runs_give_identical_summaries).
    Once a row has held a state, a client without one gets its moments zeroed again."""
    cfg = _offload_config("disk")
    sim = Simulation(cfg, _data(cfg), state_dir=tmp_path / "state")
    store = sim.batched.store
    moments = sorted((tmp_path / "state").glob("exp_avg*.f32"))
    assert len(moments) == 2 * len(store.names)
    blocks = sum(f.stat().st_blocks for f in moments)
    c = sim.clients[0]
    r = store.row[c.data.client]
    assert store.adopt(c) == 0  # its parameters were offloaded when it was built
    assert sum(f.stat().st_blocks for f in moments) == blocks
    for n, path in zip(store.names, store.paths):
        st = c.optimizer.state[store._get(c.model, path)]
        assert st["exp_avg"].data_ptr() == store.exp_avg[n][r].data_ptr()
        assert not st["exp_avg"].any() and not st["exp_avg_sq"].any() and st["step"] == 0
    for n in store.names:  # another state's values in the rows, then a client without state
        store.exp_avg[n][r].fill_(1.0)
        store.exp_avg_sq[n][r].fill_(1.0)
    c.optimizer.state.clear()
    assert store.adopt(c) > 0
    assert not any(store.exp_avg[n][r].any() or store.exp_avg_sq[n][r].any() for n in store.names)


def test_zero_parameters_are_offloaded_without_writing(tmp_path: Path) -> None:
    """A fresh adapter's up-projection (and its DCR teacher's) is zero: building the clients of
    an offloaded run points it at never-written rows (its files stay sparse) instead of
    writing zeros; non-zero tensors are written; a row once adopted is written as before."""
    cfg = _offload_config("disk")
    sim = Simulation(cfg, _data(cfg), state_dir=tmp_path / "state")
    store = sim.batched.store
    ups = [n for n in store.names if n.startswith("adapter.up")]
    assert ups and store.teacher
    for kind, group in (("param", store.param), ("teacher", store.teacher)):
        for n in group:
            blocks = (tmp_path / "state" / f"{kind}.{n}.f32").stat().st_blocks
            assert (blocks == 0) == n.startswith("adapter.up"), (kind, n, blocks)
    c = sim.clients[0]
    r = store.row[c.data.client]
    for n, path in zip(store.names, store.paths):
        p = store._get(c.model, path)
        assert p.data_ptr() == store.param[n][r].data_ptr()
        assert bool(p.any()) != n.startswith("adapter.up")
    # not blank any more: a client's new zero tensor is written over the row's values
    store.param[ups[0]][r].fill_(1.0)
    p = store._get(c.model, store.paths[store.names.index(ups[0])])
    p.data = torch.zeros_like(p)
    assert store.adopt(c, optimizer=False) == p.numel() * 4
    assert not store.param[ups[0]][r].any()


def test_a_mapped_store_prefetches_each_row_once_before_its_first_gather(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of a mapped store are advised into the page cache (MADV_WILLNEED) before their
    first gather, every tensor's bytes of them, once; an in-memory store advises nothing."""
    from protofl.engine import store as paging  # the stacked storage's module

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(paging, "prefetch_pages", lambda a, b: calls.append((a, b)))
    cfg = _offload_config("disk")
    sim = Simulation(cfg, _data(cfg), state_dir=tmp_path / "state")
    store = sim.batched.store

    def covered(r: int) -> bool:  # every tensor's row r lies in one advised range
        return all(
            any(a <= store._ptr(t, r) and store._ptr(t, r + 1) <= b for a, b in calls)
            for t in store.tensors()
        )

    store.prefetch([3, 1])
    assert covered(1) and covered(3) and not covered(0)
    calls.clear()
    store.prefetch([1, 3])  # advised once
    assert calls == []
    trained = sim.clients[: len(sim.clients) // 2]
    sim.batched.train(trained)  # training advises its groups' rows first
    rows = {store.row[c.data.client] for c in trained} - {1, 3}
    assert rows and all(covered(r) for r in rows)
    assert not store._cold & (rows | {1, 3})
    calls.clear()
    mem = _offload_config("memory")
    sim = Simulation(mem, _data(mem))
    BatchedTrainer(sim).train(sim.clients)
    assert calls == []


def test_a_memory_budget_below_one_client_is_refused_naming_the_setting() -> None:
    cfg = _offload_config("disk", "run.memory_budget_mb=1", "backbone.adapter_hidden=4096")
    with pytest.raises(ValueError, match=r"run\.memory_budget_mb=1 .* needs \d+ MB"):
        Simulation(cfg, _data(cfg))


def test_disk_client_state_needs_the_batched_executor() -> None:
    with pytest.raises(ConfigError, match=r"run\.client_state=disk .* federation\.execution"):
        _config(**{"run.client_state": "disk"})
    cfg = _offload_config("disk", "run.amp=bf16")  # bf16 autocast does not batch
    with pytest.raises(ValueError, match=r"run\.client_state=disk needs a run the batched"):
        Simulation(cfg, _data(cfg))


def test_an_offloaded_run_stopped_mid_way_resumes_to_the_same_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from protofl.engine.runner import resume_experiment, run_experiment

    cfg = _offload_config("disk", "run.save_releases=false")
    full = run_experiment(cfg, out=tmp_path / "full", data=_data(cfg))
    run_dir = run_stopped_in_round(cfg, 3, tmp_path / "stopped", monkeypatch, data=_data(cfg))
    resumed = resume_experiment(run_dir)
    assert [m.avg_acc for m in resumed.history] == [m.avg_acc for m in full.history]
    assert resumed.summary["privacy"] == full.summary["privacy"]


def _brute_pieces(widths: list[int], piece_rows: int) -> float:
    """The least cost of any cut of ``widths`` into contiguous pieces (every cut tried)."""
    n = len(widths)
    best = [0.0] + [math.inf] * n
    for j in range(1, n + 1):
        for i in range(j):
            best[j] = min(best[j], best[i] + piece_rows + (j - i) * max(widths[i:j]))
    return best[n]


@pytest.mark.parametrize("seed", range(40))
def test_pieces_cover_every_row_at_the_least_padded_cost(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    k = int(torch.randint(1, 40, (1,), generator=g))
    widths = torch.randint(1, 65, (k,), generator=g).tolist()
    if seed % 2:  # as a step's widths come: sorted, longest first, with repeats
        widths = sorted((w // 8 * 8 or 1 for w in widths), reverse=True)
    pieces = BatchedTrainer._pieces(widths)
    assert pieces[0][0] == 0 and pieces[-1][1] == k
    assert all(p[1] == q[0] for p, q in itertools.pairwise(pieces))  # contiguous, no overlap
    assert all(w == max(widths[a:b]) for a, b, w in pieces)  # no row cut short
    rows = BatchedTrainer.PIECE_ROWS
    cost = sum(rows + (b - a) * w for a, b, w in pieces)
    assert cost == _brute_pieces(widths, rows)


def test_pieces_of_one_width_are_one_piece_and_a_wide_spread_is_cut() -> None:
    assert BatchedTrainer._pieces([64] * 100) == [(0, 100, 64)]
    # 100 clients of 64 rows and 100 of 2: padding the short ones to 64 would cost 6,200 rows
    assert BatchedTrainer._pieces([64] * 100 + [2] * 100) == [(0, 100, 64), (100, 200, 2)]


def _reference_batches(
    clients: list[object], steps: list[int], bs: int, epochs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step rows spelled out client by client, epoch by epoch (as train_client draws)."""
    m, width = len(clients), min(bs, max(c.data.num_train for c in clients))  # type: ignore[attr-defined]
    index = torch.zeros(m, steps[0], width, dtype=torch.long)
    valid = torch.zeros(m, steps[0], width, dtype=torch.bool)
    offset = 0
    for i, c in enumerate(clients):
        n = c.data.num_train  # type: ignore[attr-defined]
        per_epoch = math.ceil(n / bs)
        for e in range(epochs):
            perm = torch.randperm(n, generator=c.train_gen) + offset  # type: ignore[attr-defined]
            perm = torch.cat([perm, perm[:1].expand(per_epoch * bs - n)])  # pad: epoch's first
            for j in range(per_epoch):
                for col in range(width):
                    index[i, e * per_epoch + j, col] = perm[j * bs + col]
                    valid[i, e * per_epoch + j, col] = j * bs + col < n
        index[i, steps[i] :] = offset  # after the client's last step: its own first row
        offset += n
    return index, valid


@pytest.mark.parametrize(("batch_size", "epochs"), [(16, 2), (7, 3), (200, 1)])
def test_step_rows_are_each_clients_own_draws(batch_size: int, epochs: int) -> None:
    cfg = _config(
        **{
            "federation.execution": "batched",
            "federation.batch_size": str(batch_size),
            "federation.local_epochs": str(epochs),
        }
    )
    sim = Simulation(cfg, _data(cfg))
    trainer = BatchedTrainer(sim)
    groups = trainer.groups(sim.clients)  # one per domain (its clients share a test set)
    assert any(len({c.data.num_train for c in g.clients}) > 1 for g in groups)  # unequal sizes
    for group in groups:
        states = [c.train_gen.get_state() for c in group.clients]
        index, valid = trainer._batches(group)
        for c, state in zip(group.clients, states):
            c.train_gen.set_state(state)
        ref_index, ref_valid = _reference_batches(group.clients, group.steps, batch_size, epochs)
        assert torch.equal(index, ref_index) and torch.equal(valid, ref_valid)
