"""Fault injection: kill-and-resume, corrupt checkpoints, hostile uploads, poisoning, dropout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protofl.config import ConfigError, ExperimentConfig
from protofl.engine.checkpoint import CheckpointError, load_latest_checkpoint
from protofl.engine.runner import resume_experiment, run_experiment
from protofl.methods import create_method
from protofl.methods.base import Upload
from protofl.methods.validation import validate_upload
from protofl.privacy.base import Release
from tests.engine.helpers import checkpoint_differences, run_stopped_in_round, toy_config

TIMING = ("wall_s", "setup_s", "environment")


def toy(rounds: int = 3, *extra: str) -> ExperimentConfig:
    return toy_config(rounds, *extra)


def comparable(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in TIMING}


def release(protos: torch.Tensor, classes: list[int], counts: list[int]) -> Release:
    return Release(
        protos,
        torch.tensor(classes),
        torch.tensor(counts),
        torch.zeros(len(classes)),
        torch.zeros_like(protos),
        "igpp",
    )


# ----- checkpoint and resume ------------------------------------------------------------------
def test_resume_after_stop_gives_identical_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    cfg = toy(4, "privacy.mechanism=igpp", "privacy.epsilon=4")
    full = run_experiment(cfg, out=tmp_path / "a")
    run_dir = run_stopped_in_round(cfg, 3, tmp_path / "b", monkeypatch)
    resumed = resume_experiment(run_dir)
    assert comparable(resumed.summary) == comparable(full.summary)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "state",
    [(), ("federation.execution=batched", "run.client_state=disk")],
    ids=["in-memory", "offloaded"],
)
def test_sigkill_then_resume_is_identical(tmp_path: Path, state: tuple[str, ...]) -> None:
    cfg = toy(40, "privacy.mechanism=igpp", "privacy.epsilon=4", "method.params.lam=0.5", *state)
    reference = run_experiment(cfg, out=tmp_path / "ref")
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(cfg.to_yaml())
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "protofl.cli", "run", str(cfg_path), "--quiet", "--out", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    kill_after = int(torch.randint(3, 15, (1,), generator=torch.Generator().manual_seed(7)))
    deadline = time.time() + 120
    metrics = None
    while time.time() < deadline and proc.poll() is None:
        found = list(out.glob("*/metrics.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= kill_after:
            metrics = found[0]
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert metrics is not None, "the run finished or stalled before it could be killed"
    run_dir = metrics.parent
    assert not (run_dir / "summary.json").exists()
    resumed = resume_experiment(run_dir)
    assert comparable(resumed.summary) == comparable(reference.summary)


def test_an_offloaded_dcr_run_stopped_mid_way_resumes_to_the_same_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run.client_state=disk with DCR (vpdr): the resumed run's rounds are trained from the
    checkpoint's teachers and step counters (not the store's fresh ones), so its final
    checkpoint (models, teachers, DCR steps, optimizer moments, RNG states, ledgers) equals an
    uninterrupted run's bitwise."""
    cfg = toy(
        4,
        "privacy.mechanism=vpdr",
        "privacy.epsilon=4",
        "federation.execution=batched",
        "run.client_state=disk",
        "data.clients_per_domain=2",
        "federation.participation=0.5",
    )
    assert cfg.privacy.use_dcr
    full = run_experiment(cfg, out=tmp_path / "full")
    run_dir = run_stopped_in_round(cfg, 3, tmp_path / "stopped", monkeypatch)
    stopped = load_latest_checkpoint(run_dir)
    assert stopped is not None and stopped["round"] == 2  # rounds 3 and 4 train after resuming
    resumed = resume_experiment(run_dir)
    assert comparable(resumed.summary) == comparable(full.summary)
    ours, theirs = load_latest_checkpoint(run_dir), load_latest_checkpoint(full.run_dir)
    assert ours is not None and theirs is not None and ours["round"] == theirs["round"] == 4
    assert any(c["dcr"]["steps"] > 0 for c in ours["clients"])  # DCR trained
    assert checkpoint_differences(ours, theirs) == []


def test_corrupt_checkpoint_falls_back_to_previous(tmp_path: Path) -> None:
    result = run_experiment(toy(3, "federation.keep_checkpoints=2"), out=tmp_path)
    index = json.loads((result.run_dir / "checkpoints.json").read_text())
    assert [e["round"] for e in index] == [2, 3]
    newest = result.run_dir / index[-1]["file"]
    newest.write_bytes(newest.read_bytes()[:-100] + b"x" * 100)
    state = load_latest_checkpoint(result.run_dir)
    assert state is not None and state["round"] == 2
    older = result.run_dir / index[0]["file"]
    older.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="integrity"):
        load_latest_checkpoint(result.run_dir)


