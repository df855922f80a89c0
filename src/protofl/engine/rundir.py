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
* The run folder is **the server's view** (what a server-side reader may be given); what only
  the clients' side holds goes to the **client-local folder** :func:`client_local_dir`,
  ``<run_dir>.client-local/`` *beside* the run folder (mode 0700, its files 0600), so handing
  someone the run folder never hands them client-local data: the local-only fields of every
  round (:data:`~protofl.engine.round.LOCAL_ONLY_FIELDS`, ``diagnostics.jsonl``), the client
  models and training indices (``client-artifacts.pt``) and the summary's local-only facts
  (``client-summary.json``).  :func:`append_round` / :func:`rewrite_rounds` split a metrics row
  between ``metrics.jsonl`` and ``diagnostics.jsonl``, :func:`write_summary` a summary between
  ``summary.json`` and ``client-summary.json``; :func:`read_rounds` joins them again for the
  experimenter's readers (a run made before the split has everything in ``metrics.jsonl``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import signal
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from protofl.config import CONFIG_SCHEMA, ConfigError, ExperimentConfig

RECORD = "run-record.json"
EXTENSIONS = "extensions.json"
LOCK = ".lock"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CLIENT_LOCAL_SUFFIX = ".client-local"
DIAGNOSTICS = "diagnostics.jsonl"
CLIENT_ARTIFACTS = "client-artifacts.pt"
CLIENT_SUMMARY = "client-summary.json"
SUMMARY_LOCAL_FIELDS = ("final_train_loss", "privacy.partition_overlap")
"""Summary fields computed on clients' private data outside any mechanism (the last round's
training loss, VPP's partition overlap): ``client-summary.json``, never ``summary.json``."""

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
    "federation.keep_checkpoints",
    "run.disk_warn_gb",
)
"""Keys a resume may change: where files go, progress display, threads, checkpoint cadence,
which accuracy is the headline, where client state lives and the batched working memory (the
results are the same either way)."""


def resume_command(run_dir: str | Path) -> str:
    """The exact command that continues ``run_dir`` (quoted for a POSIX shell)."""
    return f"protofl run --resume {shlex.quote(str(run_dir))}"


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


# ----- the client-local folder: what a server-side reader is never given ---------------------
def client_local_dir(run_dir: str | Path) -> Path:
    """``<run_dir>.client-local``: the clients' side of a run, beside (never inside) it."""
    run_dir = Path(run_dir)
    return run_dir.with_name(run_dir.name + CLIENT_LOCAL_SUFFIX)


def open_client_local(run_dir: str | Path) -> Path:
    """Create (or tighten) the client-local folder of ``run_dir`` with mode 0700; returns it."""
    path = client_local_dir(run_dir)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def write_private(path: Path, write: Callable[[Any], Any]) -> None:
    """Atomically write ``path`` with mode 0600 from creation: ``write(fh)`` fills a temporary
    file in the same folder (``mkstemp``: 0600), which is fsynced and renamed over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _append_private(path: Path, text: str) -> None:
    """Append ``text`` to ``path``, created with mode 0600 (an older file is tightened)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as fh:
        os.fchmod(fd, 0o600)
        fh.write(text)


