"""The simulator on run.device: releases from CPU generators, CPU checkpoints, bf16 autocast."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch

from protofl.engine.batched import BatchedTrainer
from protofl.engine.federated_data import build_federated_data
from protofl.engine.round import eval_subsample
from protofl.engine.simulation import Simulation
from protofl.methods.checks import tiny_config
from protofl.privacy.noise import NoiseKey, draw_normal
from protofl.seeding import Stream, derive_seed, generator


def _sim(device: str = "auto", amp: str = "none", mechanism: str = "vpdr", **extra: Any) -> Any:
    cfg = tiny_config("fedproto", mechanism, rounds=2, clients_per_domain=2)
    over = [f"run.device={device}", f"run.amp={amp}", *(f"{k}={v}" for k, v in extra.items())]
    cfg = cfg.with_overrides(over)
    return Simulation(cfg, build_federated_data(cfg, _home()))


def _home() -> Any:
    from protofl.data.cache import protofl_home

    return protofl_home()


def _releases(sim: Simulation) -> list[list[torch.Tensor]]:
    return [[r.prototypes for r in rr if r is not None] for rr in sim.releases]


def test_device_cpu_and_the_default_give_bitwise_equal_releases() -> None:
    runs = []
    for device in ("cpu", "auto"):
        sim = _sim(device)
        sim.run()
        runs.append(sim)
    a, b = runs
    assert a.device == torch.device("cpu")
    for ra, rb in zip(_releases(a), _releases(b)):
        for pa, pb in zip(ra, rb):
            assert torch.equal(pa, pb)  # bitwise
    assert [h.avg_acc for h in a.history] == [h.avg_acc for h in b.history]
    assert a.privacy_status() == b.privacy_status()


def _spy_round(sim: Simulation) -> list[tuple[set[str], set[str]]]:
    """One round, recording the devices of what the mechanism was handed."""
    seen: list[tuple[set[str], set[str]]] = []
    release_many = sim.mechanism.release_many

    def spy(features: Any, labels: Any, **kw: Any) -> Any:
        gens = kw["generators"]
        seen.append(({f.device.type for f in features}, {g.device.type for g in gens}))
        return release_many(features, labels, **kw)

    sim.mechanism.release_many = spy  # type: ignore[method-assign]
    sim.run_round()
    return seen


def test_the_mechanism_gets_cpu_features_and_draws_from_cpu_generators() -> None:
    for execution in ("sequential", "batched"):
        sim = _sim(**{"federation.execution": execution})
        assert _spy_round(sim) == [({"cpu"}, {"cpu"})]
        assert all(c.privacy.key.device.type == "cpu" for c in sim.clients)
        assert all(c.train_gen.device.type == "cpu" for c in sim.clients)


def test_noise_is_the_cpu_generators_draw() -> None:
    sim = _sim(mechanism="igpp")
    clip = sim.config.privacy.clip
    before = [c.privacy.key.state_dict() for c in sim.clients]
    feats = sim.upload_features(sim.clients)  # round 1 releases the untrained models' features
    sim.run_round()
    for c, f, state, release in zip(sim.clients, feats, before, sim.releases[0]):
        assert release is not None
        replay = NoiseKey.derived(0, 0)
        replay.load_state_dict(state)
        noise = draw_normal(replay, tuple(release.prototypes.shape), "gaussian", torch.float32)
        clipped = f * (clip / f.norm(dim=1, keepdim=True)).clamp(max=1.0)
        means = torch.stack([clipped[c.data.train_y == k].mean(dim=0) for k in release.classes])
        torch.testing.assert_close(
            release.prototypes, means + noise * release.noise_std, atol=1e-5, rtol=1e-5
        )


def test_checkpoints_hold_cpu_tensors_and_record_the_device(caplog: Any) -> None:
    sim = _sim()
    sim.run_round()
    state = sim.state_dict()
    assert state["device"] == "cpu"

    def tensors(value: Any) -> list[torch.Tensor]:
        if isinstance(value, torch.Tensor):
            return [value]
        if isinstance(value, dict):
            return [t for v in value.values() for t in tensors(v)]
        if isinstance(value, (list, tuple)):
            return [t for v in value for t in tensors(v)]
        return []

    assert {t.device.type for t in tensors(state)} == {"cpu"}
    # a checkpoint from before run.device (no key) loads silently; another device warns
    old = dict(state)
    del old["device"]
    fresh = _sim()
    caplog.clear()  # building the data logs at INFO when another test left that level on
    with caplog.at_level(logging.WARNING, logger="protofl.engine.simulation"):
        fresh.load_state_dict(old)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    elsewhere = dict(state, device="cuda:0")
    with caplog.at_level(logging.WARNING, logger="protofl.engine.simulation"):
        _sim().load_state_dict(elsewhere)
    assert "computed on cuda:0" in caplog.text
    fresh.run_round()
    sim.run_round()
    assert fresh.history[-1].avg_acc == sim.history[-1].avg_acc


def test_bf16_autocast_trains_sequentially_and_batched_falls_back(caplog: Any) -> None:
    plain, bf16 = _sim(), _sim(amp="bf16")
    plain.run()
    bf16.run()
    assert all(torch.isfinite(torch.tensor(h.train_loss)) for h in bf16.history)
    # bf16 rounding changes the numbers, not the outcome
    assert abs(bf16.history[-1].avg_acc - plain.history[-1].avg_acc) < 0.15
    batched = _sim(amp="bf16", **{"federation.execution": "batched"})
    with caplog.at_level(logging.INFO, logger="protofl.engine.batched"):
        trainer = BatchedTrainer(batched)
    assert not trainer.supported and "run.amp=bf16 is not batched" in caplog.text


def _budget_sim(execution: str, **extra: Any) -> Any:
    """Nine rounds whose accuracy is still far from 100% (one local epoch at a small step on
    unequal dirichlet clients), so a subsample's accuracy can differ from the whole set's."""
    return _sim(
        mechanism="igpp",
        **{
            "federation.rounds": 9,
            "federation.execution": execution,
            "federation.local_epochs": 1,
            "federation.lr": "3e-4",
            "data.partition": "dirichlet",
            "data.dirichlet_alpha": "0.5",
            **extra,
        },
    )


@torch.no_grad()
def _accuracy(sim: Simulation, c: Any, rows: torch.Tensor | None = None) -> float:
    """``c``'s accuracy now, computed here: on its domain's whole test set, or its ``rows``."""
    z, y = c.data.test_z, c.data.test_y
    if rows is not None:
        z, y = z[rows], y[rows]
    c.model.eval()
    pred = sim.method.predict(c.model, z.float(), sim.global_state, c.state)
    return int((pred == y).sum()) / len(y)


@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_an_evaluation_budget_measures_each_round_on_what_it_promises(execution: str) -> None:
    """eval_every/eval_samples: skipped rounds record no accuracy; sampled rounds are each
    client's accuracy on its test set's fixed seeded subsample of eval_samples (recomputed
    here from its model, and not the whole set's); the last five rounds are on the whole test
    sets; training and the headline equal a run evaluated in full every round."""
    full = _budget_sim(execution)
    full.run()
    sim = _budget_sim(execution, **{"federation.eval_every": 2, "federation.eval_samples": 7})
    seed = sim.config.seed
    subsample_differs = False
    for _ in range(9):
        m = sim.run_round()
        if m.evaluation == "none":
            assert m.client_acc == {} and m.acc == {} and m.holdout_acc is None
            assert math.isnan(m.avg_acc) and math.isnan(m.std_acc)
            continue
        assert m.client_acc.keys() == {c.data.name for c in sim.clients}
        for c in sim.clients:
            whole = _accuracy(sim, c)
            if m.evaluation == "sample":
                gen = generator(seed, Stream.EVAL, c.data.domain)
                rows = eval_subsample(len(c.data.test_y), 7, gen)
                assert rows is not None and len(rows.unique()) == 7 < len(c.data.test_y)
                expected = _accuracy(sim, c, rows)
                subsample_differs |= expected != whole
            else:
                expected = whole
            assert m.client_acc[c.data.name] == expected, (m.round, m.evaluation, c.data.name)
    assert [h.evaluation for h in sim.history] == ["none", "sample"] * 2 + ["full"] * 5
    # the check has teeth: some sampled accuracy is not the whole set's
    assert subsample_differs
    # the last five rounds (final and last-5 figures) equal the unbudgeted run's
    assert [h.client_acc for h in sim.history[4:]] == [h.client_acc for h in full.history[4:]]
    assert [h.avg_acc for h in sim.history[4:]] == [h.avg_acc for h in full.history[4:]]
    # training is untouched by evaluation: every release equals the full run's
    for ra, rb in zip(_releases(sim), _releases(full), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ra, rb, strict=True))
    # the simulation's own subsample is that one, and clients of one domain share it
    by_domain: dict[int, set[int]] = {}
    for c in sim.clients:
        z, y = sim.test_set(c, sample=True)
        rows = eval_subsample(len(c.data.test_y), 7, generator(seed, Stream.EVAL, c.data.domain))
        assert torch.equal(y, c.data.test_y[rows]) and torch.equal(z, c.data.test_z[rows])
        by_domain.setdefault(c.data.domain, set()).add(id(z))
    assert all(len(ids) == 1 for ids in by_domain.values())


def test_homogeneous_clients_are_copies_of_one_built_model(monkeypatch: Any) -> None:
    """Clients that start identical (``client_model_key``) are built once and copied: the
    same weights as building each, trainable tensors of their own, one frozen projection."""
    from protofl.models.backbones import FrozenBackbone, backbone_class

    calls: list[int] = []
    original = FrozenBackbone.client_model.__func__  # type: ignore[attr-defined]

    def counting(cls: Any, *args: Any, client: int = 0, **kw: Any) -> Any:
        calls.append(client)
        return original(cls, *args, client=client, **kw)

    monkeypatch.setattr(FrozenBackbone, "client_model", classmethod(counting))
    sim = _sim(mechanism="none", **{"backbone.train_projection": "false"})
    assert len(sim.clients) == 4 and calls == [0]
    cfg = sim.config
    direct = backbone_class(cfg.backbone).client_model(
        sim.data.feature_dim,
        sim.data.num_classes,
        cfg.backbone,
        torch.Generator().manual_seed(derive_seed(cfg.seed, Stream.INIT)),
    )
    for c in sim.clients:
        sd = c.model.state_dict()
        assert all(torch.equal(v, sd[k]) for k, v in direct.state_dict().items())
    ptrs = [[p.data_ptr() for p in c.model.parameters()] for c in sim.clients]
    frozen = [i for i, p in enumerate(sim.clients[0].model.parameters()) if not p.requires_grad]
    assert frozen and all(len({row[i] for row in ptrs}) == 1 for i in frozen)
    trainable = [i for i in range(len(ptrs[0])) if i not in frozen]
    assert all(len({row[i] for row in ptrs}) == len(ptrs) for i in trainable)


def test_a_backbone_with_its_own_client_model_builds_every_client() -> None:
    """An override of ``client_model`` may vary by client (heterogeneous families, a ResNet's
    augmentation stream): unless it also declares ``client_model_key``, nothing is copied."""
    from protofl.models.backbones import backbone_class
    from protofl.models.heterogeneous import HtC4
    from protofl.models.resnet import ResNet10

    assert backbone_class(tiny_config("fedproto", "none").backbone).client_model_key(5) == 0
    assert HtC4.client_model_key(5) is None and ResNet10.client_model_key(5) is None


# ----- privacy.release_schedule=once (issue 44: one-shot private class means) -------------------
def _once_sim(schedule: str, execution: str = "sequential", rounds: int = 3) -> Any:
    cfg = tiny_config("fedproto", "igpp", rounds=rounds, clients_per_domain=2).with_overrides(
        [
            f"privacy.release_schedule={schedule}",
            "privacy.noise_seed=derived",
            "privacy.epsilon=1",
            f"federation.execution={execution}",
        ]
    )
    return Simulation(cfg, build_federated_data(cfg, _home()))


@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_release_schedule_once_releases_once_with_the_whole_budget(execution: str) -> None:
    once, every = _once_sim("once", execution), _once_sim("every_round", execution)
    assert once.mechanism.rounds == 1 and every.mechanism.rounds == 3
    assert once.mechanism.sigma < every.mechanism.sigma  # one release gets the whole budget
    once.run()
    first = once.releases[0]
    for later in once.releases[1:]:  # re-sent unchanged: the same released values
        for a, b in zip(first, later):
            assert a is not None and b is not None and torch.equal(a.prototypes, b.prototypes)
    for c in once.clients:
        assert len(c.privacy.ledger.entries) == 1 and c.privacy.key.draws > 0
    spent = once.history[-1].privacy["epsilon_spent"]
    assert all(e == pytest.approx(1.0, rel=1e-3) for e in spent.values())
    g = once.guarantee()
    assert "one release, re-sent unchanged" in g["statement"]
    assert not any(gap.startswith("the trained feature map") for gap in g["not_covered"])
    gaps = every.guarantee()["not_covered"]
    assert any(gap.startswith("the trained feature map") for gap in gaps)


def test_release_schedule_once_resumes_with_the_release_it_made() -> None:
    whole = _once_sim("once")
    whole.run()
    first = _once_sim("once")
    first.run(1)
    state = first.state_dict()
    resumed = _once_sim("once")
    resumed.load_state_dict(state)
    resumed.run()
    for a, b in zip(whole.releases[-1], resumed.releases[-1]):
        assert a is not None and b is not None and torch.equal(a.prototypes, b.prototypes)
    assert resumed.history[-1].avg_acc == whole.history[-1].avg_acc
    assert all(len(c.privacy.ledger.entries) == 1 for c in resumed.clients)
