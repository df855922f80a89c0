"""Fused runs: several runs that differ only in seed, privacy settings or clip radius, executed
as one batched program.

A sweep's runs that share data set, backbone, method and federation settings train models of
the same shapes with the same optimiser, so their clients can be stacked into ONE
:class:`~protofl.engine.batched.BatchedTrainer` store: one fused program trains, evaluates and
computes the upload features of the clients of every run together (the same mnist client of six
runs is one ``[6, ...]`` batched product per step instead of six).  What stays each run's own:

* its :class:`~protofl.engine.simulation.Simulation` (data split, model init, generators: built
  from its own config exactly as alone), its server step (participants, mechanism, noise
  streams, ledgers, validation, aggregation, global state), its method state;
* its local objective's per-round inputs: the loss of a fused step is computed per run segment
  of the group (``LocalObjective.prepare`` with that run's global state and clients);
* its run folder, written by the same :class:`~protofl.engine.runner.RunSession` as a single run
  (metrics.jsonl, checkpoints, summary.json, run.log), so a fused run's folder is a normal run
  folder: it resumes fused or alone.

The runs step in lockstep by round number (a run resumed from an earlier round catches up
first, in rounds of its own).  Results equal running them one by one to float rounding (the
batched products sum in a different grouping), as the batched executor does against the
sequential one.

:func:`fusion_key` says which configs may fuse; :func:`fusion_problem` checks built simulations
(shapes, optimiser, DCR, method) and gives the reason they cannot; :func:`run_fused` runs a group
or raises :class:`FusionUnavailable` with that reason before any round has run.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from protofl.config import ExperimentConfig
from protofl.engine.batched import BatchedTrainer
from protofl.engine.round import RoundMetrics, run_round
from protofl.engine.runner import RunResult, RunSession, log_scope, prepare_run_dir
from protofl.engine.simulation import Client, Simulation
from protofl.methods.objectives import GlobalState, Group, InputTransform, LocalObjective, Step

log = logging.getLogger(__name__)

PRIVACY_TRAINING_KEYS = (
    "dcr_gamma",
    "dcr_beta",
    "dcr_tau",
    "dcr_weight",
    "dcr_soft_clip",
    "dcr_warmup_steps",
)
"""The privacy settings that change local training when DCR is on (``privacy.dcr``, or the
``vpdr`` mechanism), which the runs of a group must share; without DCR no privacy setting
touches training.  DCR's soft clip also trains with ``privacy.clip``, but the batched trainer
takes each client's own radius, so runs that differ in it fuse."""


class FusionUnavailable(RuntimeError):
    """A group of runs cannot be fused; ``str(exc)`` says why (they run one by one)."""


def fusion_key(config: ExperimentConfig) -> str | None:
    """Configs with equal keys may run fused; None: this config never fuses (not batched, or
    not run by the in-process engine: ``run.engine`` other than ``sim``).

    The key is the whole config except ``name``, ``seed`` and the privacy settings (mechanism,
    epsilon, delta, clip, noise seed, accountant, ...), which only the server step and the
    releases read; with DCR on, the DCR settings stay in (they train; the soft clip's radius
    ``privacy.clip`` is taken per client, so it may differ).
    """
    if config.federation.execution != "batched" or config.run.engine != "sim":
        return None
    data = config.to_dict()
    data.pop("name", None)
    data.pop("seed", None)
    privacy = data.pop("privacy", {})
    kept: dict[str, Any] = {"dcr": config.privacy.use_dcr}
    if config.privacy.use_dcr:
        kept.update({k: privacy.get(k) for k in PRIVACY_TRAINING_KEYS})
    data["privacy"] = kept
    data.get("run", {}).pop("progress", None)
    return json.dumps(data, sort_keys=True, default=str)


