"""run.client_state=disk: the clients' method state lives in the mapped store too, and the
memory budget is checked before anything is built (review of issue 19, sections 5 and 8)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from protofl.engine import batched, store
from protofl.engine.batched import BatchedTrainer
from protofl.engine.simulation import Simulation
from protofl.methods.base import ClientState
from tests.engine.helpers import checkpoint_differences, run_stopped_in_round
from tests.engine.test_batched import _data, _offload_config

# methods whose clients keep ClientState tensors between rounds (MOON: two model copies,
# FedProx and FedGA: one, FedRDN: input statistics and a step count, COPA: its index, FedPCL:
# local prototypes whose number of rows is the client's number of classes)
METHODS = {
    "moon": [],
    "fedprox": [],
    "fedga": [],
    "fedrdn": [],
    "copa": [],
    "fedpcl": ["method.params.eval=prototype"],
}


def _method_config(state: str, method: str, *extra: str) -> Any:
    return _offload_config(
        state, f"method.name={method}", *METHODS[method], "run.save_releases=false", *extra
    )


def _last_checkpoint(run_dir: Path) -> tuple[Path, dict[str, Any]]:
    index = json.loads((run_dir / "checkpoints.json").read_text())
    path = run_dir / index[-1]["file"]
    return path, torch.load(path, weights_only=True)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_offloaded_method_state_gives_the_in_memory_run_bit_for_bit(
    tmp_path: Path, method: str
) -> None:
    """The whole last checkpoint (every client's model, optimizer, method state, ledger,
    generators, the history) of a run with its state on disk equals the in-memory run's,
    bitwise, with partial participation (clients with and without method state)."""
    from protofl.engine.runner import STATE_DIR, run_experiment

    runs = {}
    for state in ("memory", "disk"):
        cfg = _method_config(state, method)
        runs[state] = run_experiment(cfg, out=tmp_path / state, data=_data(cfg))
    drop = ("wall_s", "setup_s", "environment")
    same = [{k: v for k, v in r.summary.items() if k not in drop} for r in runs.values()]
    assert same[0] == same[1]
    _, memory = _last_checkpoint(runs["memory"].run_dir)
    _, disk = _last_checkpoint(runs["disk"].run_dir)
    assert any(c["state"] for c in memory["clients"]), "the method kept no client state"
    assert checkpoint_differences(memory, disk) == []
    assert not (runs["disk"].run_dir / STATE_DIR).exists()


def _file_mappings() -> list[tuple[int, int, str]]:
    """This process's file mappings: (start, end, path), from /proc."""
    out = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/"):
                a, b = (int(x, 16) for x in parts[0].split("-"))
                out.append((a, b, parts[5].strip()))
    return out


def _assert_in_mapped_files(sim: Simulation, state_dir: Path) -> None:
    """Every client's method-state tensor lies in a file mapping under ``state_dir`` (none on
    the heap), each its client's own bytes."""
    maps = [(a, b) for a, b, p in _file_mappings() if Path(p).parent == state_dir]
    starts: set[int] = set()
    for c in sim.clients:
        for key, t in c.state.tensors.items():
            ptr = t.data_ptr()
            assert any(a <= ptr and ptr + t.numel() * t.element_size() <= b for a, b in maps), (
                f"{c.data.name}: {key} is on the heap"
            )
            assert ptr not in starts
            starts.add(ptr)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux")
@pytest.mark.parametrize("method", ["moon", "fedprox"])
def test_method_state_of_clients_between_rounds_is_in_the_mapped_files(
    tmp_path: Path, method: str
) -> None:
    """After the rounds, every client's method-state tensor (of those that sat out the last
    round too) lies in a file mapping under the run's client-state folder, none on the heap;
    so after a simulation has loaded a checkpoint."""
    cfg = _method_config("disk", method, "federation.rounds=2")
    state_dir = tmp_path / "state"
    sim = Simulation(cfg, _data(cfg), state_dir=state_dir)
    sim.run()
    last = set(sim.history[-1].participants)
    idle = [c for c in sim.clients if c.data.name not in last and c.state.tensors]
    assert idle, "no client with method state sat out the last round"
    _assert_in_mapped_files(sim, state_dir)
    assert sorted(p.name for p in state_dir.glob("state.*"))  # one file per key
    again = Simulation(cfg, _data(cfg), state_dir=tmp_path / "again")
    again.load_state_dict(sim.state_dict())
    assert sum(bool(c.state.tensors) for c in again.clients) >= len(idle)
    _assert_in_mapped_files(again, tmp_path / "again")


