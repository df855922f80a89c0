"""The memory of batched training: every client's trainable tensors as row views of one stacked
tensor per name (:class:`_Store`, in memory or memory-mapped with page-level prefetch and drop),
one shared copy of identical frozen parameters (:class:`FrozenParameterPool`,
:class:`FrozenProjections`) and the malloc trim after large frees.  The trainer that computes
on it is :mod:`protofl.engine.batched`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import sys
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from protofl.engine.client import Client


def _optimizer_kind(opt: torch.optim.Optimizer) -> str | None:
    """``adamw`` or ``sgd`` for the two optimizers the trainer applies itself, else None."""
    return {torch.optim.AdamW: "adamw", torch.optim.SGD: "sgd"}.get(type(opt))


# --------------------------------------------------------------------------------------------
# memory: frozen parameters shared by all clients
# --------------------------------------------------------------------------------------------
def release_free_memory() -> None:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim``; elsewhere a no-op).

    Building a thousand client models allocates and, once their frozen projection is pooled,
    frees ~2.6 MB per client between smaller allocations that pin the heap; glibc keeps that
    memory (measured: 3.05 GB resident after building 1000 clients instead of 1.2 GB).  Trimming
    after such batches of frees keeps the resident set, and so the peak, at what is in use.
    """
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        _MALLOC_TRIM = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                _MALLOC_TRIM = libc.malloc_trim
            except (OSError, AttributeError):  # pragma: no cover - not glibc
                _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM: Any = None


class FrozenParameterPool:
    """Makes identical frozen parameters of many client models one shared tensor.

    Homogeneous clients start from the same generator state, so with
    ``backbone.train_projection: false`` every client's projection is the same frozen
    ``[proto_dim, in_dim]`` matrix (2.6 MB at 1280 -> 512).  :meth:`share` swaps a model's frozen
    parameters for the pool's copy when the values are equal, so 1000 clients hold one.  Values
    are compared exactly; differing ones are left alone.  Safe for every engine path: frozen
    parameters are never updated in place (``load_state_dict`` writes the same values back).
    """

    TRIM_EVERY = 64 * 2**20  # bytes freed between two heap trims

    def __init__(self) -> None:
        self._pool: dict[tuple[str, tuple[int, ...], torch.dtype], nn.Parameter] = {}
        self.shared_bytes = 0
        self._untrimmed = 0

    def share(self, model: nn.Module) -> None:
        """Point ``model``'s frozen parameters at the pooled ones (first sighting: pool it)."""
        self._untrimmed += self._share(model)
        if self._untrimmed >= self.TRIM_EVERY:
            release_free_memory()
            self._untrimmed = 0

    def _share(self, model: nn.Module) -> int:
        freed = 0
        for mod_name, module in model.named_modules():
            for p_name, p in list(module._parameters.items()):
                if p is None or p.requires_grad:
                    continue
                key = (f"{mod_name}.{p_name}", tuple(p.shape), p.dtype)
                pooled = self._pool.get(key)
                if pooled is None:
                    self._pool[key] = p
                elif pooled is not p and torch.equal(pooled, p):
                    module._parameters[p_name] = pooled
                    freed += p.numel() * p.element_size()
        self.shared_bytes += freed
        return freed