# --------------------------------------------------------------------------------------------
# the fused trainer
# --------------------------------------------------------------------------------------------
class _RunObjective:
    """The method's :class:`LocalObjective`, prepared and evaluated per run segment of a group.

    A fused group holds clients of several runs; each run's terms are prepared with that run's
    global state (its prototype table) and its clients' method states, and each piece of a step
    is split into its runs' rows (``feature_loss``, ``param_loss``)."""

    def __init__(self, base: LocalObjective, trainer: FusedTrainer) -> None:
        self.base = base
        self.trainer = trainer

    @property
    def terms(self) -> tuple[Any, ...]:
        return self.base.terms

    @property
    def feature_terms(self) -> tuple[Any, ...]:
        return self.base.feature_terms

    @property
    def param_terms(self) -> tuple[Any, ...]:
        return self.base.param_terms

    @property
    def ce_weight(self) -> float:
        return self.base.ce_weight

    @property
    def inputs(self) -> _RunInputs | None:
        return None if self.base.inputs is None else _RunInputs(self.base.inputs, self)

    def prepare_with(self, group: Group, prepare: Callable[..., Any]) -> _Prepared:
        """``prepare(run, global state, group)`` (the objective's, or a run's input
        transform's) per run of ``group``, with that run's global state and its clients' ids."""
        runs = [self.trainer.run_of_state(s) for s in group.states]
        members: dict[int, list[int]] = {}
        for pos, r in enumerate(runs):
            members.setdefault(r, []).append(pos)
        local = [0] * len(runs)
        per_run: dict[int, Any] = {}
        for r, positions in members.items():
            for i, pos in enumerate(positions):
                local[pos] = i
            per_run[r] = prepare(
                r,
                self.trainer.sims[r].global_state,
                Group(
                    [group.states[p] for p in positions],
                    [group.domains[p] for p in positions],
                    group.num_classes,
                    [self.trainer.owner(group.states[p])[1] for p in positions],
                ),
            )
        return _Prepared(runs=runs, local=local, per_run=per_run)

    def prepare(self, global_state: GlobalState, group: Group) -> _Prepared:
        return self.prepare_with(group, lambda r, gs, g: self.base.prepare(gs, g))

    def _split(self, prepared: _Prepared, rows: slice) -> list[tuple[int, list[int], slice]]:
        """The runs of rows ``rows`` of the group: (run, positions within the rows, the run's
        own rows in its prepared inputs)."""
        start = rows.start or 0
        runs = prepared.runs[start : rows.stop]
        out: dict[int, list[int]] = {}
        for i, r in enumerate(runs):
            out.setdefault(r, []).append(i)
        parts = []
        for r, idx in out.items():
            first = prepared.local[start + idx[0]]
            parts.append((r, idx, slice(first, first + len(idx))))
        return parts

    def per_run(
        self,
        prepared: _Prepared,
        rows: slice,
        device: torch.device,
        fn: Callable[[int, torch.Tensor | None, Any, slice], torch.Tensor],
    ) -> torch.Tensor:
        """``fn(run, positions, run's prepared inputs, run's rows)`` on each run's segment of
        rows ``rows`` (positions None: all of them), reassembled in row order along dim 0."""
        parts = self._split(prepared, rows)
        if len(parts) == 1:
            r, _, own = parts[0]
            return fn(r, None, prepared.per_run[r], own)
        outs, order = [], []
        for r, idx, own in parts:
            outs.append(fn(r, torch.tensor(idx, device=device), prepared.per_run[r], own))
            order += idx
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(len(order))
        return torch.cat(outs)[back.to(outs[0].device)]

    def feature_loss(self, step: Step, prepared: _Prepared, rows: slice) -> torch.Tensor:
        return self.per_run(
            prepared,
            rows,
            step.f.device,
            lambda r, at, prep, own: self.base.feature_loss(
                step if at is None else step.select(at), prep, own
            ),
        )

    def uses_logits(self, step: Step, prepared: _Prepared, rows: slice) -> torch.Tensor | None:
        if self.base.ce_weight != 0:
            return None  # a cross-entropy: every client's loss reaches the head

        def used(r: int, at: torch.Tensor | None, prep: Any, own: slice) -> torch.Tensor:
            sub = step if at is None else step.select(at)
            out = self.base.uses_logits(sub, prep, own)
            return torch.ones(sub.y.shape[0], dtype=torch.bool) if out is None else out

        return self.per_run(prepared, rows, step.f.device, used)

    def param_loss(
        self, params: Mapping[str, torch.Tensor], prepared: _Prepared, rows: slice, k: int
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        parts = self._split(prepared, rows)
        if len(parts) == 1:
            r, _, own = parts[0]
            return self.base.param_loss(params, prepared.per_run[r], own, k)
        value = torch.zeros(k)
        grads: dict[str, torch.Tensor] = {}
        any_value = False
        for r, idx, own in parts:
            at = torch.tensor(idx, device=next(iter(params.values())).device)
            sub = {n: p.index_select(0, at) for n, p in params.items()}
            v, g = self.base.param_loss(sub, prepared.per_run[r], own, len(idx))
            if v is not None:
                any_value = True
                value = value.to(v.device).index_copy(0, at, v)
            for n, gn in g.items():
                if n not in grads:
                    grads[n] = torch.zeros_like(params[n])
                grads[n].index_copy_(0, at, gn)
        return (value if any_value else None), grads


class _RunInputs:
    """The objective's input transform, each run's own (its seed keys its draws), prepared and
    applied per run segment of a group."""

    def __init__(self, base: Any, objective: _RunObjective) -> None:
        self.base = base
        self.objective = objective
        self.of_run: list[InputTransform] = []
        for sim in objective.trainer.sims:
            own = sim.method.objective()
            if own is None or own.inputs is None:
                raise ValueError(f"fused runs disagree on {sim.method.name}'s input transform")
            self.of_run.append(own.inputs)

    def prepare(self, global_state: GlobalState, group: Group) -> _Prepared:
        return self.objective.prepare_with(group, lambda r, gs, g: self.of_run[r].prepare(gs, g))

    def train(
        self, z: torch.Tensor, ok: torch.Tensor, prepared: _Prepared, rows: slice, step: int
    ) -> torch.Tensor:
        def one(r: int, at: torch.Tensor | None, prep: Any, own: slice) -> torch.Tensor:
            if at is not None:
                return self.of_run[r].train(
                    z.index_select(0, at), ok.index_select(0, at), prep, own, step
                )
            return self.of_run[r].train(z, ok, prep, own, step)

        return self.objective.per_run(prepared, rows, z.device, one)

    def finish(self, prepared: _Prepared, steps: Sequence[int]) -> None:
        per: dict[int, list[int]] = {}
        for r, n in zip(prepared.runs, steps, strict=True):
            per.setdefault(r, []).append(int(n))
        for r, run_steps in per.items():
            self.of_run[r].finish(prepared.per_run[r], run_steps)

    def evaluate(
        self, z: torch.Tensor, global_state: GlobalState, states: Sequence[Any]
    ) -> torch.Tensor | None:
        runs = {self.objective.trainer.run_of_state(s) for s in states}
        if len(runs) != 1:  # evaluate_runs predicts each run's clients on their own
            raise ValueError("fused evaluation mixed the clients of several runs")
        return self.of_run[runs.pop()].evaluate(z, global_state, states)


@dataclass
class _Prepared:
    runs: list[int]  # the run of every group position
    local: list[int]  # each position's index among its run's clients in the group
    per_run: dict[int, Any]


class _Methods:
    """What the trainer asks of "its" method, dispatched to the method of each client's run."""

    def __init__(self, trainer: FusedTrainer) -> None:
        self._trainer = trainer
        self._first = trainer.sims[0].method

    def __getattr__(self, name: str) -> Any:
        return getattr(self._first, name)

    def objective(self) -> _RunObjective | None:
        base = self._first.objective()
        return None if base is None else _RunObjective(base, self._trainer)

    def begin_local(self, model: Any, state: Any, global_state: Any, client: int) -> None:
        r, cid = self._trainer.owner(state)
        sim = self._trainer.sims[r]
        sim.method.begin_local(model, state, sim.global_state, cid)

    def end_local(self, model: Any, state: Any, global_state: Any, client: int) -> None:
        r, cid = self._trainer.owner(state)
        sim = self._trainer.sims[r]
        sim.method.end_local(model, state, sim.global_state, cid)

    def after_training(self, state: Any, f: torch.Tensor, y: torch.Tensor) -> None:
        r, _ = self._trainer.owner(state)
        self._trainer.sims[r].method.after_training(state, f, y)


class _FusedView:
    """What :class:`BatchedTrainer` reads of its simulation, over the clients of every run:
    the shared settings are the first run's (equal in all, :func:`fusion_problem`); the clients
    are stand-ins with fused ids; the global state is set per run where one is read."""

    def __init__(self, trainer: FusedTrainer, clients: list[Client]) -> None:
        self._first = trainer.sims[0]
        self.clients = clients
        self.method = _Methods(trainer)
        self.global_state: GlobalState = {}
        # the first run's data facts (equal in all) over every run's stand-in clients
        self.data = replace(self._first.data, clients=[c.data for c in clients])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._first, name)


