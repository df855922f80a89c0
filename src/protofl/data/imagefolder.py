"""Shared machinery of the image-folder benchmarks: roots, options, scanning, decoding, splits.

Every real-benchmark loader (``pacs``, ``office_caltech10``, ``office_home``, ``domainnet``,
``vlcs``, and the folder forms inside ``digits``) goes through these helpers, so they all

- find their root the same way (the ``root`` argument, else an environment variable) and fail with
  the expected layout as a short tree and where the data set is distributed;
- reject unknown options with the allowed ones;
- list images in ``torchvision.datasets.ImageFolder`` order (class folders sorted by name, then a
  sorted recursive walk), which the FedDAP ``i % 10 <= 7`` index rule depends on;
- decode with Pillow, convert to RGB and resize to ``image_size`` x ``image_size`` with one fixed
  filter (:data:`RESAMPLE`, bilinear with Pillow's antialiasing, i.e. what
  ``torchvision.transforms.Resize((s, s))`` does on PIL images);
- fail naming the file on an empty class folder, an unreadable or truncated image, or a split list
  naming a missing file, unless ``skip_corrupt=True``: then such files are skipped, counted, logged
  (logger ``protofl.data.imagefolder``, a child of ``protofl.data``) and reported in
  ``DomainData.source`` and by :func:`skipped_files`.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from PIL import Image

from protofl.data.base import (
    DATASET_REGISTRY,
    DatasetInfo,
    DomainData,
    DomainSplit,
    MultiDomainDataset,
)
from protofl.data.options import (
    check_options,
    option_bool,
    option_domains,
    option_holdout,
    option_image_size,
    option_int,
    option_protocol,
)

log = logging.getLogger(__name__)

IMG_EXTENSIONS: tuple[str, ...] = (
    ".jpg",
    ".jpeg",
    ".png",
    ".ppm",
    ".bmp",
    ".pgm",
    ".tif",
    ".tiff",
    ".webp",
)
"""Image file extensions (case-insensitive), as ``torchvision.datasets.folder.IMG_EXTENSIONS``."""

RESAMPLE = Image.Resampling.BILINEAR
"""The one resize filter used everywhere (Pillow bilinear, antialiased when shrinking)."""

DEFAULT_IMAGE_SIZE = 224
"""Side of the stored images when a folder benchmark is loaded without ``image_size``."""

PROTOCOLS: tuple[str, ...] = ("official", "vpdr", "feddap")
"""Named split protocols (see :func:`protocol_split` and docs/datasets.md)."""

VPDR_TEST_FRACTION = 0.2
VPDR_SPLIT_SEED = 10  # VPDR's random_seed default

COMMON_OPTIONS: dict[str, str] = {
    "image_size": "side of the stored square images (int; default 224 for folder benchmarks)",
    "protocol": "train/test split: 'official' (where the benchmark has one), 'vpdr' or 'feddap'",
    "skip_corrupt": "skip (and count) unreadable images and missing listed files (bool)",
    "split_seed": "seed of the 'vpdr' random 80/20 split (int, default 10)",
    "domains": "load only these domains (list of names)",
    "holdout_domain": "leave-one-domain-out: this domain's test split becomes the whole domain "
    "and its train split is empty",
}


class DatasetRootError(FileNotFoundError):
    """A data set's root folder is not given or not there; the message shows the layout."""


class DataFileError(ValueError):
    """A file of a data set is missing, unreadable, truncated, or a class folder is empty."""


# ---------------------------------------------------------------- skip log