class FrozenProjections:
    """The frozen projections of a store's clients (``backbone.train_projection: false``):
    each distinct ``(weight, bias)`` once, which one each client holds, and per projection the
    cache of ``proj(z)`` of the evaluation inputs.

    A plain run's clients hold one projection (pooled by :class:`FrozenParameterPool`); a fused
    group holds one per seed.  Each is applied as one ``F.linear`` over all rows of the clients
    that hold it (one product instead of a per-client ``bmm``), and evaluation re-associates
    ``proj(z + U h) = proj(z) + (P U) h`` with ``proj(z)`` cached per projection and input set.
    """

    MAX = 64  # more distinct projections than this: each client's own (stacked products)

    def __init__(self, table: list[tuple[torch.Tensor, torch.Tensor]], of: dict[int, int]):
        self.table = table
        self.of = of  # client id -> index into table
        self._y0: dict[tuple[int, int], tuple[torch.Tensor, tuple[int, ...], torch.Tensor]] = {}

    @classmethod
    def of_clients(cls, clients: Sequence[Client]) -> FrozenProjections | None:
        """The table of ``clients``' frozen projections; None when there are more than
        :attr:`MAX` distinct ones."""
        table: list[tuple[torch.Tensor, torch.Tensor]] = []
        of: dict[int, int] = {}
        for c in clients:
            w, b = c.model.proj.weight, c.model.proj.bias
            # the pooled tensors themselves first (no comparison of values)
            j = next((i for i, (u, v) in enumerate(table) if u is w and v is b), None)
            if j is None:
                j = next(
                    (
                        i
                        for i, (u, v) in enumerate(table)
                        if torch.equal(u, w) and torch.equal(v, b)
                    ),
                    None,
                )
            if j is None:
                if len(table) == cls.MAX:
                    return None
                j = len(table)
                table.append((w, b))  # frozen: requires_grad is False
            of[c.data.client] = j
        return cls(table, of)

    def which(self, clients: Sequence[Client]) -> list[int]:
        """Each client's projection (index into :attr:`table`)."""
        return [self.of[c.data.client] for c in clients]

    @staticmethod
    def _split(which: Sequence[int], device: torch.device) -> list[tuple[int, torch.Tensor]]:
        """``(projection, positions holding it)`` for each distinct projection of ``which``."""
        return [
            (j, torch.tensor([i for i, x in enumerate(which) if x == j], device=device))
            for j in sorted(set(which))
        ]

    def apply(self, a: torch.Tensor, which: Sequence[int]) -> torch.Tensor:
        """``proj_j(a[i])`` for each client ``i`` of ``a`` [k, n, d_in], ``j = which[i]``:
        one ``F.linear`` per distinct projection (differentiable in ``a``)."""
        if len(set(which)) == 1:
            return F.linear(a, *self.table[which[0]])
        split = self._split(which, a.device)
        parts = [F.linear(a.index_select(0, idx), *self.table[j]) for j, idx in split]
        order = torch.cat([idx for _, idx in split])
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order), device=a.device)
        return torch.cat(parts).index_select(0, back)

    def times_up(self, u: torch.Tensor, which: Sequence[int]) -> torch.Tensor:
        """``P_j U_i`` [k, d, H] for the adapters' up-projections ``u`` [k, d_in, H]."""
        if len(set(which)) == 1:
            return torch.matmul(self.table[which[0]][0], u)
        out = u.new_empty(u.shape[0], self.table[which[0]][0].shape[0], u.shape[2])
        for j, idx in self._split(which, u.device):
            out[idx] = torch.matmul(self.table[j][0], u.index_select(0, idx))
        return out

    def grad_up(self, g_pu: torch.Tensor, which: Sequence[int], out: torch.Tensor) -> None:
        """``out`` [k, d_in, H] = ``P_j^T g_pu_i`` (the gradient of ``U`` from that of ``P U``)."""
        if len(set(which)) == 1:
            torch.matmul(self.table[which[0]][0].T, g_pu, out=out)
            return
        for j, idx in self._split(which, g_pu.device):
            out.index_copy_(0, idx, torch.matmul(self.table[j][0].T, g_pu.index_select(0, idx)))

    def cached(self, z: torch.Tensor, j: int) -> torch.Tensor:
        """``proj_j(z)``, cached per input tensor and projection (kept alive with it, so the
        key cannot be reused; any in-place change invalidates it)."""
        hit = self._y0.get((id(z), j))
        if hit is None or hit[0] is not z or hit[1] != self._stamp(z, j):
            hit = (z, self._stamp(z, j), self.project(z, j))
            self._y0[(id(z), j)] = hit
        return hit[2]

    def project(self, z: torch.Tensor, j: int) -> torch.Tensor:
        """``proj_j(z)`` of inputs ``z`` [n, d_in] (not cached)."""
        w, b = self.table[j]
        return F.linear(z.to(w.dtype), w, b)

    def _stamp(self, z: torch.Tensor, j: int) -> tuple[int, ...]:
        w, b = self.table[j]
        return (0 if z.is_inference() else z._version, w.data_ptr(), w._version, b._version)


