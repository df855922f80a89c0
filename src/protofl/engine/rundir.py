"""Run folders that cannot be silently changed or shared: atomic names, a lock, a run record.

* :func:`claim_dir` creates ``<root>/<stem>`` (or ``<stem>-1``, ``-2`` ...) with one atomic
  ``mkdir``, so two processes starting at the same instant never get the same folder.
* :class:`FolderLock` is an OS file lock (``fcntl.flock``) on ``<folder>/.lock`` holding the
  owner's pid: one process at a time runs in a run folder or a sweep folder; a second one is
  refused with a message that names the holder.
* :func:`write_record` stores, at creation, what the run *is* (``run-record.json``: the config
  schema version, the engine and the full config). :func:`check_resume` compares the config a
  resume is asked to continue (``config.yaml``, which a person may have edited) with that record
  and refuses any difference in a key that can change results or privacy, naming the keys and
  both values.
* :func:`add_extension` / :func:`read_extensions`: ``extensions.json``, the record of every
  explicit extension of a finished run (``protofl extend``): how many rounds it added and the
  epsilon the accountant composes for all releases at the calibrated noise.  The run record
  and ``config.yaml`` stay what the run was calibrated for; :func:`target_rounds` is how many
  rounds the run now has to reach.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from protofl.config import CONFIG_SCHEMA, ConfigError, ExperimentConfig

RECORD = "run-record.json"
EXTENSIONS = "extensions.json"
LOCK = ".lock"

RESULT_FREE_KEYS = (
    "run.out_dir",
    "run.progress",
    "run.threads",
    "run.tensorboard",
    "run.save_releases",
    "run.headline",
    "run.client_state",
    "run.memory_budget_mb",
    "federation.checkpoint",
    "federation.checkpoint_every",
)
"""Keys a resume may change: where files go, progress display, threads, checkpoint cadence,
which accuracy is the headline, where client state lives and the batched working memory (the
results are the same either way)."""


class LockError(RuntimeError):
    """The folder is owned by another live process."""


def claim_dir(root: Path, stem: str) -> Path:
    """Create and return a new folder ``root/stem`` (``stem-1``, ... if taken), atomically."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(10_000):
        path = root / (stem if i == 0 else f"{stem}-{i}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise RuntimeError(f"{root}: no free folder name for {stem!r}")


class FolderLock:
    """Exclusive, non-blocking OS lock on ``folder/.lock`` (released when the process ends)."""

    def __init__(self, folder: Path, what: str = "folder") -> None:
        self.path = Path(folder) / LOCK
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise :class:`LockError` naming the holder's pid."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise LockError(
                f"{self.path.parent} is in use by process {holder} (another {self.what} is "
                "running there); wait for it to finish or stop it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (the file stays; a stale one is harmless: the OS lock is what counts)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def write_record(run_dir: Path, config: ExperimentConfig, *, engine: str = "sim") -> None:
    """What the run is, written once at creation (never rewritten by a resume)."""
    record = {"schema": CONFIG_SCHEMA, "engine": engine, "config": config.to_dict()}
    (run_dir / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def read_record(run_dir: Path) -> dict[str, Any] | None:
    """The run record, or None for a folder made before records existed."""
    path = run_dir / RECORD
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is unreadable ({exc}); the run cannot be resumed") from None
    if not isinstance(data, dict) or "config" not in data:
        raise ConfigError(f"{path} is not a run record; the run cannot be resumed")
    return data


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (mappings only; lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _with_defaults(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with the sections and keys it lacks taken from ``defaults``."""
    out = dict(defaults)
    for key, value in values.items():
        below = defaults.get(key)
        if isinstance(value, Mapping) and isinstance(below, Mapping):
            value = _with_defaults(value, below)
        out[key] = value
    return out


def check_resume(run_dir: Path, config: ExperimentConfig, *, engine: str = "sim") -> None:
    """Refuse to resume ``run_dir`` with ``config`` unless it is the run that was started there
    (up to :data:`RESULT_FREE_KEYS`), on the same engine and config schema."""
    record = read_record(run_dir)
    if record is None:
        return
    if record.get("schema") != CONFIG_SCHEMA:
        raise ConfigError(
            f"{run_dir}: made with config schema {record.get('schema')}, this protofl reads "
            f"schema {CONFIG_SCHEMA}; resume it with the protofl version that started it"
        )
    made_by = record.get("engine", "sim")
    if made_by != engine:
        raise ConfigError(
            f"{run_dir}: this run was made by the {made_by!r} engine and resumes only on it; "
            f"resuming it on the {engine!r} engine would change what the run was"
        )
    # a key the record lacks was added to protofl after the run started: its default is what
    # the run used (a new key's default keeps the old behaviour)
    old = flatten(_with_defaults(record["config"], ExperimentConfig().to_dict()))
    new = flatten(config.to_dict())
    changed = sorted(
        k for k in set(old) | set(new) if old.get(k) != new.get(k) and k not in RESULT_FREE_KEYS
    )
    if changed:
        detail = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
        raise ConfigError(
            f"{run_dir}/config.yaml differs from the run that was started there ({detail}); a "
            "resume never changes what a run was: undo the edit, or start a new run (only "
            + ", ".join(RESULT_FREE_KEYS)
            + " may change)"
        )


def record_engine(run_dir: Path) -> str:
    """The engine that made ``run_dir`` (``sim`` for a folder made before records existed)."""
    record = read_record(run_dir)
    return "sim" if record is None else str(record.get("engine", "sim"))


def read_extensions(run_dir: Path) -> list[dict[str, Any]]:
    """The extensions of ``run_dir`` in order (empty: the run has its configured rounds)."""
    path = run_dir / EXTENSIONS
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is unreadable ({exc}); the run cannot be continued") from None
    items = data.get("extensions") if isinstance(data, dict) else None
    if not isinstance(items, list) or not all(
        isinstance(e, dict) and isinstance(e.get("rounds"), int) and e["rounds"] >= 1 for e in items
    ):
        raise ConfigError(f"{path} is not an extension record; the run cannot be continued")
    return items


def target_rounds(run_dir: Path, config: ExperimentConfig) -> int:
    """Rounds the run in ``run_dir`` has to reach: the configured ones plus every extension."""
    return config.federation.rounds + sum(int(e["rounds"]) for e in read_extensions(run_dir))


def add_extension(run_dir: Path, entry: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Append one extension to ``extensions.json`` (written atomically); returns them all."""
    from protofl.data.cache import atomic_write_bytes

    items = [*read_extensions(run_dir), dict(entry)]
    text = json.dumps({"extensions": items}, indent=1, sort_keys=True) + "\n"
    atomic_write_bytes(run_dir / EXTENSIONS, text.encode())
    return items
