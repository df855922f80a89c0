"""CIFAR-10 (``cifar10``) and CIFAR-100 (``cifar100``) from the python pickle batches.

Each is one "domain" (named like the data set) holding the official 50,000/10,000 split, so the
engine's Dirichlet partitioner spreads its training set over the clients (VPDR's label-skew
setting: ``data.clients_per_domain: 20``, ``data.partition: dirichlet``,
``data.dirichlet_alpha`` in {0.1, 0.5, 1, 5, 10}); every client is tested on the full test set.

Class order: the label order of the batches, names from ``batches.meta`` (CIFAR-10:
airplane, automobile, bird, cat, deer, dog, frog, horse, ship, truck) or ``meta``
(CIFAR-100's 100 ``fine_label_names``). Images stay 32x32 (the backbone resizes when it encodes;
224 px in memory would take 9 GB); ``image_size`` only shrinks.

The batches are pickles. They are read with an unpickler that only builds plain containers and
numpy arrays, so a tampered file fails instead of running code.
"""

from __future__ import annotations

import io
import logging
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from protofl.data.base import (
    DATASET_REGISTRY,
    DatasetInfo,
    DomainData,
    DomainSplit,
    MultiDomainDataset,
)
from protofl.data.imagefolder import (
    DataFileError,
    DatasetRootError,
    env_root_available,
    find_child,
    resize_array,
    resolve_root,
)
from protofl.data.options import (
    check_options,
    option_image_size,
)

log = logging.getLogger(__name__)

CIFAR_ENV = "PROTOFL_CIFAR_ROOT"
CIFAR10_CLASSES: tuple[str, ...] = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)

CIFAR_LAYOUT = """\
<root>/
  cifar-10-batches-py/   data_batch_1 ... data_batch_5  test_batch  batches.meta
  cifar-100-python/      train  test  meta
(or <root> is one of these folders itself)
"""

CIFAR_DISTRIBUTED = (
    "https://www.cs.toronto.edu/~kriz/cifar.html ('CIFAR-10 python version' "
    "cifar-10-python.tar.gz, 'CIFAR-100 python version' cifar-100-python.tar.gz); unpack into "
    "<root>"
)

CIFAR_OPTIONS: dict[str, str] = {
    "image_size": "shrink the 32x32 images to this side (int; never enlarges)",
}

_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {}


def _allowed_globals() -> dict[tuple[str, str], Any]:
    if not _ALLOWED_GLOBALS:
        try:
            from numpy._core import multiarray as ma  # numpy >= 2
        except ImportError:  # pragma: no cover - numpy 1.x
            from numpy.core import multiarray as ma  # type: ignore[no-redef]
        for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
            _ALLOWED_GLOBALS[(mod, "_reconstruct")] = ma._reconstruct
            _ALLOWED_GLOBALS[(mod, "scalar")] = ma.scalar
        _ALLOWED_GLOBALS[("numpy", "ndarray")] = np.ndarray
        _ALLOWED_GLOBALS[("numpy", "dtype")] = np.dtype
        _ALLOWED_GLOBALS[("_codecs", "encode")] = __import__("codecs").encode
    return _ALLOWED_GLOBALS


class _SafeUnpickler(pickle.Unpickler):
    """Builds only dicts, lists, strings, bytes, numbers and numpy arrays."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _allowed_globals()
        if (module, name) in allowed:
            return allowed[(module, name)]
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def read_batch(path: Path) -> dict[str, Any]:
    """One CIFAR pickle (bytes keys decoded to str); fails naming the file."""
    try:
        data = path.read_bytes()
        obj = _SafeUnpickler(io.BytesIO(data), encoding="bytes").load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, IndexError) as exc:
        raise DataFileError(f"{path}: unreadable or truncated CIFAR pickle ({exc})") from exc
    if not isinstance(obj, dict):
        raise DataFileError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    return {k.decode() if isinstance(k, bytes) else str(k): v for k, v in obj.items()}


def _images_labels(batch: dict[str, Any], key: str, path: Path) -> tuple[np.ndarray, np.ndarray]:
    if "data" not in batch or key not in batch:
        raise DataFileError(f"{path}: expected keys 'data' and {key!r}, found {sorted(batch)}")
    data = np.asarray(batch["data"], dtype=np.uint8)
    labels = np.asarray(batch[key], dtype=np.int64).ravel()
    if data.ndim != 2 or data.shape[1] != 3072 or len(data) != len(labels):
        raise DataFileError(
            f"{path}: data {data.shape} is not [N, 3072] with N = {len(labels)} labels"
        )
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1).copy(), labels


def _names(meta: dict[str, Any], key: str, path: Path) -> tuple[str, ...]:
    if key not in meta:
        raise DataFileError(f"{path}: expected key {key!r}, found {sorted(meta)}")
    return tuple(n.decode() if isinstance(n, bytes) else str(n) for n in meta[key])


def _folder(root: Path, names: tuple[str, ...], marker: str) -> Path:
    if (root / marker).is_file():
        return root
    sub = find_child(root, names)
    if sub is not None and (sub / marker).is_file():
        return sub
    raise DatasetRootError(
        f"no {names[0]}/ folder with {marker} under {root}.\nExpected layout:\n"
        f"{CIFAR_LAYOUT.rstrip()}\nDistributed at: {CIFAR_DISTRIBUTED}\n"
        f"Pass the folder as data.root or set {CIFAR_ENV}=<folder>."
    )


def _finish(
    name: str, classes: tuple[str, ...], arrays: list[np.ndarray], size: int | None, src: str
) -> MultiDomainDataset:
    xtr, ytr, xte, yte = arrays
    for y, split in ((ytr, "train"), (yte, "test")):
        if len(y) and (y.min() < 0 or y.max() >= len(classes)):
            raise DataFileError(f"{name} {split}: labels outside 0..{len(classes) - 1}")
    if size is not None and size < 32:
        xtr, xte = resize_array(xtr, size), resize_array(xte, size)
    dom = DomainData(
        name=name,
        train=DomainSplit(xtr, ytr),
        test=DomainSplit(xte, yte),
        real=True,
        source=f"real: {src}; official 50,000/10,000 split",
    )
    log.info("%s: %d train, %d test", name, len(ytr), len(yte))
    return MultiDomainDataset(name, classes, (dom,))


CIFAR10_TRAIN: tuple[str, ...] = tuple(f"data_batch_{i}" for i in range(1, 6))


def _cifar10_files(root: str | None, options: Mapping[str, Any]) -> tuple[int | None, Path]:
    """CIFAR-10's options and batch folder, every batch there (nothing read); fails naming the
    first missing file or folder."""
    check_options("cifar10", options, CIFAR_OPTIONS)
    size = option_image_size("cifar10", options.get("image_size"), None)
    base = resolve_root("cifar10", root, CIFAR_ENV, CIFAR_LAYOUT, CIFAR_DISTRIBUTED)
    folder = _folder(base, ("cifar-10-batches-py",), "test_batch")
    for name in CIFAR10_TRAIN:
        if not (folder / name).is_file():
            raise DataFileError(
                f"cifar10: {folder / name} is missing (expected data_batch_1 .. 5 and "
                f"test_batch in {folder}; batches.meta is optional)"
            )
    return size, folder


def _cifar100_files(root: str | None, options: Mapping[str, Any]) -> tuple[int | None, Path]:
    """CIFAR-100's options and folder, ``train``, ``test`` and ``meta`` there (nothing read)."""
    check_options("cifar100", options, CIFAR_OPTIONS)
    size = option_image_size("cifar100", options.get("image_size"), None)
    base = resolve_root("cifar100", root, CIFAR_ENV, CIFAR_LAYOUT, CIFAR_DISTRIBUTED)
    folder = _folder(base, ("cifar-100-python",), "test")
    for name, why in (("train", ""), ("test", ""), ("meta", ", which names the 100 classes")):
        if not (folder / name).is_file():
            raise DataFileError(
                f"cifar100: {folder / name} is missing (expected train, test and meta{why} in "
                f"{folder})"
            )
    return size, folder