class FusedTrainer(BatchedTrainer):
    """One batched store and program for the clients of several simulations.

    The trainer sees a stand-in for every client (the same model, optimiser, state, generators
    and DCR objects; a fused id; one stand-in test set per domain, which orders the rows), and
    equal test sets of several runs are predicted together.  ``train_runs``, ``features_runs`` and
    ``evaluate_runs`` take and give per-run lists."""

    def __init__(self, sims: Sequence[Simulation], labels: Sequence[str] | None = None) -> None:
        self.sims = list(sims)
        self.labels = list(labels) if labels is not None else [str(i) for i in range(len(sims))]
        # each run's folder, whose run.log receives the lines of its server step (run_fused)
        self.run_dirs: list[Path | None] = [None] * len(self.sims)
        self._owner: dict[int, tuple[int, int]] = {}
        self._stand_in: dict[tuple[int, int], Client] = {}
        canonical: list[torch.Tensor] = []
        same: dict[int, torch.Tensor] = {}

        def one(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in same:
                match = next(
                    (
                        u
                        for u in canonical
                        if u.shape == t.shape and u.dtype == t.dtype and torch.equal(u, t)
                    ),
                    None,
                )
                if match is None:
                    canonical.append(t)
                    match = t
                same[id(t)] = match
            return same[id(t)]

        self._same = one
        # a stand-in's test set only orders the store's rows (the trainer groups clients that
        # share one); evaluation reads each run's own (evaluate_runs).  Clients of one domain
        # share a stand-in test set in every run, so equal clients of different runs train in
        # one group even where the runs' test sets differ (data.max_test_per_domain draws a
        # seeded subsample)
        by_domain: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        stand_ins: list[Client] = []
        for r, sim in enumerate(self.sims):
            for c in sim.clients:
                test_z, test_y = by_domain.setdefault(
                    (c.data.domain, c.data.domain_name), (c.data.test_z, c.data.test_y)
                )
                data = replace(
                    c.data,
                    client=len(stand_ins),
                    name=f"{self.labels[r]}/{c.data.name}",
                    test_z=test_z,
                    test_y=test_y,
                )
                proxy = replace(c, data=data)
                self._owner[id(c.state)] = (r, c.data.client)
                self._stand_in[(r, c.data.client)] = proxy
                stand_ins.append(proxy)
        # run.memory_budget_mb is part of the fusion key: every run of the group has the same
        super().__init__(
            _FusedView(self, stand_ins),  # type: ignore[arg-type]
            memory_budget=self.sims[0].memory_budget(),
        )
        if self.supported:
            # as a run alone (Simulation.batched_trainer), a budget below one client is refused:
            # the runs go one by one, and each fails with that error
            try:
                self.check_budget(stand_ins)
            except ValueError as exc:
                self.reason, self.supported = str(exc), False

    # ----- who is who --------------------------------------------------------------------------
    def owner(self, state: Any) -> tuple[int, int]:
        """(run, client id in its run) of a client's method state."""
        return self._owner[id(state)]

    def run_of_state(self, state: Any) -> int:
        """The run a client's method state belongs to."""
        return self._owner[id(state)][0]

    def stand_ins(self, r: int, clients: Sequence[Client]) -> list[Client]:
        """The trainer's stand-ins for clients of run ``r``."""
        return [self._stand_in[(r, c.data.client)] for c in clients]

    # ----- the fused steps ---------------------------------------------------------------------
    def train_runs(self, clients: Mapping[int, Sequence[Client]]) -> dict[int, list[float]]:
        """Local training of every run's participants in one batched program; per run, each
        participant's mean batch loss (as it would train alone)."""
        flat = [(r, c) for r, cs in clients.items() for c in cs]
        if not flat:
            return {r: [] for r in clients}
        losses = self.train([self._stand_in[(r, c.data.client)] for r, c in flat])
        out: dict[int, list[float]] = {r: [] for r in clients}
        for (r, _), loss in zip(flat, losses):
            out[r].append(loss)
        return out

    def features_runs(
        self, clients: Mapping[int, Sequence[Client]]
    ) -> dict[tuple[int, int], torch.Tensor]:
        """Upload features of every run's clients at once, keyed by (run, client id)."""
        flat = [(r, c) for r, cs in clients.items() for c in cs]
        if not flat:
            return {}
        feats = self.features_many([self._stand_in[(r, c.data.client)] for r, c in flat])
        return {(r, c.data.client): f for (r, c), f in zip(flat, feats)}

    def evaluate_runs(self, samples: Mapping[int, bool]) -> dict[int, dict[str, float]]:
        """:meth:`Simulation.evaluate` of every run in ``samples`` (run -> ``sample``): the
        clients of all runs that are evaluated on equal test data are predicted together
        (classifier rule; the prototype rule predicts per run, against its global state)."""
        # prototype and feature rules, and input transforms, read each run's global state
        method = self.sims[0].method
        objective = method.objective()
        per_run_rule = method.prediction() in ("prototype", "features")
        transformed = objective is not None and objective.inputs is not None
        groups: dict[tuple[int, int], list[tuple[int, Client]]] = {}
        inputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for r, sample in samples.items():
            sim = self.sims[r]
            for c in sim.clients:
                c.model.eval()
                z, y = sim.test_set(c, sample)
                z, y = self._same(z), self._same(y)
                own = transformed or (per_run_rule and bool(sim.global_state))
                key = (id(z), r if own else -1)
                groups.setdefault(key, []).append((r, c))
                inputs[key] = (z, y)
        acc: dict[tuple[int, int], float] = {}
        for key, members in groups.items():
            z, y = inputs[key]
            if len(y) == 0:
                for r, c in members:
                    acc[(r, c.data.client)] = 0.0
                continue
            self.sim.global_state = self.sims[key[1]].global_state if key[1] >= 0 else {}
            pred = self.predict_many([self._stand_in[(r, c.data.client)] for r, c in members], z)
            correct = (pred == y.unsqueeze(0)).sum(dim=1).tolist()
            for (r, c), n_ok in zip(members, correct):
                acc[(r, c.data.client)] = n_ok / len(y)
        self.sim.global_state = {}
        return {
            r: {c.data.name: acc[(r, c.data.client)] for c in self.sims[r].clients} for r in samples
        }

    def evaluate_holdout_run(self, r: int) -> float | None:
        """:meth:`Simulation.evaluate_holdout` of run ``r``."""
        sim = self.sims[r]
        if sim.data.holdout is None:
            return None
        _, z, y = sim.data.holdout
        for c in sim.clients:
            c.model.eval()
        self.sim.global_state = sim.global_state
        try:
            pred = self.predict_many(self.stand_ins(r, sim.clients), z)
        finally:
            self.sim.global_state = {}
        accs = ((pred == y.unsqueeze(0)).sum(dim=1).double() / max(len(y), 1)).tolist()
        return float(sum(accs) / len(accs))

    def detach_run(self, r: int) -> None:
        """Give run ``r``'s clients their own tensors again (out of the shared store), so what
        is saved of them (artifacts, a last checkpoint) holds only their values."""
        for c in self.sims[r].clients:
            with torch.no_grad():
                for p in c.model.parameters():
                    p.data = p.data.clone()
                for st in c.optimizer.state.values():
                    for k, v in list(st.items()):
                        if isinstance(v, torch.Tensor):
                            st[k] = v.clone()
                if c.dcr is not None:
                    for p in c.dcr.teacher.parameters():
                        p.data = p.data.clone()


class _RunTrainer:
    """Run ``r``'s view of the fused trainer, set as its ``Simulation.batched``: any path of
    the simulation that asks for its batched executor computes in the one shared store."""

    supported = True
    reason = None

    def __init__(self, trainer: FusedTrainer, r: int) -> None:
        self.trainer = trainer
        self.r = r

    def train(self, clients: Sequence[Client]) -> list[float]:
        return self.trainer.train_runs({self.r: clients})[self.r]

    def features_many(self, clients: Sequence[Client]) -> list[torch.Tensor]:
        feats = self.trainer.features_runs({self.r: clients})
        return [feats[(self.r, c.data.client)] for c in clients]

    def evaluate(self, sample: bool = False) -> dict[str, float]:
        return self.trainer.evaluate_runs({self.r: sample})[self.r]

    def evaluate_holdout(self) -> float | None:
        return self.trainer.evaluate_holdout_run(self.r)


# --------------------------------------------------------------------------------------------
# compatibility
# --------------------------------------------------------------------------------------------
def _first_difference(a: Any, b: Any, prefix: str) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            d = _first_difference(a.get(k), b.get(k), f"{prefix}.{k}")
            if d:
                return d
        return None
    return None if a == b else f"{prefix}: {a!r} vs {b!r}"


def fusion_problem(sims: Sequence[Simulation], labels: Sequence[str]) -> str | None:
    """Why these simulations cannot train as one batched program (None: they can)."""
    if len(sims) < 2:
        return "a group of one run"
    first, name0 = sims[0], labels[0]
    cfg0 = first.config.to_dict()
    for sim, name in zip(sims, labels):
        cfg = sim.config
        if cfg.federation.execution != "batched":
            return f"{name}: federation.execution={cfg.federation.execution}, not batched"
        d = cfg.to_dict()
        for section in ("federation", "backbone", "method", "data"):
            diff = _first_difference(cfg0[section], d[section], section)
            if diff:
                return f"{name0} and {name} differ in {diff}"
        for key in ("device", "amp"):
            if cfg0["run"][key] != d["run"][key]:
                return f"{name0} and {name} differ in run.{key}"
        if d["run"].get("client_state", "memory") != "memory":
            return f"{name}: run.client_state={d['run']['client_state']} is not fused"
        if sim.config.privacy.use_dcr != first.config.privacy.use_dcr:
            on, off = (name, name0) if sim.config.privacy.use_dcr else (name0, name)
            return f"DCR is on in {on} and off in {off}"
        if sim.config.privacy.use_dcr:
            for key in PRIVACY_TRAINING_KEYS:
                if cfg0["privacy"][key] != d["privacy"][key]:
                    return f"DCR trains differently: {name0} and {name} differ in privacy.{key}"
        if sim.data.num_classes != first.data.num_classes:
            return f"{name0} and {name} have different numbers of classes"
        if sim.data.feature_dim != first.data.feature_dim:
            return f"{name0} and {name} have different feature sizes"
        if sim.device != first.device:
            return f"{name0} and {name} compute on different devices"
        if not sim.method.batchable:
            return f"method {sim.method.name} cannot batch"
        if sim.method.objective() != first.method.objective():
            return f"{name0} and {name} declare different local objectives"
        if sim.method.prediction() != first.method.prediction():
            return f"{name0} and {name} evaluate by different rules"
    return None


# --------------------------------------------------------------------------------------------
# one fused round
# --------------------------------------------------------------------------------------------
def fused_round(trainer: FusedTrainer, runs: Sequence[int]) -> dict[int, RoundMetrics]:
    """One round of every run in ``runs`` (all at the same round number): the round sequence
    (:func:`protofl.engine.round.run_round`) with uploads, training and evaluation fused."""
    sims = [trainer.sims[r] for r in runs]
    return dict(zip(runs, run_round(sims, _FusedExecutor(trainer, list(runs)))))


class _FusedExecutor:
    """The client side of a fused round (:class:`~protofl.engine.round.RoundExecutor`): run
    ``i`` of the round is the trainer's run ``runs[i]``; one batched feature pass, one training
    and one evaluation for all of them."""

    def __init__(self, trainer: FusedTrainer, runs: list[int]) -> None:
        self.trainer = trainer
        self.runs = runs

    def upload(self, active: Mapping[int, list[bool]]) -> dict[int, list[Any]]:
        sims = self.trainer.sims
        chosen = {
            r: [c for c, a in zip(sims[r].clients, active[i]) if a] for i, r in enumerate(self.runs)
        }
        feature_runs = [
            r
            for r in self.runs
            if sims[r].method.uses_prototypes and sims[r].method.default_upload_features
        ]
        feats = self.trainer.features_runs({r: chosen[r] for r in feature_runs})
        uploads: dict[int, list[Any]] = {}
        for i, r in enumerate(self.runs):
            with self.scope(i):
                if r in feature_runs:
                    uploads[i] = sims[r].upload(
                        active[i],
                        lambda cs, r=r: [feats[(r, c.data.client)] for c in cs],  # type: ignore[misc]
                        vectorise=True,
                    )
                else:
                    uploads[i] = sims[r].collect_uploads(active[i])
        return uploads

    def train(self, chosen: Mapping[int, list[Client]]) -> dict[int, list[float]]:
        losses = self.trainer.train_runs({self.runs[i]: cs for i, cs in chosen.items()})
        return {i: losses[r] for i, r in enumerate(self.runs)}

    def evaluate(self, samples: Mapping[int, bool]) -> dict[int, dict[str, float]]:
        accs = self.trainer.evaluate_runs({self.runs[i]: s for i, s in samples.items()})
        return {i: accs[self.runs[i]] for i in samples}

    def scope(self, run: int) -> AbstractContextManager[None]:
        return log_scope(self.trainer.run_dirs[self.runs[run]])


# --------------------------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FusedMember:
    """One run of a fused group: its config, its folder, whether to resume its checkpoints."""

    config: ExperimentConfig
    run_dir: Path
    resume: bool = False


class _FusedSession(RunSession):
    """A run session whose checkpoints copy the run's rows out of the shared store."""

    def checkpoint_state(self) -> dict[str, Any]:
        return _compact(self.sim.state_dict())


def _compact(value: Any) -> Any:
    """``value`` with every tensor that views a larger storage (the fused store) copied, so a
    checkpoint holds this run's values only."""
    if isinstance(value, torch.Tensor):
        if value.untyped_storage().nbytes() > value.numel() * value.element_size():
            return value.clone()
        return value
    if isinstance(value, dict):
        return {k: _compact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_compact(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_compact(v) for v in value)
    return value


RoundHook = Callable[[int, RoundMetrics], None]


def run_fused(
    members: Sequence[FusedMember],
    *,
    home: Path | None = None,
    threads: int | None = None,
    on_round: RoundHook | None = None,
) -> list[RunResult]:
    """Run a group of runs as one batched program, each into its own run folder.

    Raises :class:`FusionUnavailable` (naming why) when they cannot fuse, before any round has
    run and with every folder released; the caller then runs them one by one.  ``threads``:
    torch intra-op threads for the fused rounds (default 1, as a single run).  ``on_round``
    is called with (member index, metrics) after each run's round is written."""
    labels = [m.run_dir.name for m in members]
    sessions = [_FusedSession(m.config, m.run_dir) for m in members]
    threads_before = torch.get_num_threads()
    try:
        for m, s in zip(members, sessions):
            prepare_run_dir(m.config, m.run_dir, resume=m.resume)
            with log_scope(m.run_dir):
                s.open(home=home, resume=m.resume)
        sims = [s.sim for s in sessions]
        problem = fusion_problem(sims, labels)
        trainer: FusedTrainer | None = None
        if problem is None:
            trainer = FusedTrainer(sims, labels)
            if not trainer.supported:
                problem = trainer.reason
        if problem is not None or trainer is None:
            raise FusionUnavailable(problem or "not supported")
        for r, (s, sim) in enumerate(zip(sessions, sims)):
            sim.batched = _RunTrainer(trainer, r)
            trainer.run_dirs[r] = s.run_dir
            with log_scope(s.run_dir):
                log.info(
                    "fused with %d other run(s) of the sweep: %s",
                    len(members) - 1,
                    ", ".join(n for n in labels if n != labels[r]),
                )
        torch.set_num_threads(max(1, threads or 1))
        while True:
            live = [r for r, s in enumerate(sessions) if sims[r].round < s.target]
            if not live:
                break
            lo = min(sims[r].round for r in live)
            step = [r for r in live if sims[r].round == lo]
            metrics = fused_round(trainer, step)
            for r in step:
                if sims[r].round >= sessions[r].target:
                    trainer.detach_run(r)  # its last checkpoint and artifacts hold its own rows
                with log_scope(sessions[r].run_dir):
                    sessions[r].on_round(metrics[r])
                if on_round is not None:
                    on_round(r, metrics[r])
        results = []
        for s in sessions:
            with log_scope(s.run_dir):
                results.append(s.finish(list(s.sim.history)))
        return results
    finally:
        torch.set_num_threads(threads_before)
        for s in sessions:
            s.close()
