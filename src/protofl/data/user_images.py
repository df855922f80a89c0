"""``data.name: imagefolder``: your own images, one folder per domain and one per class, any
names (or one root per domain, ``data.options.roots``), on the folder machinery of
:mod:`protofl.data.imagefolder` (scanning, decoding, split protocols)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from protofl.data.base import (
    DATASET_REGISTRY,
    DatasetInfo,
    MultiDomainDataset,
)
from protofl.data.imagefolder import (
    COMMON_OPTIONS,
    IMG_EXTENSIONS,
    DataFileError,
    DatasetRootError,
    FolderBenchmark,
    SkipLog,
    build_domains,
    env_root_available,
    folder_options,
    is_image_file,
    resolve_root,
)
from protofl.data.options import (
    check_options,
    option_bool,
)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- your own images: imagefolder

USER_DATASET = "imagefolder"
USER_ENV = "PROTOFL_IMAGEFOLDER_ROOT"

USER_OPTIONS: dict[str, str] = {
    **COMMON_OPTIONS,
    "protocol": "train/test split: 'vpdr' (random 80/20 under split_seed, the default), "
    "'feddap' (i % 10 <= 7), or 'official' (each domain's train/ and test/ folders)",
    "roots": "one root per domain instead of data.root: a mapping {domain: folder} or a list of "
    "folders (each domain named like its folder), each holding <class>/<images>",
    "allow_missing_classes": "let a domain lack class folders that other domains have (bool, "
    "default false: a missing class is an error naming the domain's folder)",
}

USER_LAYOUT = """\
<root>/<domain>/<class>/<image>   any names: one folder per domain, one per class in each
<root>/<class>/<image>            a single domain, named like <root>
data.options.roots: {<domain>: <folder>, ...} or [<folder>, ...]   one root per domain,
                                  each <folder>/<class>/<image>
