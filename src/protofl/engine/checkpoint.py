"""Atomic, checksummed per-round checkpoints; the last two are kept, a corrupt one is refused."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from protofl.data.cache import atomic_write_bytes

log = logging.getLogger(__name__)

INDEX = "checkpoints.json"
KEEP = 2


class CheckpointError(RuntimeError):
    """No usable checkpoint: the message says which files were tried and why they failed."""


def save_checkpoint(run_dir: Path, round_index: int, state: dict[str, Any]) -> Path:
    """Write ``checkpoint-<round>.pt`` (temp file, fsync, rename), then update the index.

    The state is streamed to the file, never assembled in memory (with
    ``run.client_state=disk`` the clients' tensors are read from their mapped store as they
    are written), and hashed by reading the file back in chunks.  The file has mode 0600 from
    creation (``mkstemp``) to the end: a checkpoint holds the clients' models and state."""
    path = run_dir / f"checkpoint-{round_index:04d}.pt"
    run_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        digest, size = _sha256(Path(tmp))
        os.chmod(tmp, 0o600)  # mkstemp's mode, whatever the umask: client state
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    index = _read_index(run_dir)
    index.append({"round": round_index, "file": path.name, "sha256": digest, "bytes": size})
    for old in index[:-KEEP]:
        (run_dir / old["file"]).unlink(missing_ok=True)
    index = index[-KEEP:]
    atomic_write_bytes(run_dir / INDEX, json.dumps(index, indent=1).encode())
    return path


def _sha256(path: Path, chunk: int = 8 * 2**20) -> tuple[str, int]:
    """sha256 hex digest and size of a file, read in chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


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
        if _sha256(path)[0] != entry["sha256"]:
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