@dataclass
class SkipLog:
    """Files skipped under ``skip_corrupt`` while loading one data set, per domain."""

    dataset: str
    skip_corrupt: bool
    skipped: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    _seen: set[tuple[str, str]] = field(default_factory=set, repr=False)

    def fail(self, domain: str, path: Path | str, reason: str) -> None:
        """Raise :class:`DataFileError` naming ``path``, or record it when skipping is on."""
        if not self.skip_corrupt:
            raise DataFileError(
                f"{self.dataset}/{domain}: {path}: {reason} (pass the option skip_corrupt=True "
                "to skip such files and count them instead)"
            )
        key = (domain, str(path))
        if key not in self._seen:  # a file named in two lists counts once
            self._seen.add(key)
            self.skipped.setdefault(domain, []).append((str(path), reason))

    def count(self, domain: str) -> int:
        """Number of files skipped in ``domain``."""
        return len(self.skipped.get(domain, []))

    def note(self, domain: str) -> str:
        """Text appended to ``DomainData.source`` (empty when nothing was skipped)."""
        n = self.count(domain)
        return f"; skip_corrupt: {n} file(s) skipped" if n else ""

    def finish(self) -> None:
        """Log the counts and remember them for :func:`skipped_files`."""
        total = sum(len(v) for v in self.skipped.values())
        if total:
            per = ", ".join(f"{d}: {len(v)}" for d, v in self.skipped.items())
            log.warning(
                "%s: skip_corrupt skipped %d unreadable or missing file(s) (%s); first: %s (%s)",
                self.dataset,
                total,
                per,
                *next(iter(self.skipped.values()))[0],
            )
        _LAST_SKIPPED[self.dataset] = {d: list(v) for d, v in self.skipped.items()}


_LAST_SKIPPED: dict[str, dict[str, list[tuple[str, str]]]] = {}


def skipped_files(dataset: str) -> dict[str, list[tuple[str, str]]]:
    """Files skipped by the last load of ``dataset`` in this process: domain -> [(path, reason)].

    Empty when nothing was skipped (or the data set was not loaded). The counts also appear at
    the end of each ``DomainData.source`` ("skip_corrupt: N file(s) skipped").
    """
    return {d: list(v) for d, v in _LAST_SKIPPED.get(dataset, {}).items()}


# ---------------------------------------------------------------- roots and options


def resolve_root(
    dataset: str, root: str | Path | None, env: str, layout: str, distributed: str
) -> Path:
    """The data set's root: ``root`` if given, else ``$env``; fails showing the layout."""
    how = (
        f"\nExpected layout:\n{layout.rstrip()}\nDistributed at: {distributed}\n"
        f"Pass the folder as data.root or set {env}=<folder>."
    )
    if root is None or str(root) == "":
        value = os.environ.get(env)
        if not value:
            raise DatasetRootError(f"data set {dataset!r} needs its root folder; none given.{how}")
        path = Path(value).expanduser()
        origin = f"${env}"
    else:
        path = Path(root).expanduser()
        origin = "data.root"
    if not path.is_dir():
        raise DatasetRootError(
            f"data set {dataset!r}: root folder {path} (from {origin}) does not exist or is not "
            f"a folder.{how}"
        )
    return path


def env_root_available(env: str, check: Any = None) -> bool:
    """True when ``$env`` names an existing folder (and ``check(folder)`` holds, if given)."""
    value = os.environ.get(env)
    if not value:
        return False
    path = Path(value).expanduser()
    if not path.is_dir():
        return False
    try:
        return bool(check(path)) if check is not None else True
    except OSError:
        return False


class FolderOptions(NamedTuple):
    """The options every image-folder benchmark shares, validated (see :func:`folder_options`)."""

    image_size: int | None
    protocol: str | None
    skip_corrupt: bool
    split_seed: int
    domains: tuple[str, ...]
    holdout: str | None