def preflight_cifar10(root: str | None, options: Mapping[str, Any]) -> None:
    """The options, the root and every CIFAR-10 batch file, checked without reading one
    (before a run folder is made)."""
    _cifar10_files(root, options)


def preflight_cifar100(root: str | None, options: Mapping[str, Any]) -> None:
    """The options, the root and CIFAR-100's three files, checked without reading one."""
    _cifar100_files(root, options)


def load_cifar10(home: Path, root: str | None = None, **options: Any) -> MultiDomainDataset:
    """CIFAR-10 as one domain ``cifar10``."""
    size, folder = _cifar10_files(root, options)
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    for name in CIFAR10_TRAIN:
        path = folder / name
        parts.append(_images_labels(read_batch(path), "labels", path))
    test = folder / "test_batch"
    xte, yte = _images_labels(read_batch(test), "labels", test)
    classes = CIFAR10_CLASSES
    meta = folder / "batches.meta"
    if meta.is_file():
        classes = _names(read_batch(meta), "label_names", meta)
    arrays = [
        np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]),
        xte,
        yte,
    ]
    return _finish("cifar10", classes, arrays, size, f"CIFAR-10 python batches in {folder}")


def load_cifar100(home: Path, root: str | None = None, **options: Any) -> MultiDomainDataset:
    """CIFAR-100 (fine labels) as one domain ``cifar100``."""
    size, folder = _cifar100_files(root, options)
    arrays: list[np.ndarray] = []
    for split in ("train", "test"):
        path = folder / split
        arrays.extend(_images_labels(read_batch(path), "fine_labels", path))
    meta = folder / "meta"
    classes = _names(read_batch(meta), "fine_label_names", meta)
    return _finish("cifar100", classes, arrays, size, f"CIFAR-100 python batches in {folder}")


def _available(marker: str, names: tuple[str, ...]) -> Any:
    def check(path: Path) -> bool:
        try:
            _folder(path, names, marker)
        except DatasetRootError:
            return False
        return True

    return lambda home: env_root_available(CIFAR_ENV, check)


for _name, _loader, _preflight, _sub, _marker, _desc in (
    (
        "cifar10",
        load_cifar10,
        preflight_cifar10,
        "cifar-10-batches-py",
        "test_batch",
        "CIFAR-10: 10 classes",
    ),
    (
        "cifar100",
        load_cifar100,
        preflight_cifar100,
        "cifar-100-python",
        "test",
        "CIFAR-100: 100 fine classes",
    ),
):
    DATASET_REGISTRY.add(
        _name,
        DatasetInfo(
            name=_name,
            loader=_loader,
            description=f"{_desc}, one domain (label skew via the Dirichlet partitioner)",
            how_to_get=f"{CIFAR_DISTRIBUTED}; set {CIFAR_ENV} or data.root. Layout:\n"
            + CIFAR_LAYOUT.rstrip(),
            is_available=_available(_marker, (_sub,)),
            preflight=_preflight,
        ),
    )

__all__ = [
    "CIFAR10_CLASSES",
    "CIFAR_ENV",
    "load_cifar10",
    "load_cifar100",
    "preflight_cifar10",
    "preflight_cifar100",
    "read_batch",
]