# --------------------------------------------------------------------------------------------
# stacked storage: every client's trainable tensors are row views of one tensor per name
# --------------------------------------------------------------------------------------------
class _Store:
    """Parameters, AdamW moments and steps, DCR teachers of all clients, one ``[M, ...]`` tensor
    per name; each client's ``model`` parameters, ``optimizer.state`` tensors and DCR teacher
    parameters are re-pointed to their row (:meth:`adopt`), so training updates them in place
    and there is nothing to copy back.  Rows are ordered by the number of local steps (longest
    first), so a round's groups are contiguous row ranges and the clients still stepping at any
    step are a prefix of their group.

    Anything that replaces a client's tensors (``optimizer.load_state_dict`` on resume, a method
    swapping a parameter) is noticed by pointer comparison and re-adopted before training.
    Note: ``torch.save`` of ONE client's views writes the whole storage; the engine saves all
    clients in one call (one copy); save a single client's state with ``.clone()``.

    A mapped store also holds the clients' method state (``ClientState.tensors``, see
    :meth:`adopt_state`): one ``[M, *shape]`` file per key, made when the key's first value
    is adopted; a key whose values differ in shape or dtype between clients (FedPCL's local
    prototypes and their classes, one row per class the client holds) stays on the heap.
    """

    def __init__(
        self,
        names: list[str],
        shapes: dict[str, tuple[int, ...]],
        teacher_shapes: dict[str, tuple[int, ...]],
        order: Sequence[int],
        device: torch.device | None = None,
        directory: Path | None = None,
        adam: bool = True,
    ) -> None:
        m = len(order)
        dev = device or torch.device("cpu")
        self.names = names
        self.paths = [tuple(n.split(".")) for n in names]
        self.teacher_paths = [tuple(n.split(".")) for n in teacher_shapes]
        self.row = {client: r for r, client in enumerate(order)}
        # run.client_state=disk: every tensor is a file in ``directory`` mapped shared (see
        # :func:`mapped_tensor`); :meth:`page_out` drops rows from the resident set
        self.directory = directory
        if directory is not None and dev.type != "cpu":
            raise ValueError(
                f"run.client_state=disk maps client state into CPU memory, but the run computes "
                f"on {dev}; set run.device=cpu (or run.client_state=memory)"
            )

        def new(kind: str, name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if directory is None:
                return torch.empty(m, *shape, device=dev)
            return mapped_tensor(directory / f"{kind}.{name}.f32", (m, *shape))

        # uninitialised: every row is written when its client is adopted, so memory becomes
        # resident client by client (the moments only once the client first trains)
        # on run.device, with the clients' models (AdamW's step counts too: the fused kernel
        # reads them there)
        self.param = {n: new("param", n, shapes[n]) for n in names}
        self.exp_avg = {n: new("exp_avg", n, shapes[n]) for n in names}
        # AdamW's second moments and step counts (SGD keeps its momentum in exp_avg alone)
        adam_names = names if adam else []
        self.exp_avg_sq = {n: new("exp_avg_sq", n, shapes[n]) for n in adam_names}
        self.step = {n: new("step", n, ()).zero_() for n in adam_names}
        self.teacher = {n: new("teacher", n, s) for n, s in teacher_shapes.items()}
        # run.client_state=disk: the clients' method state, one mapped file per key of
        # ClientState.tensors, made when the key's first value is adopted (adopt_state)
        self.state: dict[str, torch.Tensor] = {}
        # keys whose values came in two shapes or dtypes: their values stay on the heap
        self.ragged: set[str] = set()
        # storages of the parameters, moments and teachers (a method-state value that is a
        # view of one is left as it is: it is mapped already, and it must stay that view)
        self._storages = {t.untyped_storage().data_ptr() for t in self.tensors()}
        # rows whose optimizer moments were never written: a fresh mapped file reads as zeros
        # (a hole), so a client's first adoption points its zero moments there without
        # writing them (which would dirty, write back and re-read every page before the first
        # step, 10-25% of an early 10,000-client round); in memory the rows are uninitialised
        self._unwritten: set[int] = set(range(m)) if directory is not None else set()
        # likewise rows whose parameters (and DCR teacher) were never written: a client's
        # zero tensors (a fresh adapter's up-projection, half its bytes) are pointed there as is
        self._blank: set[int] = set(range(m)) if directory is not None else set()
        # rows no gather has touched yet (see :meth:`prefetch`)
        self._cold: set[int] = set(range(m)) if directory is not None else set()

        # (first byte, bytes per row) of every store tensor: row pointers without views
        self._layout: dict[int, tuple[int, int]] = {}
        for group in (self.param, self.exp_avg, self.exp_avg_sq, self.step, self.teacher):
            for t in group.values():
                self._layout[id(t)] = (t.data_ptr(), t.stride(0) * t.element_size())

    def _ptr(self, store: torch.Tensor, r: int) -> int:
        base, row = self._layout[id(store)]
        return base + r * row

    @property
    def mapped(self) -> bool:
        """Whether the store lives in memory-mapped files (``run.client_state=disk``)."""
        return self.directory is not None

    def tensors(self) -> list[torch.Tensor]:
        """Every store tensor."""
        return [
            t
            for group in (self.param, self.exp_avg, self.exp_avg_sq, self.step, self.teacher)
            for t in group.values()
        ]

    def page_out(self, rows: Sequence[int] | None = None) -> None:
        """Drop ``rows`` (default: all) of a mapped store from this process's resident set.

        The pages stay in the files (the kernel writes dirty ones back and re-reads them on
        the next access), so nothing changes but resident memory; a no-op in memory.
        """
        if self.directory is None:
            return
        spans = _spans(sorted(rows)) if rows is not None else [(0, len(self.row))]
        for t in (*self.tensors(), *self.state.values()):
            base, row = self._layout[id(t)]
            for a, b in spans:
                drop_pages(base + a * row, base + b * row)

    # advise a mapped store's rows into the page cache before their first gather (benchmarks
    # turn it off to measure what it gains)
    PREFETCH = True

    def prefetch(self, rows: Sequence[int]) -> None:
        """Read the rows among ``rows`` that no gather has touched since the store was made
        (or reopened) into the page cache in bulk, every tensor (:func:`prefetch_pages`); a
        no-op in memory or with ``PREFETCH`` off.

        The first touch of a fresh store's pages faults them in one at a time: the first
        round of the 10,000-client benchmark spent 31 s gathering its participants' rows
        (never-written moment rows are file holes), 4 s after ``MADV_WILLNEED``; the next
        few rounds, whose participants are mostly new too, gather 1-2 s slower with the
        advice than without it; round 1 takes 18.4 s instead of 44.3 s and the 20 rounds
        235 s instead of 257 s (Linux 6.18, ext4, 2026-12-04;
        ``benchmarks/bench_m1000.py --scale m10000 [--no-prefetch]``).
        Rows gathered once are not advised again (their pages are in the page cache or were
        written back; the kernel's own read-around serves them).
        """
        if self.directory is None or not self.PREFETCH:
            return
        cold = sorted(r for r in rows if r in self._cold)
        if not cold:
            return
        self._cold.difference_update(cold)
        spans = _spans(cold)
        for t in self.tensors():
            base, row = self._layout[id(t)]
            # one call per run of pages: rows of small tensors share pages
            start, stop = base + spans[0][0] * row, base + spans[0][1] * row
            for a, b in spans[1:]:
                if base + a * row - stop > _PAGE:
                    prefetch_pages(start, stop)
                    start = base + a * row
                stop = base + b * row
            prefetch_pages(start, stop)

    @staticmethod
    def _get(module: nn.Module, path: tuple[str, ...]) -> Any:
        """``module.get_parameter`` without its string handling (plain dict lookups)."""
        for name in path[:-1]:
            module = module._modules[name]  # type: ignore[assignment]
        return module._parameters[path[-1]]

    def _point(self, t: torch.Tensor, store: torch.Tensor, r: int, blank: bool = False) -> int:
        """Copy ``t`` into row ``r`` of ``store`` and point ``t`` at it, unless it already is;
        returns the bytes moved.  ``blank``: the row was never written (it reads as zeros), so
        an all-zero ``t`` is pointed there without writing."""
        if t.data_ptr() == self._ptr(store, r) and t.shape == store.shape[1:]:
            return 0
        view = store[r]
        if blank and not bool(t.detach().any()):
            t.data = view
            return 0
        with torch.no_grad():
            view.copy_(t.detach())
        t.data = view
        return t.numel() * t.element_size()

    def adopt(self, c: Client, *, optimizer: bool = True) -> int:
        """Point ``c``'s trainable tensors at its rows (copying their current values); with
        ``optimizer`` also its AdamW state (created, as AdamW would, if it has none yet) or
        its SGD momentum buffer (in the ``exp_avg`` rows; zero before the first step, which
        dampening-free SGD treats exactly as a missing buffer).  Fresh state is zeroed in its
        rows unless no state has held them yet in a mapped store (they read as zeros).
        Returns the bytes written into the store (copied tensors' old storage is now free);
        0 when the client already points at its rows."""
        r = self.row[c.data.client]
        model = c.model
        moved = 0
        state = c.optimizer.state
        sgd = _optimizer_kind(c.optimizer) == "sgd"
        momentum = float(c.optimizer.param_groups[0].get("momentum", 0.0)) if sgd else 0.0
        zero = r not in self._unwritten  # the moment rows may hold another state's values
        blank = r in self._blank
        self._blank.discard(r)
        for n, path in zip(self.names, self.paths):
            p = self._get(model, path)
            moved += self._point(p, self.param[n], r, blank)
            if not optimizer:
                continue
            if sgd:
                if momentum != 0.0:
                    moved += self._adopt_buffer(state, p, self.exp_avg[n], r, zero)
                continue
            st = state.get(p)
            if not st:  # never stepped: AdamW's own initial state, here in the store
                st = state[p]
                for key, store in (
                    ("step", self.step),
                    ("exp_avg", self.exp_avg),
                    ("exp_avg_sq", self.exp_avg_sq),
                ):
                    moved += self._zeroed(store[n][r], zero)
                    st[key] = store[n][r]
                continue
            for key, store in (
                ("step", self.step),
                ("exp_avg", self.exp_avg),
                ("exp_avg_sq", self.exp_avg_sq),
            ):
                value = st[key]
                if value.data_ptr() != self._ptr(store[n], r):
                    view = store[n][r]
                    view.copy_(value.detach().reshape(view.shape).to(view.dtype))
                    st[key] = view
                    moved += value.numel() * value.element_size()
        if optimizer:
            self._unwritten.discard(r)
        if c.dcr is not None:
            for n, path in zip(self.teacher, self.teacher_paths):
                moved += self._point(self._get(c.dcr.teacher, path), self.teacher[n], r, blank)
        return moved

    def _adopt_buffer(
        self, state: Any, p: torch.Tensor, store: torch.Tensor, r: int, zero: bool = True
    ) -> int:
        """SGD's ``momentum_buffer`` of ``p`` in row ``r`` of ``store`` (zeroed when SGD has
        none yet, unless the row is known unwritten: ``zero`` false); the bytes written."""
        st = state[p]
        view = store[r]
        buf = st.get("momentum_buffer")
        if buf is not None and buf.data_ptr() == self._ptr(store, r):
            return 0
        st["momentum_buffer"] = view
        if buf is None:
            return self._zeroed(view, zero)
        view.copy_(buf.detach().reshape(view.shape).to(view.dtype))
        return view.numel() * view.element_size()

    @staticmethod
    def _zeroed(view: torch.Tensor, zero: bool) -> int:
        """A fresh optimizer state's row: zeroed, unless ``zero`` is false (a mapped row no
        state has held yet reads as zeros; writing it would only dirty its pages); the bytes
        written."""
        if not zero:
            return 0
        view.zero_()
        return view.numel() * view.element_size()

    def adopt_all(self, clients: Sequence[Client], *, optimizer: bool = True) -> None:
        """:meth:`adopt` every client; give the freed memory back when much was written."""
        moved = 0
        for c in clients:
            wrote = self.adopt(c, optimizer=optimizer)
            moved += wrote
            if wrote and self.directory is not None:  # what adopting wrote leaves RSS
                self.page_out([self.row[c.data.client]])
        if moved >= FrozenParameterPool.TRIM_EVERY:
            release_free_memory()

    # ----- method state (run.client_state=disk) ------------------------------------------------
    def _state_file(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The mapped ``[M, *shape]`` file of method-state ``key``, shaped like ``like``."""
        assert self.directory is not None
        dtype = str(like.dtype).removeprefix("torch.")
        path = self.directory / f"state.{urllib.parse.quote(key, safe='')}.{dtype}"
        t = mapped_tensor(path, (len(self.row), *like.shape), like.dtype)
        self._layout[id(t)] = (t.data_ptr(), t.stride(0) * t.element_size())
        self.state[key] = t
        return t

    def _holds(self, t: torch.Tensor | None, file: torch.Tensor, r: int) -> bool:
        """Whether ``t`` is row ``r`` of the method-state ``file``."""
        return (
            t is not None
            and t.dtype == file.dtype
            and t.shape == file.shape[1:]
            and t.data_ptr() == self._ptr(file, r)
            and t.is_contiguous()
        )

    def adopt_state(self, c: Client) -> int:
        """Copy each of ``c``'s method-state tensors into its row of the key's mapped file and
        point the entry at that row (a view: nothing of it stays on the heap, and
        :meth:`page_out` drops it from the resident set); a mapped store only.  A key's file is
        made (sparse) when its first value is adopted, shaped like it.  Stay on the heap as
        they are: the values of a key once one came in another shape or dtype than its file's
        (a per-client number of rows: FedPCL's local prototypes and their classes; values
        already in the file stay there until the method replaces them), a value that is
        empty, on another device or needs a gradient, and a view of the client's parameters
        (mapped already).  The bytes written (0 when every entry already is its row)."""
        if self.directory is None:
            return 0
        r = self.row[c.data.client]
        tensors = c.state.tensors
        moved = 0
        for key, t in list(tensors.items()):
            if t.numel() == 0 or t.requires_grad or t.device.type != "cpu" or t.is_sparse:
                continue
            if key in self.ragged or t.untyped_storage().data_ptr() in self._storages:
                continue
            file = self.state.get(key)
            if file is None:
                file = self._state_file(key, t)
            if t.dtype != file.dtype or t.shape != file.shape[1:]:
                self.ragged.add(key)  # differs across clients: on the heap from now on
                continue
            if self._holds(t, file, r):
                continue
            view = file[r]
            view.copy_(t)
            tensors[key] = view
            moved += t.numel() * t.element_size()
        return moved

    def adopt_state_all(self, clients: Sequence[Client]) -> None:
        """:meth:`adopt_state` every client, dropping what it wrote from the resident set and
        giving the freed heap back when much was written."""
        if self.directory is None:
            return
        moved = 0
        for c in clients:
            wrote = self.adopt_state(c)
            moved += wrote
            if wrote:
                self.page_out([self.row[c.data.client]])
        if moved >= FrozenParameterPool.TRIM_EVERY:
            release_free_memory()

    def state_checkpoint(self, clients: Sequence[Client]) -> list[dict[str, torch.Tensor]]:
        """Each client's method state as a checkpoint holds it (``clients``: every client of
        the store).  ``torch.save`` writes the whole storage of a view, once per call: a key's
        file whose every row is a client's entry is saved as those views (the file once, as
        the parameters are); the rows of a key only some clients hold are first gathered into
        one compact tensor (a transient copy of those rows), so a checkpoint never holds rows
        no client uses and is the size of the in-memory run's."""
        out = [dict(c.state.tensors) for c in clients]
        for key, file in self.state.items():
            held = [
                (i, r)
                for i, c in enumerate(clients)
                if self._holds(c.state.tensors.get(key), file, r := self.row[c.data.client])
            ]
            if not held or len(held) == file.shape[0]:
                continue
            packed = file.index_select(0, torch.tensor([r for _, r in held]))
            for j, (i, _) in enumerate(held):
                out[i][key] = packed[j]
        return out


