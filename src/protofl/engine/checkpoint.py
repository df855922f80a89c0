"""Atomic, checksummed per-round checkpoints; the latest ``keep`` are kept (both engines:
``federation.keep_checkpoints``, default 1), a corrupt one is refused."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from protofl.data.cache import atomic_write_bytes

log = logging.getLogger(__name__)

INDEX = "checkpoints.json"
KEEP = 2
"""How many checkpoints a caller that names none keeps; both engines (the simulator and the
Flower server) pass ``federation.keep_checkpoints`` (default 1; 0: all)."""
CHUNK = 16 * 2**20
"""A checkpoint's digest is the sha256 of the sha256s of its CHUNK-byte pieces (``sha256_tree``
in the index), so that the pieces are hashed on several cores, as they are written and when
they are checked; an index entry with a plain ``sha256`` (written before) is checked as such."""
PARALLEL_MIN = 2**20  # a write this large is hashed on the pool while it goes to the file


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class CheckpointError(RuntimeError):
    """No usable checkpoint: the message says which files were tried and why they failed."""


def save_checkpoint(
    run_dir: Path, round_index: int, state: dict[str, Any], *, keep: int = KEEP
) -> Path:
    """Write ``checkpoint-<round>.pt`` (temp file, fsync, rename), then update the index, then
    delete what is past the latest ``keep`` (0: keep all).

    The state is streamed to the file, never assembled in memory (with
    ``run.client_state=disk`` the clients' tensors are read from their mapped store as they
    are written), and hashed as it is written (one pass, no read-back).  The file has mode
    0600 from creation (``mkstemp``) to the end: a checkpoint holds the clients' models and
    state.  The order (new file, index naming it, then deletions) means a crash at any point
    leaves at least one checkpoint the index lists and that passes its check."""
    path = run_dir / f"checkpoint-{round_index:04d}.pt"
    run_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{path.name}.", suffix=".tmp")
    chunk = CHUNK
    try:
        with os.fdopen(fd, "wb") as fh, ThreadPoolExecutor(_workers()) as pool:
            hashing = _HashingWriter(fh, pool, chunk)
            torch.save(state, hashing)  # type: ignore[arg-type]  # write() and flush() suffice
            fh.flush()
            os.fsync(fh.fileno())
        digest, size = hashing.hexdigest(), hashing.size
        os.chmod(tmp, 0o600)  # mkstemp's mode, whatever the umask: client state
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    index = [e for e in _read_index(run_dir) if e.get("file") != path.name]
    index.append(
        {
            "round": round_index,
            "file": path.name,
            "sha256_tree": digest,
            "chunk": chunk,
            "bytes": size,
        }
    )
    kept = index[-keep:] if keep > 0 else index
    atomic_write_bytes(run_dir / INDEX, json.dumps(kept, indent=1).encode())
    # only now that the index names the new file: the dropped ones, and strays a crash left
    # (a file the index never named, a temp file).  Unlinking a 2 GB file takes ~1 s: each is
    # renamed out of the way (atomic, instant) and unlinked by a background thread
    names = {e["file"] for e in kept}
    doomed = []
    for stray in [*run_dir.glob("checkpoint-*.pt"), *run_dir.glob(".checkpoint-*.tmp")]:
        if stray.name not in names:
            gone = stray.with_name(f".{stray.name.lstrip('.')}.{os.getpid()}.deleted")
            with contextlib.suppress(FileNotFoundError):
                os.replace(stray, gone)
                doomed.append(gone)
    doomed += [p for p in run_dir.glob(".checkpoint-*.deleted") if p not in doomed]
    if doomed:
        thread = threading.Thread(target=_unlink_all, args=(doomed,), daemon=True)
        thread.start()
        _DELETIONS.append(thread)
    return path


_DELETIONS: list[threading.Thread] = []


def _unlink_all(paths: list[Path]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)


def wait_for_deletions() -> None:
    """Wait until the dropped checkpoints are unlinked (the end of a run)."""
    while _DELETIONS:
        _DELETIONS.pop().join()


class _HashingWriter:
    """A write-only file object that writes to ``fh`` and hashes what passes through it, piece
    by piece (:data:`CHUNK`): a large write's pieces are hashed on ``pool`` while this thread
    writes it (``hashlib`` releases the GIL), so hashing adds little to the write."""

    def __init__(self, fh: Any, pool: ThreadPoolExecutor, chunk: int) -> None:
        self._fh = fh
        self._pool = pool
        self._chunk = chunk
        self._pieces: list[Any] = []  # one sha256 per piece, in order
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n, pos, work = len(view), 0, []
        while pos < n:
            k, offset = divmod(self.size + pos, self._chunk)
            if k == len(self._pieces):
                self._pieces.append(hashlib.sha256())
            take = min(n - pos, self._chunk - offset)
            work.append((self._pieces[k], view[pos : pos + take]))
            pos += take
        if n < PARALLEL_MIN:
            for piece, part in work:
                piece.update(part)
            self._fh.write(view)
        else:  # each piece gets one part of this write: the updates are independent
            futures: list[Future[None]] = [self._pool.submit(p.update, part) for p, part in work]
            self._fh.write(view)
            for f in futures:
                f.result()
        self.size += n
        return n

    def hexdigest(self) -> str:
        return _combine(p.digest() for p in self._pieces)

    def flush(self) -> None:
        self._fh.flush()


def checkpoint_bytes(run_dir: Path) -> int | None:
    """The size of the newest checkpoint the index lists (None: none yet)."""
    index = _read_index(run_dir)
    return int(index[-1]["bytes"]) if index else None


def _sha256(path: Path, chunk: int = 8 * 2**20) -> tuple[str, int]:
    """sha256 hex digest and size of a file, read in chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def _combine(digests: Any) -> str:
    top = hashlib.sha256()
    for d in digests:
        top.update(d)
    return top.hexdigest()


