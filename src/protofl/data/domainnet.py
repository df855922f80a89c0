"""DomainNet (``domainnet``): six domains, by default FedDAP's 10-class subset.

Classes: option ``classes`` (a list of DomainNet class folder names, label = position in the
list as given) or by default :data:`FEDDAP_CLASSES` (bird, feather, headphones, ice_cream,
teapot, tiger, whale, windmill, wine_glass, zebra). ``classes="all"`` takes every class folder of
the first domain, sorted (the official 345-class label order).

Split protocols:

- ``official`` (the default when the lists are there): ``<domain>_train.txt`` and
  ``<domain>_test.txt`` (lines ``clipart/aircraft_carrier/clipart_001_000018.jpg 0``), keeping
  the lines whose class folder is selected; labels are re-numbered to the selected classes.
- ``feddap``: ``i % 10 <= 7`` over the selected class folders in ImageFolder order (FedDAP).
- ``vpdr``: random 80/20 (seed 10) over the same listing.

Without ``protocol`` and without the lists, ``vpdr`` is used with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from protofl.data.base import DATASET_REGISTRY, DatasetInfo, MultiDomainDataset
from protofl.data.imagefolder import (
    COMMON_OPTIONS,
    DataFileError,
    DatasetRootError,
    DomainItems,
    FolderBenchmark,
    FolderOptions,
    SkipLog,
    build_domains,
    env_root_available,
    find_child,
    folder_options,
    protocol_split,
    resolve_root,
    scan_class_folders,
    split_lists_or_vpdr,
    take,
)
from protofl.registry import nearest

log = logging.getLogger(__name__)

DOMAINNET_ENV = "PROTOFL_DOMAINNET_ROOT"
DOMAINNET_DOMAINS: tuple[str, ...] = (
    "clipart",
    "infograph",
    "painting",
    "quickdraw",
    "real",
    "sketch",
)
FEDDAP_CLASSES: tuple[str, ...] = (
    "bird",
    "feather",
    "headphones",
    "ice_cream",
    "teapot",
    "tiger",
    "whale",
    "windmill",
    "wine_glass",
    "zebra",
)

DOMAINNET_LAYOUT = """\
<root>/                        (or <root>/domainnet/ or <root>/DomainNet/)
  clipart/   aircraft_carrier/ *.jpg ... zigzag/   (345 class folders)
  infograph/ painting/ quickdraw/ real/ sketch/   (same)
  clipart_train.txt  clipart_test.txt  ...        (or in <root>/splits/; option split_dir)
    lines: 'clipart/aircraft_carrier/clipart_001_000018.jpg 0'