def mapped_tensor(
    path: Path, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` (float32 by default) held in the file ``path``
    (created sparse, zero-filled), mapped shared: writes go to the file's pages, which the
    kernel may write back and evict; :func:`drop_pages` takes pages out of the process's
    resident set."""
    n = math.prod(shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(n * torch.empty((), dtype=dtype).element_size())
    return torch.from_file(str(path), shared=True, size=n, dtype=dtype).view(shape)


_MADV_WILLNEED = 3
_MADV_DONTNEED = 4
_PAGE = 4096
_MADVISE: Any = None


def _madvise_fn() -> Any:
    """libc's ``madvise`` (and the page size in ``_PAGE``), resolved once; False off Linux."""
    global _MADVISE, _PAGE
    if _MADVISE is None:
        _MADVISE = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                fn = libc.madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
                _MADVISE = fn
                _PAGE = int(os.sysconf("SC_PAGE_SIZE"))
            except (OSError, AttributeError, ValueError):  # pragma: no cover - not glibc
                _MADVISE = False
    return _MADVISE


def drop_pages(start: int, stop: int) -> None:
    """``madvise(MADV_DONTNEED)`` on the whole pages in ``[start, stop)`` of a shared file
    mapping: they leave the resident set and are re-read from the page cache or the file on
    the next access (for a shared mapping no data is lost).  A no-op off Linux."""
    fn = _madvise_fn()
    a, b = -(-start // _PAGE) * _PAGE, (stop // _PAGE) * _PAGE
    if fn and b > a:
        fn(a, b - a, _MADV_DONTNEED)


def prefetch_pages(start: int, stop: int) -> None:
    """``madvise(MADV_WILLNEED)`` on the pages overlapping ``[start, stop)`` of a shared file
    mapping: the kernel reads them into the page cache in bulk (a hole's pages zero-filled),
    so that touching them costs minor faults only.  Advice: nothing changes but timing.  A
    no-op off Linux."""
    fn = _madvise_fn()
    a, b = (start // _PAGE) * _PAGE, -(-stop // _PAGE) * _PAGE
    if fn and b > a:
        fn(a, b - a, _MADV_WILLNEED)


def _spans(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted row indices as ``[a, b)`` runs."""
    out: list[tuple[int, int]] = []
    for r in rows:
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


def _runs(values: Sequence[Any], live: Sequence[bool] | None = None) -> list[tuple[int, int]]:
    """``[a, b)`` runs of equal consecutive ``values``, over the rows where ``live`` (default:
    every row)."""
    out: list[tuple[int, int]] = []
    start: int | None = None
    for i in range(len(values) + 1):
        on = i < len(values) and (live is None or bool(live[i]))
        if start is not None and (not on or values[i] != values[start]):
            out.append((start, i))
            start = None
        if on and start is None:
            start = i
    return out