def test_resume_refuses_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.yaml"):
        resume_experiment(tmp_path)


# ----- upload validation ----------------------------------------------------------------------
GOOD = Upload(0, 0, release(torch.ones(2, 4) * 0.1, [0, 1], [3, 2]), 5)


def check(upload: object, bound: float | None = 10.0) -> str | None:
    return validate_upload(
        upload, declared_domain=0, num_classes=3, dim=4, norm_bound=lambda n: bound
    )


def test_valid_upload_passes() -> None:
    assert check(GOOD) is None


@pytest.mark.parametrize(
    ("upload", "needle"),
    [
        (Upload(0, 0, release(torch.ones(2, 5), [0, 1], [3, 2]), 5), "shape"),
        (Upload(0, 0, release(torch.full((2, 4), float("nan")), [0, 1], [3, 2]), 5), "NaN"),
        (Upload(0, 0, release(torch.ones(2, 4), [0, 7], [3, 2]), 5), "class ids"),
        (Upload(0, 0, release(torch.ones(2, 4), [0, -1], [3, 2]), 5), "class ids"),
        (Upload(0, 0, release(torch.ones(2, 4), [0, 1], [3, 9]), 5), "counts sum"),
        (Upload(0, 0, release(torch.ones(2, 4), [0, 1], [0, 2]), 5), "fewer than one"),
        (Upload(0, 2, release(torch.ones(2, 4), [0, 1], [3, 2]), 5), "domain"),
        (Upload(0, 0, release(torch.ones(2, 4) * 100, [0, 1], [3, 2]), 5), "impossible"),
        ("not an upload", "not an Upload"),
    ],
)
def test_each_malformed_upload_kind_is_rejected_with_a_reason(upload: object, needle: str) -> None:
    reason = check(upload)
    assert reason is not None and needle in reason


def test_engine_rejects_hostile_upload_and_keeps_going(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from protofl.engine import simulation

    original = simulation.Simulation.collect_uploads

    def poisoned(self: simulation.Simulation, active: object = None) -> list[Upload]:
        ups = original(self, active)  # type: ignore[arg-type]
        r = ups[0].release
        assert r is not None
        r.prototypes = torch.full_like(r.prototypes, float("inf"))
        return ups

    monkeypatch.setattr(simulation.Simulation, "collect_uploads", poisoned)
    result = run_experiment(toy(2), out=tmp_path)
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["rejected"] == [{"client": "red", "reason": "prototypes hold NaN or inf"}]
    assert result.summary["avg_acc"] > 0.25


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    k=st.integers(0, 4),
    dim=st.sampled_from([3, 4, 5]),
    values=st.sampled_from([0.1, -0.2, 1e9, float("nan"), float("inf")]),
    classes=st.lists(st.integers(-2, 5), min_size=0, max_size=5),
    counts=st.lists(st.integers(-1, 6), min_size=0, max_size=5),
    domain=st.integers(-1, 2),
    num_samples=st.integers(-1, 12),
    float_classes=st.booleans(),
)
def test_fuzz_validation_never_raises_and_never_accepts_invalid(
    k: int,
    dim: int,
    values: float,
    classes: list[int],
    counts: list[int],
    domain: int,
    num_samples: int,
    float_classes: bool,
) -> None:
    protos = torch.full((k, dim), values)
    cls = torch.tensor(classes, dtype=torch.float32 if float_classes else torch.long)
    cnt = torch.tensor(counts, dtype=torch.long)
    try:
        rel = Release(protos, cls, cnt, torch.zeros(len(classes)), torch.zeros(k, dim), "igpp")
    except (ValueError, RuntimeError):
        return  # the Release constructor already refuses the shape mismatch
    up = Upload(0, domain, rel, num_samples)
    reason = check(up)
    valid = (
        dim == 4
        and domain == 0
        and num_samples >= 0
        and len(classes) == k
        and len(counts) == k
        and not float_classes
        and (abs(values) < 10 or k == 0)
        and all(0 <= c < 3 for c in classes)
        and all(c >= 1 for c in counts)
        and sum(counts) <= num_samples
    )
    assert (reason is None) == valid, reason