"""

DOMAINNET_DISTRIBUTED = (
    "DomainNet (Peng et al., ICCV 2019): http://ai.bu.edu/M3SDA/ (one zip per domain plus the "
    "<domain>_train.txt / <domain>_test.txt lists; use the 'cleaned' versions where offered)"
)

DOMAINNET_OPTIONS: dict[str, str] = {
    **COMMON_OPTIONS,
    "classes": "class folder names to use, in label order, or 'all' (default: FedDAP's 10)",
    "split_dir": "folder holding <domain>_train.txt / <domain>_test.txt (default: the root, "
    "then <root>/splits)",
}

_FOLDERS = FolderBenchmark(
    name="domainnet",
    classes=FEDDAP_CLASSES,
    domains=DOMAINNET_DOMAINS,
    domain_folders={d: (d,) for d in DOMAINNET_DOMAINS},
    env=DOMAINNET_ENV,
    layout=DOMAINNET_LAYOUT,
    distributed=DOMAINNET_DISTRIBUTED,
    description="DomainNet",
    source="real: DomainNet",
    containers=("domainnet", "DomainNet", "domain_net"),
)


def _classes_option(value: Any, base: Path, domains: tuple[str, ...]) -> tuple[str, ...]:
    if value is None:
        return FEDDAP_CLASSES
    if value == "all":
        first = _FOLDERS.domain_dir(base, domains[0])
        names = sorted(p.name for p in first.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not names:
            raise DataFileError(f"domainnet: no class folders in {first}")
        return tuple(names)
    if isinstance(value, str) or not all(isinstance(c, str) for c in value):
        raise ValueError(
            "domainnet: option classes must be a list of class folder names or 'all', "
            f"got {value!r}"
        )
    classes = tuple(value)
    if not classes or len(set(classes)) != len(classes):
        raise ValueError(f"domainnet: option classes must be non-empty and unique, got {classes!r}")
    return classes


def _check_classes_exist(classes: tuple[str, ...], folder: Path) -> None:
    present = sorted(p.name for p in folder.iterdir() if p.is_dir())
    bad = [c for c in classes if c not in present]
    if bad:
        hints = "".join(nearest(c, present) for c in bad[:3])
        raise ValueError(
            f"domainnet: class(es) {bad} have no folder in {folder}{hints}; DomainNet class names "
            "are the folder names, e.g. " + ", ".join(present[:8])
        )


def _list_items(
    list_file: Path, base: Path, domain: str, classes: tuple[str, ...], skips: SkipLog
) -> list[tuple[Path, int]]:
    """(path, label) of the lines of ``list_file`` whose class folder is selected.

    Lines are filtered on the class folder before the file system is touched (10 of 345
    classes); a selected file that is missing fails naming it (or is skipped and counted).
    """
    index = {c: i for i, c in enumerate(classes)}
    try:
        lines = list_file.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise DataFileError(f"domainnet/{domain}: cannot read {list_file}: {exc}") from exc
    out: list[tuple[Path, int]] = []
    for lineno, line in enumerate(lines, 1):
        parts = line.strip().split()
        if not parts:
            continue
        if len(parts) < 2:
            raise DataFileError(
                f"{list_file}:{lineno}: expected '<relative path> <label>', got {line.strip()!r}"
            )
        rel = " ".join(parts[:-1])
        cls = Path(rel).parent.name
        if cls not in index:
            continue
        path = base / rel
        if not path.is_file():
            skips.fail(domain, path, f"listed in {list_file.name} line {lineno} but missing")
            continue
        out.append((path, index[cls]))
    return out


class _Layout(NamedTuple):
    """What a DomainNet root holds for the given options (checked without reading an image)."""

    options: FolderOptions
    base: Path
    classes: tuple[str, ...]
    split_dirs: list[Path]

    def find_list(self, domain: str, kind: str) -> Path | None:
        """``<domain>_<kind>.txt`` in the first split folder holding it."""
        for folder in self.split_dirs:
            if (folder / f"{domain}_{kind}.txt").is_file():
                return folder / f"{domain}_{kind}.txt"
        return None

    def missing_lists(self) -> list[str]:
        """The split lists of the selected domains that no split folder holds."""
        return [
            f"{d}_{k}.txt"
            for d in self.options.domains
            for k in ("train", "test")
            if not self.find_list(d, k)
        ]

    def use_lists(self) -> bool:
        """Whether the official lists are read: an explicit ``official`` without them fails
        naming them; without ``protocol`` the fallback to ``vpdr`` is logged."""
        protocol = self.options.protocol
        return split_lists_or_vpdr(
            "domainnet",
            protocol,
            protocol in (None, "official"),
            self.missing_lists(),
            self.split_dirs,
            lists="split lists",
            alternatives="'feddap' or 'vpdr'",
            layout=DOMAINNET_LAYOUT,
            distributed=DOMAINNET_DISTRIBUTED,
            logger=log,
        )


def _layout(root: str | None, options: Mapping[str, Any]) -> _Layout:
    """The options, the root, the folder holding the domains, the classes and the split
    folders; fails naming what is missing."""
    opts = folder_options("domainnet", options, DOMAINNET_OPTIONS, DOMAINNET_DOMAINS)
    root_path = resolve_root(
        "domainnet", root, DOMAINNET_ENV, DOMAINNET_LAYOUT, DOMAINNET_DISTRIBUTED
    )
    base = _FOLDERS.find_base(root_path)
    classes = _classes_option(options.get("classes"), base, opts.domains)
    split_dir = options.get("split_dir")
    if split_dir is not None:
        dirs = [Path(str(split_dir)).expanduser()]
        if not dirs[0].is_dir():
            raise DatasetRootError(f"domainnet: split_dir {split_dir} does not exist")
    else:
        dirs = [base, root_path] + [p for n in ("splits",) if (p := find_child(base, [n]))]
    return _Layout(opts, base, classes, dirs)


def preflight_domainnet(root: str | None, options: Mapping[str, Any]) -> None:
    """The options, the root, every selected domain's folder and its selected class folders,
    and (under an explicit ``protocol: official``) the split lists, checked without reading an
    image (before a run folder is made)."""
    layout = _layout(root, options)
    if layout.options.protocol is not None:  # without one, missing lists are no error (vpdr)
        layout.use_lists()
    for d in layout.options.domains:
        _check_classes_exist(layout.classes, _FOLDERS.domain_dir(layout.base, d))


def load_domainnet(home: Path, root: str | None = None, **options: Any) -> MultiDomainDataset:
    """Load DomainNet (see the module docstring for classes, protocols and options)."""
    layout = _layout(root, options)
    size, protocol, skip, seed, domains, holdout = layout.options
    base, classes, find_list = layout.base, layout.classes, layout.find_list
    skips = SkipLog("domainnet", skip)
    use_lists = layout.use_lists()

    items: list[DomainItems] = []
    for d in domains:
        folder = _FOLDERS.domain_dir(base, d)
        _check_classes_exist(classes, folder)
        if use_lists:
            train_list, test_list = find_list(d, "train"), find_list(d, "test")
            assert train_list is not None and test_list is not None
            train = _list_items(train_list, base, d, classes, skips)
            test = _list_items(test_list, base, d, classes, skips)
            how = f"official lists {train_list.name} / {test_list.name}"
            items.append(DomainItems(d, train, test, how))
            continue
        pooled = scan_class_folders(
            folder, classes, dataset="domainnet", domain=d, skips=skips, ignore_unknown=True
        )
        proto = protocol or "vpdr"
        tr, te = protocol_split(len(pooled), proto, seed)
        how = (
            "protocol feddap: i % 10 <= 7 train (ImageFolder order of the selected classes)"
            if proto == "feddap"
            else f"protocol vpdr: random 80/20 (seed {seed})"
        )
        items.append(DomainItems(d, take(pooled, tr), take(pooled, te), how, whole=pooled))
    source = f"real: DomainNet, {len(classes)} classes"
    built = build_domains(
        "domainnet", items, size=size, skips=skips, source=source, holdout=holdout
    )
    return MultiDomainDataset("domainnet", classes, built)


def _available(home: Path) -> bool:
    def check(path: Path) -> bool:
        try:
            _FOLDERS.find_base(path)
        except DatasetRootError:
            return False
        return True

    return env_root_available(DOMAINNET_ENV, check)


DATASET_REGISTRY.add(
    "domainnet",
    DatasetInfo(
        name="domainnet",
        loader=load_domainnet,
        description="DomainNet: 6 domains (clipart, infograph, painting, quickdraw, real, "
        "sketch); FedDAP's 10-class subset by default (option classes)",
        how_to_get=f"{DOMAINNET_DISTRIBUTED}; set {DOMAINNET_ENV} or data.root. Layout:\n"
        + DOMAINNET_LAYOUT.rstrip(),
        is_available=_available,
        preflight=preflight_domainnet,
    ),
)

__all__ = [
    "DOMAINNET_DOMAINS",
    "DOMAINNET_ENV",
    "FEDDAP_CLASSES",
    "load_domainnet",
    "preflight_domainnet",
]