def folder_options(
    dataset: str, options: Mapping[str, Any], allowed: Mapping[str, str], domains: Sequence[str]
) -> FolderOptions:
    """Check ``options`` against ``allowed``, then validate the shared ones in a fixed order.

    ``image_size`` (default :data:`DEFAULT_IMAGE_SIZE`), ``protocol`` (one of :data:`PROTOCOLS`),
    ``skip_corrupt``, ``split_seed`` (default :data:`VPDR_SPLIT_SEED`), ``domains`` (out of
    ``domains``) and ``holdout_domain`` (one of the selected domains).
    """
    check_options(dataset, options, allowed)
    size = option_image_size(dataset, options.get("image_size"), DEFAULT_IMAGE_SIZE)
    protocol = option_protocol(dataset, options.get("protocol"), PROTOCOLS)
    skip = option_bool(dataset, "skip_corrupt", options.get("skip_corrupt", False))
    seed = option_int(dataset, "split_seed", options.get("split_seed"), VPDR_SPLIT_SEED)
    selected = option_domains(dataset, options.get("domains"), domains)
    holdout = option_holdout(dataset, options.get("holdout_domain"), selected)
    return FolderOptions(size, protocol, skip, seed, selected, holdout)


def split_lists_or_vpdr(
    dataset: str,
    protocol: str | None,
    use_lists: bool,
    missing: Sequence[str],
    searched: Iterable[Path],
    *,
    lists: str,
    alternatives: str,
    layout: str,
    distributed: str,
    logger: logging.Logger,
    note: str = "",
    note_args: tuple[Any, ...] = (),
) -> bool:
    """Whether to read the split lists, given the ``missing`` ones.

    With lists missing, an explicit ``protocol`` is an error (naming ``lists``, the folders
    ``searched``, the ``alternatives``, the layout and where the data set is distributed);
    without one, ``logger`` warns (``note`` % ``note_args`` appended) and the loader falls back
    to ``vpdr`` (False is returned).
    """
    if not (use_lists and missing):
        return use_lists
    where = ", ".join(str(p) for p in searched)
    if protocol is not None:
        raise DatasetRootError(
            f"{dataset}: protocol {protocol!r} needs the {lists}; missing "
            f"{', '.join(missing)} (searched: {where}). Pass split_dir, or use protocol "
            f"{alternatives}.\nExpected layout:\n{layout.rstrip()}\n"
            f"Distributed at: {distributed}"
        )
    logger.warning(
        f"{dataset}: {lists} not found (missing %s; searched %s); using protocol 'vpdr'{note}",
        ", ".join(missing),
        where,
        *note_args,
    )
    return False


# ---------------------------------------------------------------- scanning


def is_image_file(name: str) -> bool:
    """True for a visible file with an image extension."""
    return not name.startswith(".") and name.lower().endswith(IMG_EXTENSIONS)


def walk_images(folder: Path) -> list[Path]:
    """Image files under ``folder`` in ImageFolder order (sorted walk, sorted names)."""
    out: list[Path] = []
    for dirpath, _dirs, files in sorted(os.walk(folder, followlinks=True)):
        out.extend(Path(dirpath) / f for f in sorted(files) if is_image_file(f))
    return out


def find_child(parent: Path, names: Iterable[str]) -> Path | None:
    """The first child folder of ``parent`` whose name matches one of ``names`` (any case)."""
    if not parent.is_dir():
        return None
    wanted = [n.lower() for n in names]
    children = {p.name.lower(): p for p in sorted(parent.iterdir()) if p.is_dir()}
    for n in wanted:
        if n in children:
            return children[n]
    return None


