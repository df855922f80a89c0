"""Batched local training: many clients' local epochs as one tensor program.

With a frozen backbone the trainable part of a client (residual adapter, projection, head) is
small and its inputs are cached features, so a group of clients can train together: their
trainable parameters are stacked into ``[m, ...]`` tensors and every local step runs batched
matrix products (``torch.bmm``) over the group, one autograd pass for all of them (the clients'
losses are summed; their parameters are disjoint, so each gets exactly its own gradient).

Semantics are those of :meth:`Simulation.train_client`, client by client:

* every client draws ``local_epochs`` permutations from its own ``train_gen`` (the same calls in
  the same order as the sequential mode) and walks them in batches of ``batch_size``;
* the objective is the method's (``local``, ``fedavg``: cross-entropy; ``fedproto`` /
  ``fedtgp``: cross-entropy + ``lam`` * MSE to the global prototype of the sample's class over
  the samples whose class has one; ``fedprox``: cross-entropy + ``mu``/2 * ||w - w_global||^2,
  its gradient added in closed form), plus DCR's soft clip and EMA-teacher distillation when
  DCR is on; the engine averages ``fedavg``/``fedprox`` weights after training, as
  sequentially;
* each client's AdamW (its own ``lr``, betas, eps, weight decay, step count and moments) is
  applied with torch's fused AdamW kernel (the kernel ``torch.optim.AdamW(fused=True)`` runs:
  the same update formula, decoupled weight decay and bias correction as the default
  implementation; results agree to float rounding); ``federation.optimizer: sgd`` (FedDAP's
  protocol) is torch's SGD op for op on the stacked rows (weight decay added to the gradient,
  heavy-ball or Nesterov momentum; dampening 0, whose first step, ``buf = grad``, is the
  general step on a zero buffer, so a client's buffer exists from its first adoption);
* a client with fewer steps than the longest one in its group is masked on the padded steps
  (no update, no optimizer step, no DCR step);
* the trained parameters, AdamW states and DCR teachers ARE each client's ``model`` parameters,
  ``optimizer.state`` tensors and ``dcr.teacher`` parameters (rows of a stacked storage the
  client tensors point into, see :class:`~protofl.engine.store._Store`), so checkpoints,
  evaluation and releases see them unchanged, with nothing to copy back.

Agreement with the sequential mode is within float rounding (batched and per-client matrix
products sum in different orders): parameters after a few rounds within ``atol=1e-5``.  A ReLU
pre-activation within ~1e-7 of zero can land on different sides in the two modes; that client
then differs by O(learning rate).

Besides ``train`` (called by ``Simulation.train_active``) the trainer offers ``features_many``
(every client's upload features at once; the simulation's one upload loop releases them) and
batched versions of the engine's ``evaluate`` and ``evaluate_holdout`` (same results; see their
docs).  Its memory (the stacked storage, memory-mapped paging, :class:`~protofl.engine.store.
FrozenParameterPool`) is :mod:`protofl.engine.store`, its autograd kernels
:mod:`protofl.engine.kernels`.  It computes;
it never calls back into the simulation's round.

Only the default :class:`~protofl.models.client.ClientModel` (pooled features, residual adapter,
projection, linear or MLP head) is batched; other models, optimizers or methods make
:attr:`BatchedTrainer.supported` false, with one log line, and the engine trains sequentially.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from protofl.engine.kernels import (
    _BatchedLinear,
    _ProjectedAdapter,
    adamw_rows,
    clip_rows,
    ema_rows,
    sgd_rows,
)
from protofl.engine.store import FrozenProjections, _optimizer_kind, _Store
from protofl.methods.objectives import Group, LocalObjective, ModelView, Step, nearest_prototype
from protofl.models.client import ClientModel, ResidualAdapter
from protofl.privacy.dcr import distillation, soft_clip

if TYPE_CHECKING:
    from protofl.engine.client import Client, Federation
    from protofl.engine.federated_data import ClientData

log = logging.getLogger(__name__)

# Working memory (bytes) one group of clients may use for weight gradients and activations;
# groups are cut to fit (parameters and AdamW moments live in the stacked storage).
DEFAULT_MEMORY_BUDGET = 256 * 2**20


# --------------------------------------------------------------------------------------------
# what can be batched
# --------------------------------------------------------------------------------------------
def _head_layout(head: nn.Module) -> str | None:
    """``linear`` or ``mlp`` (Linear, ReLU, Linear) when the head is one we batch."""
    if type(head) is nn.Linear and head.bias is not None:
        return "linear"
    if (
        type(head) is nn.Sequential
        and len(head) == 3
        and type(head[0]) is nn.Linear
        and type(head[1]) is nn.ReLU
        and type(head[2]) is nn.Linear
        and head[0].bias is not None
        and head[2].bias is not None
    ):
        return "mlp"
    return None


def _model_problem(model: nn.Module) -> str | None:
    if type(model) is not ClientModel:
        return f"client model {type(model).__name__} is not the default ClientModel"
    if type(model.adapter) is not ResidualAdapter:
        return "the adapter is not the default residual adapter"
    if type(model.proj) is not nn.Linear or model.proj.bias is None:
        return "the projection is not a biased Linear"
    if _head_layout(model.head) is None:
        return f"head {type(model.head).__name__} is neither Linear nor Linear-ReLU-Linear"
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:
            return f"parameter {name} is {p.dtype}, not float32"
        if not name.startswith("proj.") and not p.requires_grad:
            return f"parameter {name} is frozen"
    if model.proj.weight.requires_grad != model.proj.bias.requires_grad:
        return "the projection's weight and bias differ in trainability"
    return None


def _optimizer_problem(model: nn.Module, opt: torch.optim.Optimizer) -> str | None:
    kind = _optimizer_kind(opt)
    if kind is None or len(opt.param_groups) != 1:
        return f"optimizer {type(opt).__name__} is not a one-group AdamW or SGD"
    group = opt.param_groups[0]
    if group.get("amsgrad") or group.get("maximize") or group.get("differentiable"):
        return f"{type(opt).__name__} with amsgrad/maximize/differentiable"
    if isinstance(group["lr"], torch.Tensor):
        return f"{type(opt).__name__} with a tensor learning rate"
    if kind == "sgd" and float(group.get("dampening", 0.0)) != 0.0:
        return "SGD with dampening (its first step is not the general step)"
    trainable = [p for p in model.parameters() if p.requires_grad]
    if [id(p) for p in group["params"]] != [id(p) for p in trainable]:
        return "the optimizer does not hold exactly the model's trainable parameters"
    return None


@dataclass
class _Group:
    """Clients trained together, in row order (longest first); rows contiguous or gathered."""

    clients: list[Client]
    positions: list[int]  # each client's index in the caller's list
    rows: torch.Tensor
    contiguous: bool
    steps: list[int]

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The group's rows of a store tensor: a view, or a gathered copy (see :meth:`put`)."""
        if self.contiguous:
            r0 = int(self.rows[0])
            return t[r0 : r0 + len(self.clients)]
        return t.index_select(0, self.rows)

    def put(self, t: torch.Tensor, work: torch.Tensor) -> None:
        """Write a gathered working copy back (nothing to do for views)."""
        if not self.contiguous:
            t.index_copy_(0, self.rows, work)