def split_fields(
    data: Mapping[str, Any], fields: Iterable[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``data`` without ``fields`` (dotted: ``privacy.partition_overlap``), and those fields,
    nested the same way; neither input mapping is changed."""
    rest: dict[str, Any] = dict(data)
    taken: dict[str, Any] = {}
    for name in fields:
        head, _, below = name.partition(".")
        if head not in rest:
            continue
        if not below:
            taken[head] = rest.pop(head)
            continue
        sub = rest[head]
        if not isinstance(sub, Mapping):
            continue
        kept, out = split_fields(sub, [below])
        if out:
            rest[head] = kept
            taken[head] = merge_fields(taken.get(head, {}), out)
    return rest, taken


def merge_fields(data: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with ``extra`` merged in (nested mappings merged, not replaced)."""
    out = dict(data)
    for key, value in extra.items():
        below = out.get(key)
        if isinstance(value, Mapping) and isinstance(below, Mapping):
            out[key] = merge_fields(below, value)
        else:
            out[key] = value
    return out


def _local_fields() -> tuple[str, ...]:
    from protofl.engine.round import LOCAL_ONLY_FIELDS

    return LOCAL_ONLY_FIELDS


def _json_line(data: Mapping[str, Any]) -> str:
    return json.dumps(data) + "\n"


def split_round(row: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A metrics row (``RoundMetrics.to_json()``) as (the server's part: ``metrics.jsonl``, the
    local-only part with its ``round``: ``diagnostics.jsonl``)."""
    server, local = split_fields(row, _local_fields())
    return server, {"round": row["round"], **local}


def append_round(run_dir: Path, row: Mapping[str, Any], *, keep_local: bool = True) -> None:
    """Append one round: its server part to ``metrics.jsonl`` and (``keep_local``) its
    local-only part to the client-local ``diagnostics.jsonl``; without ``keep_local`` (a
    deployed Flower server, which never received them) the local-only fields are dropped."""
    server, local = split_round(row)
    if keep_local:
        _append_private(open_client_local(run_dir) / DIAGNOSTICS, _json_line(local))
    with open(run_dir / METRICS, "a") as fh:
        fh.write(_json_line(server))


def rewrite_rounds(
    run_dir: Path, rows: Iterable[Mapping[str, Any]], *, keep_local: bool = True
) -> None:
    """Write ``metrics.jsonl`` (and ``diagnostics.jsonl``) anew with ``rows`` (a new run: none;
    a resume: the history its checkpoint restored)."""
    parts = [split_round(r) for r in rows]
    if keep_local:
        text = "".join(_json_line(local) for _, local in parts).encode()
        write_private(open_client_local(run_dir) / DIAGNOSTICS, lambda fh: fh.write(text))
    (run_dir / METRICS).write_text("".join(_json_line(server) for server, _ in parts))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file as dicts (missing: none; a torn last line, a killed run, is ignored)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        if isinstance(row, dict):
            rows.append(row)
    return rows


def read_diagnostics(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """The client-local per-round diagnostics of ``run_dir`` by round (empty: none kept)."""
    rows = _read_jsonl(client_local_dir(run_dir) / DIAGNOSTICS)
    return {int(r["round"]): r for r in rows if isinstance(r.get("round"), int)}


def read_rounds(run_dir: str | Path) -> list[dict[str, Any]]:
    """``metrics.jsonl`` rows with each round's client-local diagnostics merged back in, when
    the client-local folder has them (the experimenter's full view of every round)."""
    rows = _read_jsonl(Path(run_dir) / METRICS)
    local = read_diagnostics(run_dir)
    if not local:
        return rows
    return [merge_fields(r, local.get(r.get("round"), {})) for r in rows]  # type: ignore[arg-type]


def write_summary(
    run_dir: Path,
    summary: Mapping[str, Any],
    *,
    local: Iterable[str] = SUMMARY_LOCAL_FIELDS,
    keep_local: bool = True,
) -> dict[str, Any]:
    """Write ``summary.json`` without the ``local`` fields and (``keep_local``) those to the
    client-local ``client-summary.json``; returns what ``summary.json`` holds."""
    server, taken = split_fields(summary, local)
    if keep_local and taken:
        text = (json.dumps(taken, indent=2) + "\n").encode()
        write_private(open_client_local(run_dir) / CLIENT_SUMMARY, lambda fh: fh.write(text))
    (run_dir / SUMMARY).write_text(json.dumps(server, indent=2) + "\n")
    return server


def read_client_summary(run_dir: str | Path) -> dict[str, Any]:
    """The client-local part of a run's summary (empty: none kept)."""
    path = client_local_dir(run_dir) / CLIENT_SUMMARY
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While a sweep runs, SIGTERM and SIGHUP (``kill``, a closed terminal, a batch scheduler's
    stop) act like Ctrl-C: the workers are stopped and sweep.json records the runs as stopped,
    instead of the driver dying and leaving both undone.  Only in the main thread (Python
    delivers signals there); the previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    wanted = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {sig: signal.signal(sig, interrupt) for sig in wanted}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