def scan_class_folders(
    folder: Path,
    classes: Sequence[str],
    *,
    dataset: str,
    domain: str,
    skips: SkipLog,
    aliases: Mapping[str, str] | None = None,
    ignore_unknown: bool = False,
) -> list[tuple[Path, int]]:
    """(path, label) of every image under ``folder/<class>/``, in ImageFolder order.

    Class folders match ``classes`` case-insensitively, or through ``aliases`` (lower-cased
    folder name -> class). Several folders may map to one class. A folder that is no class fails
    unless ``ignore_unknown``; a class folder without images fails naming it (or is skipped and
    counted under ``skip_corrupt``); a class with no folder at all is only logged.
    """
    index = {c.lower(): i for i, c in enumerate(classes)}
    alias = {k.lower(): v.lower() for k, v in (aliases or {}).items()}
    items: list[tuple[Path, int]] = []
    seen: set[int] = set()
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        key = sub.name.lower()
        key = alias.get(key, key)
        if key not in index:
            if ignore_unknown:
                continue
            raise DataFileError(
                f"{dataset}/{domain}: folder {sub} is not one of the classes ("
                + ", ".join(classes)
                + "); is the root pointing at the right level?"
            )
        files = walk_images(sub)
        if not files:
            skips.fail(domain, sub, "class folder has no images")
            continue
        seen.add(index[key])
        items.extend((f, index[key]) for f in files)
    missing = [classes[i] for i in range(len(classes)) if i not in seen]
    if missing and not ignore_unknown:
        log.info("%s/%s: no folder (or no images) for class(es) %s", dataset, domain, missing)
    return items


def read_split_list(
    list_file: Path,
    image_root: Path,
    *,
    dataset: str,
    domain: str,
    skips: SkipLog,
) -> list[tuple[Path, str, str]]:
    """Lines ``<relative path> <label>`` -> (absolute path, relative path, label text).

    A listed file that does not exist fails naming it (or is skipped under ``skip_corrupt``).
    """
    out: list[tuple[Path, str, str]] = []
    try:
        text = list_file.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DataFileError(
            f"{dataset}/{domain}: cannot read split list {list_file}: {exc}"
        ) from exc
    for lineno, line in enumerate(text.splitlines(), 1):
        parts = line.strip().split()
        if not parts:
            continue
        if len(parts) < 2:
            raise DataFileError(
                f"{list_file}:{lineno}: expected '<relative path> <label>', got {line.strip()!r}"
            )
        rel, label = " ".join(parts[:-1]), parts[-1]
        path = image_root / rel
        if not path.is_file():
            skips.fail(domain, path, f"listed in {list_file.name} line {lineno} but missing")
            continue
        out.append((path, rel, label))
    return out


# ---------------------------------------------------------------- decoding


