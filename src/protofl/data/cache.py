"""The on-disk cache (``PROTOFL_HOME`` or ``~/.cache/protofl``): atomic writes, sha256 manifests."""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def protofl_home() -> Path:
    """The cache root: ``$PROTOFL_HOME`` if set, else ``~/.cache/protofl``."""
    env = os.environ.get("PROTOFL_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "protofl"


_DIGESTS: dict[tuple[str, int, int, int, int], str] = {}
"""sha256_file's per-process memo: (path, inode, size, mtime_ns, ctime_ns) -> digest."""

SETTLED_NS = 2_000_000_000
"""A file's digest is remembered only once its mtime and ctime are this much in the past."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes.

    Remembered per process for a file whose inode, size, mtime and ctime are unchanged, so the
    runs of a fused group (or a sweep worker's successive runs) verify the same data set files
    once, not once each.  Any write changes the ctime (which no tool can set back) and a
    replacement changes the inode; a file modified within the file system's timestamp
    granularity of its hashing could keep both, so, as git does for its racy index entries, a
    digest is only remembered for a file untouched for ``SETTLED_NS``.
    """
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in _DIGESTS:
        return _DIGESTS[key]
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    now = time.time_ns()
    if now - max(st.st_mtime_ns, st.st_ctime_ns) > SETTLED_NS:
        _DIGESTS[key] = digest
    return digest


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; cache files are ordinary files
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        log.warning("cache manifest %s is unreadable; its entries will be rebuilt", path)
        return {}
    return data if isinstance(data, dict) else {}


def record_checksum(path: Path, digest: str | None = None) -> str:
    """Store ``path``'s sha256 in its folder's manifest and return it.

    The read-modify-write of the manifest holds an exclusive lock, so parallel sweep workers
    writing into one cache folder do not lose each other's entries.
    """
    digest = digest or sha256_file(path)
    with open(path.parent / ".manifest.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            _write_entry(path, digest)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return digest


def _write_entry(path: Path, digest: str) -> None:
    manifest = _read_manifest(path.parent)
    manifest[path.name] = digest
    text = json.dumps(manifest, indent=1, sort_keys=True)
    atomic_write_bytes(path.parent / MANIFEST, text.encode())


def verify_checksum(path: Path) -> bool:
    """True when ``path`` exists and matches the sha256 recorded in its folder's manifest."""
    if not path.exists():
        return False
    expected = _read_manifest(path.parent).get(path.name)
    if expected is None:
        return False
    return bool(sha256_file(path) == expected)


def save_arrays(path: Path, **arrays: np.ndarray) -> str:
    """Atomically save arrays as an ``.npz`` and record its checksum; returns the sha256."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    data = buf.getvalue()
    atomic_write_bytes(path, data)
    return record_checksum(path, hashlib.sha256(data).hexdigest())


def save_array(path: Path, array: np.ndarray) -> str:
    """Atomically save one array as an ``.npy`` (memory-mappable) and record its checksum."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    data = buf.getvalue()
    atomic_write_bytes(path, data)
    return record_checksum(path, hashlib.sha256(data).hexdigest())


def map_array(path: Path) -> np.ndarray | None:
    """Memory-map a checksummed ``.npy`` copy-on-write; None (with a log line) when missing or
    corrupt.

    The pages are the operating system's file cache: every client, and every process mapping
    the same file (parallel sweep workers), reads one copy.  Copy-on-write (``mode="c"``) keeps
    the array writable for torch while a write (none is made) would stay private.
    """
    if not path.exists():
        return None
    if not verify_checksum(path):
        log.warning("cached file %s fails its checksum; rebuilding it", path)
        return None
    try:
        return np.load(path, mmap_mode="c", allow_pickle=False)  # type: ignore[no-any-return]
    except (OSError, ValueError) as exc:
        log.warning("cached file %s is unreadable (%s); rebuilding it", path, exc)
        return None


def load_arrays(path: Path) -> dict[str, np.ndarray] | None:
    """Load a checksummed ``.npz``; None (with a log line) when missing or corrupt."""
    if not path.exists():
        return None
    if not verify_checksum(path):
        log.warning("cached file %s fails its checksum; rebuilding it", path)
        return None
    with np.load(path, allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}