class _GroupView(ModelView):
    """:class:`ModelView` of a piece of a group: the clients' stacked parameters ``w``."""

    def __init__(
        self,
        trainer: BatchedTrainer,
        w: dict[str, torch.Tensor],
        which: Sequence[int] | None = None,
    ) -> None:
        self.trainer = trainer
        self.w = w
        self.which = which  # each client's frozen projection (FrozenProjections), if shared

    def features(self, z: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        w = dict(self.w)
        w.update(params)
        with torch.no_grad():
            return self.trainer._plain_features(w, z, self.which)

    def project(self, z: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.trainer._project(self.w, z, self.which)

    def select(self, at: torch.Tensor) -> ModelView:
        which = None if self.which is None else [self.which[i] for i in at.tolist()]
        return _GroupView(
            self.trainer, {n: t.index_select(0, at) for n, t in self.w.items()}, which
        )


# --------------------------------------------------------------------------------------------
# the trainer
# --------------------------------------------------------------------------------------------
class BatchedTrainer:
    """Trains the round's participants in groups with stacked parameters (see module doc).

    ``supported`` tells the engine whether this simulation can be batched; when it is not, the
    reason is logged once and ``train`` must not be called.
    """

    def __init__(
        self,
        sim: Federation,
        *,
        memory_budget: int | None = None,
        optimizer: str = "fused",
        state_dir: Path | None = None,
    ) -> None:
        if optimizer not in ("fused", "reference"):
            raise ValueError(f"optimizer={optimizer!r}; choose fused or reference")
        self.sim = sim
        # run.device (Simulation.device): the stacked storage, the batches and the products
        self.device: torch.device = getattr(sim, "device", torch.device("cpu"))
        # run.memory_budget_mb in bytes; None: the default, which cuts the groups but never
        # refuses a run (a client that needs more trains in a group of its own)
        self.memory_budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
        self.budget_set = memory_budget is not None
        # run.client_state=disk: the stacked storage lives in memory-mapped files here
        self.state_dir = state_dir
        # torch's fused AdamW kernel (one pass over memory); "reference" runs the op sequence of
        # torch's default single-tensor AdamW (bitwise the sequential mode's update, slower)
        self.optimizer = optimizer if hasattr(torch, "_fused_adamw_") else "reference"
        self.reason: str | None = None
        # the method says whether it can batch: a declared objective and evaluation rule
        self.objective: LocalObjective | None = (
            sim.method.objective() if sim.method.batchable else None
        )
        if self.objective is None:
            # (it overrides client_loss or predict without declaring objective / prediction)
            self.reason = f"method {sim.method.name} cannot batch"
        elif getattr(sim, "amp", "none") != "none":
            # the batched layers write float32 gradients into preallocated buffers
            self.reason = f"run.amp={sim.amp} is not batched"
        else:
            self.reason = self._check_clients(sim.clients)
        self.supported = self.reason is None
        self.store: _Store | None = None
        self._grad: dict[str, torch.Tensor] = {}
        self._reassoc: tuple[bool, int] | None = None  # see _reassociated
        if not self.supported:
            log.info("%s; falling back to sequential", self.reason)
            return
        first = sim.clients[0].model
        assert isinstance(first, ClientModel)
        self.head = _head_layout(first.head)
        self.train_proj = bool(first.proj.weight.requires_grad)
        # federation.optimizer: sgd keeps its momentum buffers in the exp_avg rows
        self.sgd = _optimizer_kind(sim.clients[0].optimizer) == "sgd"
        self.clip = float(sim.config.federation.grad_clip_norm)
        self.names = [n for n, p in first.named_parameters() if p.requires_grad]
        self.head_names = [n for n in self.names if n.startswith("head.")]
        self.shapes = {n: tuple(p.shape) for n, p in first.named_parameters()}
        self.projections = self.frozen_projections(sim.clients)
        dcr = sim.clients[0].dcr
        self.teacher_shapes = (
            {n: tuple(p.shape) for n, p in dcr.teacher.named_parameters()} if dcr else {}
        )
        self.anchor = torch.zeros((), requires_grad=True, device=self.device)

    @property
    def _opt(self) -> dict[str, Any]:
        """The optimiser settings the row steps share: trainable and head tensor names, and
        the param group (every client's optimiser is built alike from ``federation``)."""
        group = self.sim.clients[0].optimizer.param_groups[0]
        return {"names": self.names, "head_names": self.head_names, "group": group}

    def frozen_projections(self, clients: Sequence[Client]) -> FrozenProjections | None:
        """The clients' frozen projections (one per run; Simulation pooled each run's as it
        built them), or None when the projection trains or there are too many."""
        if self.train_proj:
            return None
        return FrozenProjections.of_clients(clients)

    def check_budget(self, clients: Sequence[Client]) -> None:
        """Refuse a ``run.memory_budget_mb`` set by the user that cannot hold one client's
        working memory (the default never refuses)."""
        self.check_budget_of([c.data for c in clients])

    def check_budget_of(self, data: Sequence[ClientData]) -> None:
        """:meth:`check_budget` from the clients' data alone (a client's working memory
        follows from the model's shapes, which the trainer read from the first client, and
        its data): ``run.client_state=disk`` checks it before any client is written."""
        if not self.budget_set:
            return
        worst = max(data, key=self._bytes_for)
        need = self._bytes_for(worst)
        if need > self.memory_budget:
            raise ValueError(
                f"run.memory_budget_mb={self.memory_budget / 2**20:g} cannot hold one group of "
                f"batched clients: client {worst.name!r} alone needs "
                f"{math.ceil(need / 2**20)} MB (raise run.memory_budget_mb to at least that)"
            )

    # ----- checks ---------------------------------------------------------------------------
    def _check_clients(self, clients: Sequence[Client]) -> str | None:
        if not clients:
            return "no clients"
        ref: tuple[Any, ...] | None = None
        for c in clients:
            problem = _model_problem(c.model) or _optimizer_problem(c.model, c.optimizer)
            if problem is not None:
                return f"client {c.data.name!r}: {problem}; its model cannot batch"
            group = c.optimizer.param_groups[0]
            sig = (
                tuple((n, tuple(p.shape), p.requires_grad) for n, p in c.model.named_parameters()),
                _optimizer_kind(c.optimizer),
                float(group["lr"]),
                tuple(float(b) for b in group.get("betas", ())),
                float(group.get("eps", 0.0)),
                float(group.get("momentum", 0.0)),
                bool(group.get("nesterov", False)),
                float(group["weight_decay"]),
                _head_layout(c.model.head),
                c.dcr is not None,
            )
            if ref is None:
                ref = sig
            elif sig != ref:
                return (
                    f"client {c.data.name!r} differs from the others (shapes or optimizer "
                    "settings); its model cannot batch"
                )
            if c.dcr is not None and _head_layout(c.dcr.teacher) != _head_layout(c.model.head):
                return f"client {c.data.name!r}: DCR teacher does not match the head"
        return None

    # ----- grouping ---------------------------------------------------------------------------
    def _steps(self, c: Client) -> int:
        fed = self.sim.config.federation
        return fed.local_epochs * math.ceil(c.data.num_train / fed.batch_size)

    def _sort_key(self, d: ClientData) -> tuple[int, int, int, int]:
        """Store row order: clients sharing a test set together (batched evaluation takes
        contiguous rows), then by steps and last-batch size, longest first."""
        fed = self.sim.config.federation
        bs = fed.batch_size
        last = d.num_train - (math.ceil(d.num_train / bs) - 1) * bs
        steps = fed.local_epochs * math.ceil(d.num_train / bs)
        return (self._test_rank[id(d.test_z)], -steps, -last, d.client)

    def _bytes_per_client(self, c: Client) -> int:
        return self._bytes_for(c.data)

    def _bytes_for(self, d: ClientData) -> int:
        """The working memory (bytes) of a client with data ``d`` in a group."""
        fed = self.sim.config.federation
        params = sum(math.prod(self.shapes[n]) for n in self.names)
        d_in = d.train_z.shape[1]
        proto = self.shapes["proj.weight"][0]
        hidden = self.shapes["adapter.down.weight"][0]
        rows = min(fed.batch_size, d.num_train)
        acts = rows * (5 * d_in + 10 * proto + 4 * hidden)
        return 4 * (params + acts)

    def _ensure_store(self) -> _Store:
        # ordered by the clients' data, so it can be made while the simulation is still
        # building its clients (run.client_state=disk adopts each one as it is built)
        if self.store is None:
            self._test_rank: dict[int, int] = {}
            for d in self.sim.data.clients:
                self._test_rank.setdefault(id(d.test_z), len(self._test_rank))
            order = [d.client for d in sorted(self.sim.data.clients, key=self._sort_key)]
            self.store = _Store(
                self.names,
                self.shapes,
                self.teacher_shapes,
                order,
                self.device,
                self.state_dir,
                adam=not self.sgd,
            )
        return self.store

    def groups(self, clients: Sequence[Client]) -> list[_Group]:
        """The clients in row order, cut into groups within the memory budget."""
        store = self._ensure_store()
        order = sorted(range(len(clients)), key=lambda j: store.row[clients[j].data.client])
        out: list[_Group] = []
        cur: list[int] = []
        used = 0
        for j in order:
            need = self._bytes_per_client(clients[j])
            if cur and (
                used + need > self.memory_budget
                or self._test_rank[id(clients[j].data.test_z)]
                != self._test_rank[id(clients[cur[0]].data.test_z)]
            ):
                out.append(self._group(clients, cur))
                cur, used = [], 0
            cur.append(j)
            used += need
        if cur:
            out.append(self._group(clients, cur))
        return out

    def _group(self, clients: Sequence[Client], idx: list[int]) -> _Group:
        assert self.store is not None
        rows = [self.store.row[clients[j].data.client] for j in idx]
        return _Group(
            clients=[clients[j] for j in idx],
            positions=list(idx),
            rows=torch.tensor(rows, device=self.device),
            contiguous=rows == list(range(rows[0], rows[0] + len(rows))),
            steps=[self._steps(clients[j]) for j in idx],
        )

    # ----- training -------------------------------------------------------------------------
    def train(self, clients: Sequence[Client]) -> list[float]:
        """Local training of ``clients``; returns each one's mean batch loss (as sequential)."""
        if not self.supported:
            raise RuntimeError(f"batched training is not supported here: {self.reason}")
        sim = self.sim
        store = self._ensure_store()
        for c in clients:
            sim.method.begin_local(c.model, c.state, sim.global_state, c.data.client)
            c.model.train()
        store.adopt_all(clients)
        if sim.config.federation.local_epochs == 0:  # no training: as sequential, loss 0
            groups, losses = [], [0.0] * len(clients)
        else:
            groups, losses = self.groups(clients), [math.nan] * len(clients)
        for group in groups:
            for pos, loss in zip(group.positions, self._train_group(group)):
                losses[pos] = loss
            store.page_out(group.rows.tolist())
        for c in clients:
            sim.method.end_local(c.model, c.state, sim.global_state, c.data.client)
        if sim.method.uses_training_data:
            for c in clients:
                c.model.eval()
            for c, f in zip(clients, self.features_many(clients)):
                sim.method.after_training(c.state, f, c.data.train_y)
        return losses

    def _batches(self, group: _Group) -> tuple[torch.Tensor, torch.Tensor]:
        """Per client and step the row indices into the group's concatenated features.

        Returns ``index [m, S, W]`` and ``valid [m, S, W]``, on the CPU (the caller moves them).
        The permutations come from each client's ``train_gen`` exactly as in
        :meth:`Simulation.train_client` (``local_epochs`` calls of ``torch.randperm``); the
        padding of an epoch's partial last batch points at that epoch's first row, and the
        steps after a client's last at its own first row (both masked by ``valid``).  One
        ``randperm`` a client and epoch, the rest as a few whole-group tensor operations
        (a Python loop of slice assignments cost 31 ms a round at M = 1000; this 7 ms).
        """
        fed = self.sim.config.federation
        bs, epochs = fed.batch_size, fed.local_epochs
        m, s_max = len(group.clients), group.steps[0]
        num = torch.tensor([c.data.num_train for c in group.clients], dtype=torch.long)
        width = min(bs, int(num.max()))
        offset = torch.cumsum(num, 0) - num  # each client's first row
        per_epoch = (num + bs - 1) // bs
        # one draw per (client, epoch), in the order train_client draws them
        drawn = torch.cat(
            [
                torch.randperm(c.data.num_train, generator=c.train_gen)
                for c in group.clients
                for _ in range(epochs)
            ]
        )
        counts = num.repeat_interleave(epochs)  # the draws' lengths
        first = torch.cumsum(counts, 0) - counts  # where each draw starts in ``drawn``
        client = torch.arange(m).repeat_interleave(epochs)  # of each draw
        epoch = torch.arange(epochs).repeat(m)
        # every step s < steps[i] of client i first points at its epoch's first drawn row
        s = torch.arange(s_max)
        live = s.view(1, -1) < (per_epoch * epochs).view(-1, 1)  # [m, S]
        draw_of = torch.arange(m).view(-1, 1) * epochs + torch.minimum(
            s.view(1, -1) // per_epoch.view(-1, 1), torch.tensor(epochs - 1)
        )
        head = drawn[first[draw_of]] + offset.view(-1, 1)
        index = torch.where(live, head, offset.view(-1, 1))
        index = index.unsqueeze(2).expand(m, s_max, width).contiguous()
        valid = torch.zeros(m, s_max, width, dtype=torch.bool)
        # then every drawn row goes to its step and column
        of_row = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        pos = torch.arange(drawn.numel()) - first[of_row]
        col = pos % bs
        keep = col < width
        owner = client[of_row]
        who = owner[keep]
        step = (epoch[of_row] * per_epoch[owner] + pos // bs)[keep]
        index[who, step, col[keep]] = drawn[keep] + offset[who]
        valid[who, step, col[keep]] = True
        return index, valid

    def _grad_buffers(self, rows: int) -> dict[str, torch.Tensor]:
        if not self._grad or next(iter(self._grad.values())).shape[0] < rows:
            self._grad = {
                n: torch.empty(rows, *self.shapes[n], device=self.device) for n in self.names
            }
        return self._grad

    # a piece's fixed cost (its products, loss terms and autograd nodes, and the lower rate of
    # smaller products), in padded rows of one client.  Measured on 2 cores, one thread
    # (benchmarks/profile_train.py): 32, 64 and 128 equal within noise at M = 100 and M = 1000,
    # 4 and 16 slower
    PIECE_ROWS = 64

    @classmethod
    def _pieces(cls, widths: list[int]) -> list[tuple[int, int, int]]:
        """Cut rows 0..k-1 into runs ``(a, b, width)``, ``width`` the largest of ``widths[a:b]``,
        that minimise ``sum(PIECE_ROWS + (b - a) * width)``: padding costs arithmetic, a piece
        costs calls.  Exact over runs of equal width (dynamic programming; a piece may span the
        last 64 runs, more than the sorted widths of a step ever have)."""
        runs: list[list[int]] = []  # [first row, width]
        for i, w in enumerate(widths):
            if not runs or runs[-1][1] != w:
                runs.append([i, w])
        n = len(runs)
        starts = [r[0] for r in runs] + [len(widths)]
        best = [0.0] + [math.inf] * n
        cut = [(0, 0)] * (n + 1)  # (first run, width) of the last piece of the best cut
        for j in range(1, n + 1):
            top = 0
            for i in range(j - 1, max(-1, j - 65), -1):  # the piece is runs i..j-1
                top = max(top, runs[i][1])
                cost = best[i] + cls.PIECE_ROWS + (starts[j] - starts[i]) * top
                if cost < best[j]:
                    best[j], cut[j] = cost, (i, top)
        out: list[tuple[int, int, int]] = []
        j = n
        while j > 0:
            i, top = cut[j]
            out.append((starts[i], starts[j], top))
            j = i
        return out[::-1]

    # A frozen projection P of the adapted input z + U h can be re-associated: y0 = P z + b of
    # every training row is computed once per client (_y0), and a step computes (P U) h instead
    # of P applied to its rows.  Per client step of w rows that trades 2 w d_in d multiply-adds
    # (the forward and the input gradient through P) and 3 w d_in H (the up-projection's
    # products) for 2 d d_in H (P U and the gradient P^T g_PU) and 3 w d H; worth it for wide
    # steps (w above ~58 at 1280 -> 512 with H = 64: the VPDR preset's batches of 256), not for
    # narrow ones.  The cached y0 costs d / d_in of the training features' float32 memory.
    # None: decided by that count, once per run (_reassociated), then per piece by its width;
    # True / False: forced (tests)
    REASSOCIATE: bool | None = None

    def _reassociation(self, widths: torch.Tensor) -> tuple[bool, int]:
        """(whether to compute ``y0`` and re-associate, the narrowest step width that gains)
        for clients whose steps have ``widths`` rows (0: no step)."""
        d, d_in = self.shapes["proj.weight"]
        hidden = self.shapes["adapter.down.weight"][0]
        per_row_old = 2 * d_in * d + 3 * d_in * hidden
        per_row_new = 3 * d * hidden
        fixed_new = 2 * d * d_in * hidden
        # the narrowest width w with fixed_new + w per_row_new < w per_row_old
        narrowest = fixed_new // (per_row_old - per_row_new) + 1
        if self.REASSOCIATE is not None:
            return self.REASSOCIATE, 1 if self.REASSOCIATE else 0
        w = widths[widths > 0].double()
        old = float((w * per_row_old).sum())
        gain = w >= narrowest
        rows = float(widths.sum()) / max(1, self.sim.config.federation.local_epochs)
        new = (
            rows * d_in * d
            + float((fixed_new + w[gain] * per_row_new).sum())
            + float((w[~gain] * per_row_old).sum())
        )
        return new < old, narrowest

    def _reassociated(self) -> tuple[bool, int]:
        """:meth:`_reassociation` of the whole population's local steps, decided once per run
        (from its data and config alone, so a resumed or offloaded run decides the same)."""
        if self._reassoc is None:
            fed = self.sim.config.federation
            widths = []
            for c in self.sim.clients:
                n, bs = c.data.num_train, fed.batch_size
                widths += [bs] * (n // bs) + ([n % bs] if n % bs else [])
            use, narrowest = self._reassociation(
                torch.tensor(widths * fed.local_epochs, dtype=torch.long)
            )
            # a frozen projection and untransformed inputs (FedRDN's change z every step)
            objective = self.objective
            use = use and self.projections is not None
            use = use and objective is not None and objective.inputs is None
            self._reassoc = (use, narrowest)
        return self._reassoc

    def _y0(self, c: Client, j: int) -> torch.Tensor:
        """``proj(z)`` of client ``c``'s training rows under projection ``j``: cached across
        rounds when the store is in memory; computed each time when it is on disk (resident
        memory must not grow with the population)."""
        assert self.projections is not None and self.store is not None
        if self.store.mapped:
            return self.projections.project(c.data.train_z, j)
        return self.projections.cached(c.data.train_z, j)

    def _train_group(self, group: _Group) -> list[float]:
        sim = self.sim
        store = self.store
        assert store is not None and self.objective is not None
        objective = self.objective
        clients = group.clients
        m = len(clients)
        feats = torch.cat([c.data.train_z for c in clients])
        labels = torch.cat([c.data.train_y for c in clients])
        index, valid_cpu = self._batches(group)
        # drawn on the CPU from the clients' generators, moved once per group
        index, valid = index.to(self.device), valid_cpu.to(self.device)
        steps_of = torch.tensor(group.steps)

        store.prefetch(group.rows.tolist())  # mapped: the group's rows in bulk, not page by page
        params = {n: group.take(store.param[n]) for n in self.names}
        exp_avg = {n: group.take(store.exp_avg[n]) for n in self.names}
        # SGD keeps only its momentum buffers (exp_avg); AdamW's second moments and steps stay put
        adam = self.names if not self.sgd else []
        exp_avg_sq = {n: group.take(store.exp_avg_sq[n]) for n in adam}
        opt_step = {n: group.take(store.step[n]) for n in adam}
        teacher = {n: group.take(t) for n, t in store.teacher.items()}
        grads = self._grad_buffers(m)
        # the clients' stacked frozen projections when there is no table of them
        fixed = self._with_projection({}, clients)
        proj_of = self._which(clients)
        # a frozen projection re-associated (see REASSOCIATE): proj(z) of every row, once
        y0_all: torch.Tensor | None = None
        use, narrowest = self._reassociated()
        if use and proj_of is not None:
            y0_all = torch.cat([self._y0(c, j) for c, j in zip(clients, proj_of)])
        dcr = clients[0].dcr
        dcr_steps = torch.tensor([c.dcr.steps for c in clients]) if dcr is not None else None
        # DCR's soft-clip radius (privacy.clip): one number, or one a client where a fused group
        # holds runs whose privacy.clip differs
        radius: float | torch.Tensor | None = dcr.radius if dcr is not None else None
        radii = [c.dcr.radius for c in clients if c.dcr is not None]
        if len(set(radii)) > 1:
            radius = torch.tensor(radii, device=self.device)
        # the method's declared terms, prepared once for the group (prototype table, anchors)
        group_info = Group(
            [c.state for c in clients],
            [c.data.domain for c in clients],
            sim.data.num_classes,
            [c.data.client for c in clients],
        )
        prepared = objective.prepare(sim.global_state, group_info)
        inputs = objective.inputs
        inputs_prepared = (
            inputs.prepare(sim.global_state, group_info) if inputs is not None else None
        )
        has_param_terms = bool(objective.param_terms)
        loss_sum = torch.zeros(m, dtype=torch.float64, device=self.device)
        for s in range(group.steps[0]):
            k = int((steps_of > s).sum())  # clients still stepping: a prefix
            widths = valid_cpu[:k, s].sum(dim=1).tolist()
            losses = []
            # which clients' loss reaches the head (None: all; the objective without its
            # cross-entropy and DCR off can leave it out)
            head_live: list[torch.Tensor] | None = [] if dcr is None else None
            for a, b, width in self._pieces(widths):
                rows = index[a:b, s, :width]
                ok = valid[a:b, s, :width]
                # one row gather (index_select is ~20% faster than advanced indexing here)
                z = feats.index_select(0, rows.reshape(-1)).view(b - a, width, -1)
                if z.dtype != torch.float32:
                    z = z.float()
                rows_ = slice(a, b)
                if inputs is not None:
                    z = inputs.train(z, ok, inputs_prepared, rows_, s)
                y = labels[rows]
                w = {n: t[a:b] for n, t in params.items()}
                w.update({n: t[a:b] for n, t in fixed.items()})
                g = {n: t[a:b] for n, t in grads.items()}
                which = proj_of[a:b] if proj_of is not None else None
                y0 = y0_all[rows] if y0_all is not None and width >= narrowest else None
                f_raw = self._features(w, g, z, which, y0)
                if radius is None:  # DCR off
                    f = f_raw
                else:
                    r_ab = radius[a:b, None, None] if isinstance(radius, torch.Tensor) else radius
                    f = soft_clip(f_raw, r_ab, dcr.gamma, dcr.mode)
                logits = self._head(w, g, f)
                step = Step(
                    f=f,
                    logits=logits,
                    y=y,
                    ok=ok,
                    z=z,
                    f_raw=f_raw,
                    model=_GroupView(self, w, which),
                )
                loss = objective.feature_loss(step, prepared, rows_)
                if head_live is not None:
                    used = objective.uses_logits(step, prepared, rows_)
                    if used is None:
                        head_live = None
                    else:
                        head_live.append(used)
                if dcr is not None and dcr_steps is not None and dcr.weight != 0:
                    kd_on = dcr_steps[a:b] >= dcr.warmup  # on the CPU
                    kd_on_dev = kd_on.to(self.device)
                    if bool(kd_on.any()):
                        with torch.no_grad():
                            t_logits = self._teacher({n: t[a:b] for n, t in teacher.items()}, f_raw)
                        kl = distillation(logits, t_logits, dcr.tau, ok)
                        kd = dcr.weight * dcr.tau**2 * kl
                        loss = loss + torch.where(kd_on_dev, kd, torch.zeros_like(kd))
                losses.append(loss)
            loss = torch.cat(losses) if len(losses) > 1 else losses[0]
            param_grads: dict[str, torch.Tensor] = {}
            if has_param_terms:
                with torch.no_grad():  # their gradients are added below, in closed form
                    value, param_grads = objective.param_loss(
                        {n: params[n][:k] for n in self.names}, prepared, slice(0, k), k
                    )
                if value is not None:
                    loss = loss + value
            if not bool(torch.isfinite(loss).all()):
                bad = int((~torch.isfinite(loss)).nonzero()[0, 0])
                raise FloatingPointError(
                    f"client {clients[bad].data.name!r}, round {sim.round}: local loss is "
                    f"{float(loss[bad])}"
                )
            live = None
            if head_live is not None:
                live = torch.cat(head_live) if len(head_live) > 1 else head_live[0]
                if bool(live.all()):
                    live = None
            loss.sum().backward()
            with torch.no_grad():
                for n, g_n in param_grads.items():  # the parameter terms' gradients
                    grads[n][:k].add_(g_n)
                if live is not None:  # a head without a gradient: none in the norm or the step
                    for n in self.head_names:
                        grads[n][:k][~live] = 0.0
                if self.clip > 0:
                    clip_rows(grads, k, names=self.names, max_norm=self.clip)
                if self.sgd:
                    sgd_rows(params, grads, exp_avg, k, head_live=live, **self._opt)
                else:
                    for n in self.names:
                        if live is not None and n in self.head_names:
                            opt_step[n][:k] += live.to(opt_step[n].dtype)
                        else:
                            opt_step[n][:k] += 1
                    adamw_rows(
                        params,
                        grads,
                        exp_avg,
                        exp_avg_sq,
                        opt_step,
                        k,
                        head_live=live,
                        fused=self.optimizer == "fused",
                        **self._opt,
                    )
                if dcr is not None and dcr_steps is not None:
                    dcr_steps[:k] += 1
                    ema_rows(teacher, params, dcr_steps, k, dcr.warmup, dcr.beta)
            loss_sum[:k] += loss.detach().double()

        for n in self.names:
            group.put(store.param[n], params[n])
            group.put(store.exp_avg[n], exp_avg[n])
        for n in adam:
            group.put(store.exp_avg_sq[n], exp_avg_sq[n])
            group.put(store.step[n], opt_step[n])
        for n, t in teacher.items():
            group.put(store.teacher[n], t)
        if inputs is not None:
            inputs.finish(inputs_prepared, group.steps)
        if dcr_steps is not None:
            for c, st in zip(clients, dcr_steps.tolist()):
                c.dcr.steps = int(st)
        sums = loss_sum.tolist()
        return [sums[i] / max(group.steps[i], 1) for i in range(m)]

    # ----- pieces -----------------------------------------------------------------------------
    def _linear(
        self,
        w: dict[str, torch.Tensor],
        g: dict[str, torch.Tensor],
        name: str,
        x: torch.Tensor,
        bias: bool = True,
    ) -> torch.Tensor:
        b = w[name + ".bias"] if bias else None
        return _BatchedLinear.apply(
            x,
            w[name + ".weight"],
            b,
            g.get(name + ".weight"),
            g.get(name + ".bias") if bias else None,
            self.anchor,
        )

    def _features(
        self,
        w: dict[str, torch.Tensor],
        g: dict[str, torch.Tensor],
        z: torch.Tensor,
        which: Sequence[int] | None = None,
        y0: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``proj(z + up(relu(down(z))))`` for k clients: [k, b, d_in] -> [k, b, d]
        (``which``: each client's frozen projection, see :class:`FrozenProjections`; ``y0``:
        ``proj(z)`` [k, b, d], re-associated, see :attr:`REASSOCIATE`)."""
        h = torch.relu(self._linear(w, g, "adapter.down", z, bias=False))
        if y0 is not None and which is not None and self.projections is not None:
            projections = self.projections
            pu = projections.times_up(w["adapter.up.weight"], which)

            def grad_up(g_pu: torch.Tensor, out: torch.Tensor) -> None:
                projections.grad_up(g_pu, which, out)

            return _ProjectedAdapter.apply(
                h, y0, pu, g.get("adapter.up.weight"), grad_up, self.anchor
            )
        a = z + self._linear(w, g, "adapter.up", h, bias=False)
        if self.projections is not None and which is not None:
            return self.projections.apply(a, which)
        return self._linear(w, g, "proj", a)

    def _head(
        self, w: dict[str, torch.Tensor], g: dict[str, torch.Tensor], f: torch.Tensor
    ) -> torch.Tensor:
        if self.head == "linear":
            return self._linear(w, g, "head", f)
        x = torch.relu(self._linear(w, g, "head.0", f))
        return self._linear(w, g, "head.2", x)

    def _teacher(self, t: dict[str, torch.Tensor], f_raw: torch.Tensor) -> torch.Tensor:
        """The DCR teachers (no grad) on the raw features."""
        x = f_raw.detach()

        def lin(pre: str, x: torch.Tensor) -> torch.Tensor:
            return torch.baddbmm(t[pre + "bias"].unsqueeze(1), x, t[pre + "weight"].transpose(1, 2))

        if self.head == "linear":
            return lin("", x)
        return lin("2.", torch.relu(lin("0.", x)))

    # ----- uploads and evaluation (engine hooks) ---------------------------------------------
    @torch.no_grad()
    def features_many(self, clients: Sequence[Client], which: str = "train") -> list[torch.Tensor]:
        """Every client's ``model.features`` of its own training (``which="train"``) inputs,
        computed in batched groups; the same values as the per-client call to float rounding."""
        store = self._ensure_store()
        store.adopt_all(clients, optimizer=False)
        order = sorted(range(len(clients)), key=lambda j: store.row[clients[j].data.client])
        sizes = [clients[j].data.num_train for j in order]
        out: list[torch.Tensor] = [torch.empty(0)] * len(clients)
        cap = 4096  # rows x clients per piece (bounds the [k, n, d_in] temporaries)
        start = 0
        while start < len(order):
            top = max(sizes[start], 1)
            stop = start + 1
            while (
                stop < len(order)
                and (stop + 1 - start) * top <= cap
                and sizes[stop] <= top
                and 4 * max(sizes[stop], 1) >= 3 * top
            ):
                stop += 1
            part = [clients[j] for j in order[start:stop]]
            z = torch.zeros(len(part), top, part[0].data.train_z.shape[1], device=self.device)
            for i, c in enumerate(part):
                z[i, : c.data.num_train] = c.data.train_z
            w = self._rows(store.param, [store.row[c.data.client] for c in part])
            proj_of = self._which(part)
            y0 = None
            if proj_of is not None and self._reassociated()[0]:
                # re-associated as in training, with the same proj(z) of these rows
                for i, (c, j) in enumerate(zip(part, proj_of)):
                    y0_i = self._y0(c, j)
                    if y0 is None:
                        y0 = z.new_zeros(len(part), top, y0_i.shape[1])
                    y0[i, : c.data.num_train] = y0_i
            f = self._plain_features(self._with_projection(w, part), z, proj_of, y0)
            for i, j in enumerate(order[start:stop]):
                out[j] = f[i, : clients[j].data.num_train].clone()
            store.page_out([store.row[c.data.client] for c in part])
            start = stop
        return out

    def _which(self, clients: Sequence[Client]) -> list[int] | None:
        """Each client's frozen projection (None: each client's own, in ``w``)."""
        return self.projections.which(clients) if self.projections is not None else None

    def _with_projection(
        self, w: dict[str, torch.Tensor], clients: Sequence[Client]
    ) -> dict[str, torch.Tensor]:
        """``w`` with the clients' stacked frozen projections when there is no table of them."""
        if not self.train_proj and self.projections is None:
            w.update(
                {
                    n: torch.stack([c.model.get_parameter(n).detach() for c in clients])
                    for n in ("proj.weight", "proj.bias")
                }
            )
        return w

    def _plain_features(
        self,
        w: Mapping[str, torch.Tensor],
        z: torch.Tensor,
        which: Sequence[int] | None,
        y0: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``proj(z + up(relu(down(z))))`` without gradients; ``y0``: ``proj(z)``, which
        re-associates a frozen projection (``y0 + h (P U)^T``)."""
        h = torch.relu(torch.bmm(z, w["adapter.down.weight"].transpose(1, 2)))
        if y0 is not None and which is not None and self.projections is not None:
            pu = self.projections.times_up(w["adapter.up.weight"], which)
            return torch.baddbmm(y0, h, pu.transpose(1, 2))
        a = z + torch.bmm(h, w["adapter.up.weight"].transpose(1, 2))
        return self._project(w, a, which)

    def _project(
        self, w: Mapping[str, torch.Tensor], a: torch.Tensor, which: Sequence[int] | None
    ) -> torch.Tensor:
        """The projection of ``a`` [k, b, d_in]: the frozen ones of ``which``, or each
        client's (in ``w``)."""
        if self.projections is not None and which is not None:
            return self.projections.apply(a, which)
        return torch.baddbmm(w["proj.bias"].unsqueeze(1), a, w["proj.weight"].transpose(1, 2))

    @torch.no_grad()
    def predict_many(self, clients: Sequence[Client], z: torch.Tensor) -> torch.Tensor:
        """``method.predict`` of every client on the same inputs ``z``: [len(clients), T].

        With frozen projections (one per run, :class:`FrozenProjections`) the products are
        re-associated (``proj(z) + (P U) h`` with ``proj(z)`` computed once per projection and
        input set and reused across rounds, the head folded in), so logits agree with the
        per-client call to float rounding and an exact tie between two classes may break
        differently.  An objective whose input
        transform changes each client's test inputs (FedRDN) predicts each on its own."""
        sim = self.sim
        gs = sim.global_state
        method = sim.method
        rule = method.prediction()
        proto_eval = bool(gs) and rule == "prototype"
        objective = method.objective()
        inputs = objective.inputs if objective is not None else None
        store = self._ensure_store()
        store.adopt_all(clients, optimizer=False)
        z_key = z  # the caller's tensor keys the proj(z) cache (float16 features: upcast here)
        if z.dtype != torch.float32:
            z = z.float()
        t = z.shape[0]
        d_in, hidden = z.shape[1], self.shapes["adapter.down.weight"][0]
        d = self.shapes["proj.weight"][0]
        need_f = proto_eval or rule == "features" or self.head != "linear"
        projections = self.projections if inputs is None else None
        if projections is None:
            width = 4 * d_in + 2 * d
        else:
            width = hidden + (2 * d if need_f else 0) + 64
        per = max(1, min(len(clients), (32 * 2**20) // max(1, 4 * t * width)))
        # row order within each frozen projection's clients; parts of one projection each
        proj_of = projections.which(clients) if projections is not None else [0] * len(clients)
        rank = torch.tensor(
            sorted(
                range(len(clients)),
                key=lambda j: (proj_of[j], store.row[clients[j].data.client]),
            )
        )
        parts: list[tuple[list[Client], int]] = []
        for j in rank.tolist():
            if not parts or len(parts[-1][0]) == per or parts[-1][1] != proj_of[j]:
                parts.append(([], proj_of[j]))
            parts[-1][0].append(clients[j])
        preds = []
        for part, pj in parts:
            part_rows = [store.row[c.data.client] for c in part]
            w = self._rows(store.param, part_rows)
            zz = inputs.evaluate(z, gs, [c.state for c in part]) if inputs is not None else None
            if projections is not None:
                p_w = projections.table[pj][0]
                y0 = projections.cached(z_key, pj)
                wd = w["adapter.down.weight"]  # [k, H, D]
                k, hidden, _ = wd.shape
                h = torch.relu(z @ wd.reshape(k * hidden, -1).T).view(t, k, hidden)
                h = h.transpose(0, 1)  # [k, T, H]
                up = w["adapter.up.weight"]  # [k, D, H]
                if need_f:
                    pu = torch.matmul(p_w, up)  # [k, d, H]
                    f = y0.unsqueeze(0) + torch.bmm(h, pu.transpose(1, 2))
                    out = self._predict_from_features(w, f, rule, proto_eval, part)
                else:
                    # logits = head(y0 + P U h) = y0 Wh^T + h (Wh P U)^T + bh
                    wh, bh = w["head.weight"], w["head.bias"]  # [k, C, d], [k, C]
                    whp = (wh.reshape(-1, wh.shape[-1]) @ p_w).view(k, -1, d_in)
                    logits = (y0 @ wh.reshape(-1, wh.shape[-1]).T).view(t, k, -1).transpose(0, 1)
                    logits = logits + torch.bmm(h, torch.bmm(whp, up).transpose(1, 2))
                    logits = logits + bh.unsqueeze(1)
                    out = logits.argmax(dim=-1)
            else:
                w = self._with_projection(w, part)
                if zz is None:
                    zz = z.unsqueeze(0).expand(len(part), -1, -1)
                f = self._plain_features(w, zz.float(), self._which(part))
                out = self._predict_from_features(w, f, rule, proto_eval, part)
            preds.append(out)
            store.page_out(part_rows)
        pred = torch.cat(preds)
        back = torch.empty_like(rank)
        back[rank] = torch.arange(len(rank))
        return pred[back.to(pred.device)]

    def _predict_from_features(
        self,
        w: dict[str, torch.Tensor],
        f: torch.Tensor,
        rule: str | None,
        proto_eval: bool,
        part: Sequence[Client],
    ) -> torch.Tensor:
        gs = self.sim.global_state
        if proto_eval:
            return nearest_prototype(f, gs)
        if self.head == "linear":
            logits = torch.baddbmm(w["head.bias"].unsqueeze(1), f, w["head.weight"].transpose(1, 2))
        else:
            x = torch.relu(
                torch.baddbmm(w["head.0.bias"].unsqueeze(1), f, w["head.0.weight"].transpose(1, 2))
            )
            logits = torch.baddbmm(
                w["head.2.bias"].unsqueeze(1), x, w["head.2.weight"].transpose(1, 2)
            )
        if rule == "features":
            method = self.sim.method
            return torch.stack(
                [method.predict_from(f[i], logits[i], gs, c.state) for i, c in enumerate(part)]
            )
        return logits.argmax(dim=-1)

    @staticmethod
    def _rows(store: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
        """Rows of store tensors: views when contiguous, gathered copies otherwise."""
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return {n: t[rows[0] : rows[0] + len(rows)] for n, t in store.items()}
        idx = torch.tensor(rows, device=next(iter(store.values())).device)
        return {n: t.index_select(0, idx) for n, t in store.items()}

    def evaluate(
        self, sample: bool = False, clients: Sequence[Client] | None = None
    ) -> dict[str, float]:
        """:meth:`Simulation.evaluate` (every client's accuracy on its domain's test set, or on
        its fixed subsample; ``clients``: theirs only), with the clients that share a test set
        predicted together (see :meth:`predict_many`)."""
        sim = self.sim
        clients = sim.clients if clients is None else clients
        groups: dict[int, list[Client]] = {}
        for c in clients:
            c.model.eval()
            groups.setdefault(id(c.data.test_z), []).append(c)
        acc: dict[str, float] = {}
        for members in groups.values():
            z, y = sim.test_set(members[0], sample)
            if len(y) == 0:
                for c in members:
                    acc[c.data.name] = 0.0
                continue
            pred = self.predict_many(members, z)
            correct = (pred == y.unsqueeze(0)).sum(dim=1).tolist()
            for c, n_ok in zip(members, correct):
                acc[c.data.name] = n_ok / len(y)
        return {c.data.name: acc[c.data.name] for c in clients}

    def evaluate_holdout(self, clients: Sequence[Client] | None = None) -> float | None:
        """:meth:`Simulation.evaluate_holdout` (mean accuracy of all clients, or of
        ``clients``, on the held-out domain), batched."""
        sim = self.sim
        if sim.data.holdout is None:
            return None
        _, z, y = sim.data.holdout
        clients = sim.clients if clients is None else clients
        for c in clients:
            c.model.eval()
        pred = self.predict_many(clients, z)
        accs = ((pred == y.unsqueeze(0)).sum(dim=1).double() / max(len(y), 1)).tolist()
        return float(sum(accs) / len(accs))