def _tree_sha256(path: Path, chunk: int) -> str:
    """:class:`_HashingWriter`'s digest of a file: its pieces read in order, hashed on a pool
    (at most two pieces a worker in memory)."""
    workers = _workers()
    digests: list[bytes] = []
    pending: list[Future[bytes]] = []
    with open(path, "rb") as fh, ThreadPoolExecutor(workers) as pool:
        while block := fh.read(chunk):
            pending.append(pool.submit(lambda b: hashlib.sha256(b).digest(), block))
            if len(pending) >= 2 * workers:
                digests.append(pending.pop(0).result())
        digests.extend(f.result() for f in pending)
    return _combine(digests)


def _intact(path: Path, entry: dict[str, Any]) -> bool:
    """Whether ``path`` has the digest its index entry records (either form)."""
    if "sha256_tree" in entry:
        return _tree_sha256(path, int(entry["chunk"])) == entry["sha256_tree"]
    return _sha256(path)[0] == entry.get("sha256")


def _read_index(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / INDEX
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc})") from None
    return list(data) if isinstance(data, list) else []


def load_latest_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The newest checkpoint that passes its integrity check (falling back to the previous).

    Returns None when the run has no checkpoint yet (it restarts from round 0).
    """
    index = _read_index(run_dir)
    problems = []
    for entry in reversed(index):
        path = run_dir / entry["file"]
        if not path.exists():
            problems.append(f"{path}: missing")
            continue
        if not _intact(path, entry):
            problems.append(f"{path}: fails its sha256 integrity check")
            log.error("checkpoint %s fails its integrity check; trying the previous one", path)
            continue
        # mapped, not read into memory: loading copies each tensor where it belongs
        state: dict[str, Any] = torch.load(path, weights_only=True, mmap=True)
        if problems:
            log.warning("resuming from %s after refusing: %s", path, "; ".join(problems))
        return state
    if index:
        raise CheckpointError(
            "no usable checkpoint in " + str(run_dir) + ": " + "; ".join(problems)
        )
    return None


def latest_checkpoint_round(run_dir: Path) -> int | None:
    """The round of the newest checkpoint the index lists (None: none yet)."""
    rounds = [int(e["round"]) for e in _read_index(run_dir) if (run_dir / e["file"]).exists()]
    return max(rounds) if rounds else None