a domain holding train/<class>/ and test/<class>/ has a fixed split (used by default)
"""

USER_DISTRIBUTED = "your own images (nothing is downloaded)"


class UserFolders(NamedTuple):
    """What ``data.name: imagefolder`` found: the domain folders (in order) and the classes."""

    folders: dict[str, Path]
    classes: tuple[str, ...]


def _visible_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _holds_images(folder: Path) -> bool:
    """True when ``folder`` itself (not a sub-folder) holds an image file."""
    return any(p.is_file() and is_image_file(p.name) for p in folder.iterdir())


def _any_image(folder: Path) -> bool:
    """True when there is an image anywhere under ``folder`` (stops at the first)."""
    for _dirpath, _dirs, files in os.walk(folder, followlinks=True):
        if any(is_image_file(f) for f in files):
            return True
    return False


def _user_domain_folders(root: str | None, roots: Any) -> dict[str, Path]:
    """Domain name -> folder, from ``data.root`` or ``data.options.roots``."""
    how = f"\nExpected layout:\n{USER_LAYOUT.rstrip()}"
    if roots is not None:
        if root not in (None, ""):
            raise ValueError(
                f"data set {USER_DATASET!r}: give data.root or data.options.roots, not both"
            )
        if isinstance(roots, Mapping):
            pairs = [(str(k), Path(str(v)).expanduser()) for k, v in roots.items()]
        elif isinstance(roots, str | Path):
            pairs = [(Path(str(roots)).expanduser().name, Path(str(roots)).expanduser())]
        elif isinstance(roots, Sequence):
            paths = [Path(str(v)).expanduser() for v in roots]
            pairs = [(p.resolve().name or str(p), p) for p in paths]
        else:
            raise ValueError(
                f"data set {USER_DATASET!r}: data.options.roots must be a mapping "
                f"{{domain: folder}} or a list of folders, got {roots!r}"
            )
        if not pairs:
            raise ValueError(f"data set {USER_DATASET!r}: data.options.roots is empty")
        names = [n for n, _ in pairs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(
                f"data set {USER_DATASET!r}: several roots give the domain name(s) {dup}; use "
                "a mapping {domain: folder} in data.options.roots"
            )
        for name, path in pairs:
            if not path.is_dir():
                raise DatasetRootError(
                    f"data set {USER_DATASET!r}: root of domain {name!r} ({path}, from "
                    f"data.options.roots) does not exist or is not a folder.{how}"
                )
        return dict(pairs)
    base = resolve_root(USER_DATASET, root, USER_ENV, USER_LAYOUT, USER_DISTRIBUTED)
    children = _visible_dirs(base)
    if not children:
        raise DatasetRootError(
            f"data set {USER_DATASET!r}: {base} holds no folders (expected one folder per "
            f"domain, or one per class).{how}"
        )
    if any(_holds_images(c) for c in children):  # <root>/<class>/<image>: one domain
        return {base.resolve().name or "images": base}
    return {c.name: c for c in children}


def _user_class_dirs(folder: Path) -> list[Path]:
    """The class folders of one domain (of its train/, test/ and full/ folders if split)."""
    subs = _visible_dirs(folder)
    lower = {p.name.lower(): p for p in subs}
    if "train" in lower and "test" in lower:
        return [
            c
            for part in ("train", "test", "full")
            if part in lower
            for c in _visible_dirs(lower[part])
        ]
    return subs


def user_folders(root: str | None, options: Mapping[str, Any]) -> UserFolders:
    """Check ``data.name: imagefolder``'s root(s) and layout without decoding an image.

    Classes are the union of the class folder names over every domain, matched
    case-insensitively (spelled as in the first domain that has them) and sorted, so a label
    means the same class in every domain.  Fails with one line naming the folder when a domain
    holds no class folders, has no images, has an empty class folder (unless ``skip_corrupt``),
    or lacks a class other domains have (unless ``allow_missing_classes``).
    """
    check_options(USER_DATASET, options, USER_OPTIONS)
    skip = option_bool(USER_DATASET, "skip_corrupt", options.get("skip_corrupt", False))
    allow_missing = option_bool(
        USER_DATASET, "allow_missing_classes", options.get("allow_missing_classes", False)
    )
    folders = _user_domain_folders(root, options.get("roots"))
    spelled: dict[str, str] = {}
    per_domain: dict[str, set[str]] = {}
    for name, folder in folders.items():
        class_dirs = _user_class_dirs(folder)
        if not class_dirs:
            raise DatasetRootError(
                f"data set {USER_DATASET!r}: domain {name!r}: {folder} holds no class folders "
                f"(expected {folder}/<class>/<images>)"
            )
        keys: set[str] = set()
        any_images = False
        for c in class_dirs:
            if _any_image(c):
                any_images = True
            elif not skip:
                raise DataFileError(
                    f"data set {USER_DATASET!r}: domain {name!r}: class folder {c} has no images "
                    "(pass the option skip_corrupt=True to skip empty class folders)"
                )
            else:
                continue
            keys.add(c.name.lower())
            spelled.setdefault(c.name.lower(), c.name)
        if not any_images:
            raise DataFileError(
                f"data set {USER_DATASET!r}: domain {name!r}: {folder} has no images (expected "
                f"{folder}/<class>/<images>; extensions {', '.join(IMG_EXTENSIONS)})"
            )
        per_domain[name] = keys
    classes = tuple(sorted(spelled.values(), key=lambda c: (c.lower(), c)))
    if not allow_missing:
        for name, keys in per_domain.items():
            missing = [c for c in classes if c.lower() not in keys]
            if missing:
                raise DataFileError(
                    f"data set {USER_DATASET!r}: domain {name!r} ({folders[name]}) has no images "
                    f"for class(es) {', '.join(missing)}, which other domains have; add or rename "
                    "the folders, or pass the option allow_missing_classes=true"
                )
    folder_options(USER_DATASET, _common(options), COMMON_OPTIONS, tuple(folders))
    return UserFolders(folders, classes)


def _common(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k in COMMON_OPTIONS}


def preflight_user_imagefolder(root: str | None, options: Mapping[str, Any]) -> None:
    """Preflight of ``data.name: imagefolder`` (see :func:`user_folders`)."""
    user_folders(root, options)


def load_user_imagefolder(
    home: Path, root: str | None = None, **options: Any
) -> MultiDomainDataset:
    """Your own images: ``<root>/<domain>/<class>/<image>`` of any names, a single
    ``<root>/<class>/<image>`` domain, or one root per domain (``roots``); see
    :func:`user_folders` for the classes and docs/datasets.md."""
    found = user_folders(root, options)
    size, protocol, skip, seed, domains, holdout = folder_options(
        USER_DATASET, _common(options), COMMON_OPTIONS, tuple(found.folders)
    )
    bench = FolderBenchmark(
        name=USER_DATASET,
        classes=found.classes,
        domains=tuple(found.folders),
        domain_folders={d: (d,) for d in found.folders},
        env=USER_ENV,
        layout=USER_LAYOUT,
        distributed=USER_DISTRIBUTED,
        description="your own images",
        source="imagefolder",
    )
    skips = SkipLog(USER_DATASET, skip)
    items = [bench.domain_items(found.folders[d], d, protocol, seed, skips) for d in domains]
    built = build_domains(
        USER_DATASET,
        items,
        size=size,
        skips=skips,
        source=f"imagefolder: your images ({', '.join(str(found.folders[d]) for d in domains)})",
        holdout=holdout,
    )
    return MultiDomainDataset(USER_DATASET, found.classes, built)


def _user_available(home: Path) -> bool:
    return env_root_available(USER_ENV)


DATASET_REGISTRY.add(
    USER_DATASET,
    DatasetInfo(
        name=USER_DATASET,
        loader=load_user_imagefolder,
        description="your own images: one folder per domain and one per class, any names "
        "(or one root per domain: data.options.roots)",
        how_to_get=f"{USER_DISTRIBUTED}; set data.root (or {USER_ENV}) or data.options.roots. "
        "Layout:\n" + USER_LAYOUT.rstrip(),
        is_available=_user_available,
        preflight=preflight_user_imagefolder,
    ),
)