def decode_image(path: Path, size: int | None) -> np.ndarray:
    """One image as uint8 RGB [H, W, 3], resized to ``size`` x ``size`` when given.

    Raises :class:`DataFileError` naming the file when it cannot be read or decoded.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # palette-transparency and EXIF chatter
            with Image.open(path) as im:
                im.load()  # a truncated file fails here (Pillow's LOAD_TRUNCATED_IMAGES is off)
                rgb = im.convert("RGB")
        if size is not None and rgb.size != (size, size):
            rgb = rgb.resize((size, size), RESAMPLE)
        arr = np.asarray(rgb, dtype=np.uint8)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise DataFileError(f"{path}: unreadable or truncated image ({exc})") from exc
    return arr


def resize_array(images: np.ndarray, size: int) -> np.ndarray:
    """Resize uint8 images [N, H, W, 3] (or grey [N, H, W]) to [N, size, size, 3] with RESAMPLE."""
    if images.ndim == 3:
        images = np.repeat(images[..., None], 3, axis=-1)
    if images.shape[1:3] == (size, size):
        return np.ascontiguousarray(images, dtype=np.uint8)
    out = np.empty((len(images), size, size, 3), np.uint8)
    for i, img in enumerate(images):
        out[i] = np.asarray(Image.fromarray(img, "RGB").resize((size, size), RESAMPLE))
    return out


def decode_many(
    items: Sequence[tuple[Path, int]],
    size: int | None,
    *,
    domain: str,
    skips: SkipLog,
    workers: int | None = None,
) -> DomainSplit:
    """Decode (path, label) pairs into a DomainSplit; bad files fail or are skipped and counted.

    ``size`` None keeps the native size, which must then be the same for every image.
    """
    paths = [p for p, _ in items]
    labels = np.asarray([y for _, y in items], dtype=np.int64)

    def one(p: Path) -> np.ndarray | DataFileError:
        try:
            return decode_image(p, size)
        except DataFileError as exc:
            return exc

    n_workers = workers or min(8, os.cpu_count() or 1)
    if len(paths) > 64 and n_workers > 1:
        with ThreadPoolExecutor(max_workers=n_workers) as pool:
            decoded = list(pool.map(one, paths, chunksize=32))
    else:
        decoded = [one(p) for p in paths]
    keep: list[int] = []
    arrays: list[np.ndarray] = []
    for i, res in enumerate(decoded):
        if isinstance(res, DataFileError):
            skips.fail(domain, paths[i], str(res).split(": ", 1)[-1])
            continue
        keep.append(i)
        arrays.append(res)
    if not arrays:
        side = size or 1
        return DomainSplit(np.zeros((0, side, side, 3), np.uint8), np.zeros(0, np.int64))
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise DataFileError(
            f"{domain}: images have different sizes {sorted(shapes)[:3]}...; pass image_size"
        )
    return DomainSplit(np.stack(arrays), labels[keep])


# ---------------------------------------------------------------- split protocols


def protocol_split(
    n: int, protocol: str, seed: int = VPDR_SPLIT_SEED
) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices of ``n`` samples under a named deterministic protocol.

    - ``vpdr``: a random permutation under ``seed``; the last ``int(0.2 n)`` go to test (VPDR's
      ``random_split(full, [n - int(0.2 n), int(0.2 n)])``, with numpy's generator instead of
      torch's global one, so the split is fixed but not bit-identical to VPDR's).
    - ``feddap``: sample ``i`` (ImageFolder order) is train when ``i % 10 <= 7`` (FedDAP /
      RethinkFL), test otherwise.
    """
    if protocol == "feddap":
        idx = np.arange(n)
        return idx[idx % 10 <= 7], idx[idx % 10 > 7]
    if protocol == "vpdr":
        perm = np.random.default_rng(seed).permutation(n)
        n_test = int(n * VPDR_TEST_FRACTION)
        n_train = n - n_test
        return np.sort(perm[:n_train]), np.sort(perm[n_train:])
    raise ValueError(f"unknown split protocol {protocol!r}; valid: vpdr, feddap")


def take(items: Sequence[tuple[Path, int]], idx: np.ndarray) -> list[tuple[Path, int]]:
    """Items at ``idx``."""
    return [items[int(i)] for i in idx]


@dataclass
class DomainItems:
    """One domain's train and test file lists before decoding, and how they were chosen."""

    name: str
    train: list[tuple[Path, int]]
    test: list[tuple[Path, int]]
    how: str
    whole: list[tuple[Path, int]] | None = None  # the whole domain, for leave-one-domain-out


def build_domains(
    dataset: str,
    items: Sequence[DomainItems],
    *,
    size: int | None,
    skips: SkipLog,
    source: str,
    holdout: str | None = None,
) -> tuple[DomainData, ...]:
    """Decode every domain's lists into DomainData (the held-out domain: test = whole domain)."""
    out: list[DomainData] = []
    for d in items:
        train, test, how = d.train, d.test, d.how
        if d.name == holdout:
            whole = d.whole if d.whole is not None else _union(d.train, d.test)
            train, test = [], whole
            how += "; held out: train empty, test = the whole domain"
        tr = decode_many(train, size, domain=d.name, skips=skips)
        te = decode_many(test, size, domain=d.name, skips=skips)
        if size is not None:
            tr = _empty_at(tr, size)
            te = _empty_at(te, size)
        out.append(
            DomainData(
                name=d.name,
                train=tr,
                test=te,
                real=True,
                source=f"{source}; {how}{skips.note(d.name)}",
            )
        )
        log.info("%s/%s: %d train, %d test (%s)", dataset, d.name, len(tr), len(te), how)
    skips.finish()
    return tuple(out)