# ----- robust aggregation ---------------------------------------------------------------------
def test_median_and_trimmed_mean_resist_one_poisoning_client() -> None:
    honest = [torch.tensor([[1.0, 1.0]]) + 0.1 * i for i in range(3)]
    poison = torch.tensor([[1000.0, -1000.0]])
    ups = [Upload(i, i, release(p, [0], [10]), 10) for i, p in enumerate([*honest, poison])]
    mean = create_method("fedproto", {}, num_classes=1, num_domains=4, proto_dim=2)
    assert mean.aggregate(ups, 0)["prototypes"].abs().max() > 100
    for rule in ("median", "trimmed_mean"):
        m = create_method(
            "fedproto", {"aggregation": rule}, num_classes=1, num_domains=4, proto_dim=2
        )
        g = m.aggregate(ups, 0)["prototypes"]
        assert torch.allclose(g, torch.tensor([[1.15, 1.05]]), atol=1e-5), (rule, g)


# ----- dropout and participation --------------------------------------------------------------
def test_dropout_charges_only_clients_that_released(tmp_path: Path) -> None:
    cfg = toy(
        6, "privacy.mechanism=igpp", "federation.dropout=0.5", "federation.participation=0.75"
    )
    result = run_experiment(cfg, out=tmp_path)
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    released = {
        c: sum(c in r["participants"] for r in rows) for c in ("red", "green", "blue", "grey")
    }
    assert all(len(r["participants"]) <= 3 for r in rows)
    assert 0 < sum(released.values()) < 6 * 4
    state = load_latest_checkpoint(result.run_dir)
    assert state is not None
    for name, client in zip(result.summary["clients"], state["clients"]):
        assert len(client["ledger"]["entries"]) == released[name]
    eps = result.summary["privacy"]["epsilon_spent"]
    never = [c for c, n in released.items() if n == 0]
    for c in never:
        assert eps[c] == 0.0


# ----- input-data faults ----------------------------------------------------------------------
def test_labels_outside_the_class_range_fail_naming_the_domain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from protofl.data import toy as toy_module

    original = toy_module.make_toy

    def broken(**kwargs: object) -> object:
        ds = original(**kwargs)  # type: ignore[arg-type]
        ds.domains[1].train.labels[0] = 99
        return ds

    monkeypatch.setattr(toy_module, "make_toy", broken)
    with pytest.raises(ValueError, match=r"domain 'green', train split: 1 labels outside 0\.\.3"):
        run_experiment(toy(1), out=tmp_path)


def test_nan_features_from_a_backbone_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from protofl.models.backbones import PixelProjection

    monkeypatch.setattr(
        PixelProjection, "encode_batch", lambda self, x: torch.full((len(x), 256), float("nan"))
    )
    with pytest.raises(ValueError, match="non-finite features"):
        run_experiment(toy(1), out=tmp_path)


def test_configured_poisoning_client_is_resisted_by_the_median(tmp_path: Path) -> None:
    base = toy(2, "federation.poison={red: 50.0}")
    plain = run_experiment(base, out=tmp_path)
    robust = run_experiment(base.with_overrides(["method.params.aggregation=median"]), out=tmp_path)
    import torch as _torch

    g_plain = _torch.load(plain.run_dir / "artifacts.pt", weights_only=True)["global_state"]
    g_robust = _torch.load(robust.run_dir / "artifacts.pt", weights_only=True)["global_state"]
    assert g_plain["prototypes"].norm() > 5 * g_robust["prototypes"].norm()
    with pytest.raises(ValueError, match="unknown client"):
        run_experiment(toy(1, "federation.poison={nobody: 1.0}"), out=tmp_path)


def test_checkpoint_every_k_rounds_resumes_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    cfg = toy(
        5,
        "privacy.mechanism=igpp",
        "privacy.epsilon=4",
        "federation.checkpoint_every=2",
        "federation.keep_checkpoints=2",
    )
    full = run_experiment(cfg, out=tmp_path / "a")
    saved = sorted(p.name for p in full.run_dir.glob("checkpoint-*.pt"))
    assert saved == ["checkpoint-0004.pt", "checkpoint-0005.pt"]  # every 2nd and the last
    run_dir = run_stopped_in_round(cfg, 4, tmp_path / "b", monkeypatch)
    assert [p.name for p in run_dir.glob("checkpoint-*.pt")] == ["checkpoint-0002.pt"]
    resumed = resume_experiment(run_dir)  # redoes round 3, then 4 and 5
    assert comparable(resumed.summary) == comparable(full.summary)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [1, 2, 3, 4, 5]
    with pytest.raises(ConfigError, match=r"federation\.checkpoint_every"):
        toy(2, "federation.checkpoint_every=0")