def test_a_key_whose_shape_differs_across_clients_stays_on_the_heap(tmp_path: Path) -> None:
    """A key's file is shaped by its first value; once a value of another shape or dtype
    comes (FedPCL's local prototypes: one row per class the client holds) the key's values
    stay on the heap as they are, as do empty values and values that need a gradient (and a
    view of the parameters stays that view); adopting a row already in place writes nothing."""
    cfg = _method_config("disk", "fedpcl")
    sim = Simulation(cfg, _data(cfg), state_dir=tmp_path / "state")
    store = sim.batched.store
    a, b, c = sim.clients[:3]
    a.state = ClientState({"p": torch.ones(3, 2), "k": torch.arange(3), "e": torch.zeros(0, 2)})
    grad = torch.ones(2, requires_grad=True)
    b.state = ClientState(
        {"p": torch.ones(2, 2), "k": torch.arange(3.0), "e": torch.zeros(0, 2), "g": grad}
    )
    # a view of the client's own parameters is mapped already, and stays that view
    c.state = ClientState(
        {"p": torch.ones(3, 2), "k": torch.arange(3), "w": c.model.head.weight.detach()}
    )
    assert store.adopt_state(a) == 3 * 2 * 4 + 3 * 8
    for other in (b, c):
        kept = dict(other.state.tensors)
        assert store.adopt_state(other) == 0
        assert all(other.state.tensors[k] is kept[k] for k in kept)  # on the heap, untouched
    assert store.ragged == {"p", "k"} and set(store.state) == {"p", "k"}
    assert c.state.tensors["w"].data_ptr() == c.model.head.weight.data_ptr()
    ra = store.row[a.data.client]
    assert a.state.tensors["p"].data_ptr() == store.state["p"][ra].data_ptr()
    assert torch.equal(store.state["k"][ra], torch.arange(3))
    assert store.adopt_state(a) == 0


def test_moon_on_disk_stopped_and_resumed_ends_bitwise_as_the_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MOON's two model copies per client are in the mapped files: stopped after round 1 (half
    of the clients hold method state: the checkpoint gathers their rows) and resumed, the
    final checkpoint equals the uninterrupted run's, bitwise."""
    from protofl.engine.runner import resume_experiment, run_experiment

    cfg = _method_config("disk", "moon")
    full = run_experiment(cfg, out=tmp_path / "full", data=_data(cfg))
    run_dir = run_stopped_in_round(cfg, 2, tmp_path / "stopped", monkeypatch, data=_data(cfg))
    _, saved = _last_checkpoint(run_dir)
    assert saved["round"] == 1
    holders = [bool(c["state"]) for c in saved["clients"]]
    assert any(holders) and not all(holders)
    resumed = resume_experiment(run_dir)
    assert resumed.summary["avg_acc"] == full.summary["avg_acc"]
    assert (
        checkpoint_differences(_last_checkpoint(full.run_dir)[1], _last_checkpoint(run_dir)[1])
        == []
    )


def test_an_offloaded_checkpoint_is_no_larger_than_the_in_memory_one(tmp_path: Path) -> None:
    """``torch.save`` of a view writes its whole storage: after one round at half
    participation, a checkpoint saving MOON's state as views of its mapped files would hold
    every client's rows; it holds only the participants', as the in-memory run's does."""
    from protofl.engine.runner import run_experiment

    sizes = {}
    for state in ("memory", "disk"):
        cfg = _method_config(state, "moon", "federation.rounds=1")
        run = run_experiment(cfg, out=tmp_path / state, data=_data(cfg))
        path, saved = _last_checkpoint(run.run_dir)
        holders = [bool(c["state"]) for c in saved["clients"]]
        assert any(holders) and not all(holders)
        sizes[state] = path.stat().st_size
    assert sizes["disk"] <= sizes["memory"]


# --------------------------------------------------------------------------------------------
# run.memory_budget_mb
# --------------------------------------------------------------------------------------------
BUDGET_ERROR = (
    r"^run\.memory_budget_mb=1 cannot hold one group of batched clients: client '[^']+' alone "
    r"needs \d+ MB \(raise run\.memory_budget_mb to at least that\)$"
)