def _union(a: Sequence[tuple[Path, int]], b: Sequence[tuple[Path, int]]) -> list[tuple[Path, int]]:
    seen: set[Path] = set()
    out: list[tuple[Path, int]] = []
    for p, y in [*a, *b]:
        if p not in seen:
            seen.add(p)
            out.append((p, y))
    return sorted(out, key=lambda t: str(t[0]))


def _empty_at(split: DomainSplit, size: int) -> DomainSplit:
    """An empty split gets the same [0, size, size, 3] shape as the others."""
    if len(split) == 0 and split.images.shape[1:3] != (size, size):
        return DomainSplit(np.zeros((0, size, size, 3), np.uint8), split.labels)
    return split


# ---------------------------------------------------------------- generic folder benchmark


def _subdirs(folder: Path) -> dict[str, Path]:
    return {
        p.name.lower(): p
        for p in sorted(folder.iterdir())
        if p.is_dir() and not p.name.startswith(".")
    }


@dataclass(frozen=True)
class FolderBenchmark:
    """A benchmark stored as ``<root>/<domain>/<class>/<image>`` (the ImageFolder layout).

    Splits: a domain with ``train/`` and ``test/`` subfolders (each ``<class>/<image>``) has an
    official split, used by ``protocol`` ``official`` and ``vpdr`` (VPDR's loader uses them
    too); otherwise the default is ``vpdr`` (random 80/20) and ``official`` is an error.
    ``feddap`` always applies the ``i % 10 <= 7`` rule to the pooled domain (its ``full/``
    subfolder if there is one, else the class folders, else train then test).
    """

    name: str
    classes: tuple[str, ...]
    domains: tuple[str, ...]
    domain_folders: Mapping[str, tuple[str, ...]]
    env: str
    layout: str
    distributed: str
    description: str
    source: str
    class_aliases: Mapping[str, str] = field(default_factory=dict)
    containers: tuple[str, ...] = ()

    # -- layout

    def find_base(self, root: Path) -> Path:
        """The folder holding the domain folders: ``root`` or one of its known containers."""
        candidates = [root] + [p for c in self.containers if (p := find_child(root, [c]))]
        for base in candidates:
            if any(find_child(base, self.domain_folders[d]) for d in self.domains):
                return base
        found = ", ".join(sorted(_subdirs(root))[:12]) or "nothing"
        raise DatasetRootError(
            f"data set {self.name!r}: no domain folder ("
            + ", ".join(self.domain_folders[d][0] for d in self.domains)
            + f") under {root} (it holds: {found}).\nExpected layout:\n{self.layout.rstrip()}\n"
            f"Distributed at: {self.distributed}"
        )

    def domain_dir(self, base: Path, domain: str) -> Path:
        """The folder of one domain (Office-31's extra ``images/`` level is stepped into)."""
        folder = find_child(base, self.domain_folders[domain])
        if folder is None:
            raise DatasetRootError(
                f"data set {self.name!r}: domain folder for {domain!r} (one of "
                + ", ".join(self.domain_folders[domain])
                + f") is missing under {base}.\nExpected layout:\n{self.layout.rstrip()}"
            )
        subs = _subdirs(folder)
        if "images" in subs and not any(c.lower() in subs for c in self.classes):
            folder = subs["images"]
        return folder

    def scan(self, folder: Path, domain: str, skips: SkipLog) -> list[tuple[Path, int]]:
        """ImageFolder listing of ``folder/<class>/...``."""
        return scan_class_folders(
            folder,
            self.classes,
            dataset=self.name,
            domain=domain,
            skips=skips,
            aliases=self.class_aliases,
        )

    def domain_items(
        self, folder: Path, domain: str, protocol: str | None, seed: int, skips: SkipLog
    ) -> DomainItems:
        """Train/test lists of one domain under ``protocol``."""
        subs = _subdirs(folder)
        presplit = "train" in subs and "test" in subs
        if presplit and protocol in (None, "official", "vpdr"):
            train = self.scan(subs["train"], domain, skips)
            test = self.scan(subs["test"], domain, skips)
            return DomainItems(domain, train, test, "official train/ and test/ folders")
        if protocol == "official":
            raise ValueError(
                f"data set {self.name!r}: domain {domain!r} has no official split here (no "
                f"train/ and test/ folders under {folder}); use protocol 'vpdr' or 'feddap'"
            )
        if "full" in subs:
            pooled = self.scan(subs["full"], domain, skips)
        elif presplit:
            pooled = self.scan(subs["train"], domain, skips) + self.scan(
                subs["test"], domain, skips
            )
        else:
            pooled = self.scan(folder, domain, skips)
        proto = protocol or "vpdr"
        tr, te = protocol_split(len(pooled), proto, seed)
        how = (
            f"protocol vpdr: random 80/20 (seed {seed})"
            if proto == "vpdr"
            else "protocol feddap: i % 10 <= 7 train (ImageFolder order)"
        )
        return DomainItems(domain, take(pooled, tr), take(pooled, te), how, whole=list(pooled))

    # -- loader and registry

    @property
    def allowed_options(self) -> dict[str, str]:
        """Options this loader accepts."""
        return dict(COMMON_OPTIONS)

    def load(self, home: Path, root: str | None = None, **options: Any) -> MultiDomainDataset:
        """Load the benchmark (see the class docstring and docs/datasets.md)."""
        size, protocol, skip, seed, domains, holdout = folder_options(
            self.name, options, self.allowed_options, self.domains
        )
        base = self.find_base(
            resolve_root(self.name, root, self.env, self.layout, self.distributed)
        )
        skips = SkipLog(self.name, skip)
        items = [
            self.domain_items(self.domain_dir(base, d), d, protocol, seed, skips) for d in domains
        ]
        built = build_domains(
            self.name, items, size=size, skips=skips, source=self.source, holdout=holdout
        )
        return MultiDomainDataset(self.name, self.classes, built)

    def preflight(self, root: str | None, options: Mapping[str, Any]) -> None:
        """The root, its layout (every selected domain's folder) and the ``domains`` option,
        checked without reading an image (before a run folder is made)."""
        selected = option_domains(self.name, options.get("domains"), self.domains)
        base = self.find_base(
            resolve_root(self.name, root, self.env, self.layout, self.distributed)
        )
        for d in selected:
            self.domain_dir(base, d)

    def is_available(self, home: Path) -> bool:
        """True when ``$env`` points at a folder holding at least one domain folder."""

        def check(path: Path) -> bool:
            try:
                self.find_base(path)
            except DatasetRootError:
                return False
            return True

        return env_root_available(self.env, check)

    def register(self) -> None:
        """Add this benchmark to DATASET_REGISTRY."""
        DATASET_REGISTRY.add(
            self.name,
            DatasetInfo(
                name=self.name,
                loader=self.load,
                description=self.description,
                how_to_get=f"{self.distributed}; set {self.env} or data.root. Layout:\n"
                + self.layout.rstrip(),
                is_available=self.is_available,
                preflight=self.preflight,
            ),
        )


__all__ = [
    "COMMON_OPTIONS",
    "DEFAULT_IMAGE_SIZE",
    "IMG_EXTENSIONS",
    "PROTOCOLS",
    "RESAMPLE",
    "DataFileError",
    "DatasetRootError",
    "DomainItems",
    "FolderBenchmark",
    "FolderOptions",
    "SkipLog",
    "build_domains",
    "check_options",
    "decode_image",
    "decode_many",
    "folder_options",
    "protocol_split",
    "read_split_list",
    "resize_array",
    "resolve_root",
    "scan_class_folders",
    "skipped_files",
    "split_lists_or_vpdr",
    "walk_images",
]
