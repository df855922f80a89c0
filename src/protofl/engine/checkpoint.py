"""Atomic, checksummed per-round checkpoints; the last two are kept, a corrupt one is refused."""

from __future__ import annotations

import hashlib
import io
import json
import logging
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
    """Write ``checkpoint-<round>.pt`` (temp file, fsync, rename), then update the index."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    path = run_dir / f"checkpoint-{round_index:04d}.pt"
    atomic_write_bytes(path, data)
    index = _read_index(run_dir)
    index.append(
        {
            "round": round_index,
            "file": path.name,
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
        }
    )
    for old in index[:-KEEP]:
        (run_dir / old["file"]).unlink(missing_ok=True)
    index = index[-KEEP:]
    atomic_write_bytes(run_dir / INDEX, json.dumps(index, indent=1).encode())
    return path


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
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            problems.append(f"{path}: fails its sha256 integrity check")
            log.error("checkpoint %s fails its integrity check; trying the previous one", path)
            continue
        state: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
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