def test_a_refused_budget_on_disk_builds_one_client_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget is checked from the first model's shapes and the clients' data before the
    store is made: no mapped file, no client-state folder, one client built (not all)."""
    from protofl.engine import simulation
    from protofl.engine.runner import STATE_DIR, run_experiment

    mapped: list[Path] = []
    make = store.mapped_tensor
    monkeypatch.setattr(
        store, "mapped_tensor", lambda path, *a, **k: mapped.append(path) or make(path, *a, **k)
    )
    copies = []
    copy = simulation.copy_client_model
    monkeypatch.setattr(simulation, "copy_client_model", lambda m: copies.append(1) or copy(m))
    cfg = _offload_config("disk", "run.memory_budget_mb=1", "backbone.adapter_hidden=4096")
    with pytest.raises(ValueError, match=BUDGET_ERROR) as err:
        run_experiment(cfg, out=tmp_path, data=_data(cfg))
    assert "\n" not in str(err.value)
    assert mapped == []
    assert not list(tmp_path.rglob(STATE_DIR))
    assert len(copies) <= 1


@pytest.mark.parametrize("state", ["memory", "disk"])
def test_a_budget_the_user_set_is_refused_the_default_never_in_both_modes(
    state: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run.memory_budget_mb`` set below one client's need is refused with the same error in
    memory as on disk (on disk when the simulation is built, in memory before its first round
    trains, leaving the models untouched); the default budget cuts the groups but never refuses
    a run: a client that needs more trains in a group of its own."""
    monkeypatch.setattr(batched, "DEFAULT_MEMORY_BUDGET", 2**20)
    cfg = _offload_config(state, "backbone.adapter_hidden=4096", "run.memory_budget_mb=1")
    with pytest.raises(ValueError, match=BUDGET_ERROR):
        sim = Simulation(cfg, _data(cfg))
        before = [c.model.head.weight.clone() for c in sim.clients]
        try:
            sim.run(1)
        finally:
            assert sim.round == 0
            assert all(torch.equal(b, c.model.head.weight) for b, c in zip(before, sim.clients))
    default = _offload_config(state, "backbone.adapter_hidden=4096")
    assert default.run.memory_budget_mb is None
    sim = Simulation(default, _data(default))
    trainer = sim.batched_trainer()
    assert isinstance(trainer, BatchedTrainer)
    assert min(trainer._bytes_per_client(c) for c in sim.clients) > 2**20
    assert [len(g.clients) for g in trainer.groups(sim.clients)] == [1] * len(sim.clients)
    sim.run(1)
    assert sim.round == 1


def test_the_budget_cuts_the_same_groups_in_both_modes(tmp_path: Path) -> None:
    """The budget cuts the groups, and the cut is the same in memory and on disk: every group
    within the budget (of several clients where they fit)."""
    cuts = {}
    for state in ("memory", "disk"):
        cfg = _offload_config(state, "run.memory_budget_mb=1")
        sim = Simulation(cfg, _data(cfg), state_dir=tmp_path / state)
        trainer = sim.batched_trainer()
        assert isinstance(trainer, BatchedTrainer)
        groups = trainer.groups(sim.clients)
        for g in groups:
            assert sum(trainer._bytes_per_client(c) for c in g.clients) <= 2**20
        cuts[state] = [[c.data.name for c in g.clients] for g in groups]
    assert cuts["memory"] == cuts["disk"]
    assert len(cuts["memory"]) > 1 and max(len(g) for g in cuts["memory"]) > 1


def test_a_rounds_wall_time_includes_moving_its_state_to_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The method state's copy into the mapped files and the page-out are part of the round:
    its metrics (wall_s) are made after them (before 2026-12-04, after: MOON's 1000-client
    rounds under-reported by 2 s each)."""
    from protofl.engine import round as round_sequence

    calls: list[str] = []
    for name in ("offload_state", "page_out"):
        original = getattr(Simulation, name)

        def traced(self: Simulation, *a: Any, _name: str = name, _f: Any = original) -> Any:
            calls.append(_name)
            return _f(self, *a)

        monkeypatch.setattr(Simulation, name, traced)
    metrics = round_sequence.round_metrics  # called by run_round, the round sequence
    monkeypatch.setattr(
        round_sequence, "round_metrics", lambda **kw: calls.append("metrics") or metrics(**kw)
    )
    cfg = _method_config("disk", "moon")
    sim = Simulation(cfg, _data(cfg), state_dir=tmp_path)
    calls.clear()
    sim.run_round()
    assert calls == ["offload_state", "page_out", "metrics"]
