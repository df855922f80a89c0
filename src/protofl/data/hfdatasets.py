"""Hugging Face ``datasets`` directories as a multi-domain data set (``data.name: hf``).

The root (``data.root`` or ``PROTOFL_HF_ROOT``) is read locally with the ``datasets`` library
(the optional extra ``protofl[hf]``); nothing is downloaded.  Accepted layouts:

```
<root>/                         save_to_disk of a DatasetDict (dataset_dict.json) or a Dataset,
                                with a domain column
<root>/*.parquet                parquet files (one split), with a domain column
<root>/<split>/*.parquet        parquet files per split (train, test, ...)
<root>/data/<split>-*.parquet   the Hugging Face hub layout
<root>/<domain>/...             one directory per domain, each in one of the layouts above
```

Columns (``data.options``): ``image_column`` (default: the column with an ``Image`` feature, else
``image`` / ``img``), ``label_column`` (default: the ``ClassLabel`` column, else ``label`` /
``labels``), ``domain_column`` (default ``domain``; without one the root must hold one directory
per domain).  Class names come from the label's ``ClassLabel`` feature (else ``classes``, else the
sorted string labels); a domain column's values (strings, or a ``ClassLabel``) name the domains.
The ``test`` split (``test_split``) is the test set; a data set with only a train split is split
80/20 per domain with ``split_seed`` (the ``vpdr`` protocol of the folder loaders).  Images are
converted to RGB and resized to the backbone's ``image_size``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from protofl.data.base import (
    DATASET_REGISTRY,
    DatasetInfo,
    DomainData,
    DomainSplit,
    MultiDomainDataset,
)
from protofl.data.imagefolder import RESAMPLE, VPDR_SPLIT_SEED, DatasetRootError
from protofl.errors import ConfigError
from protofl.extras import install_hint

log = logging.getLogger(__name__)

HF_ENV = "PROTOFL_HF_ROOT"
IMAGE_NAMES = ("image", "img", "images", "pixel_values")
LABEL_NAMES = ("label", "labels", "class", "target")
HF_LAYOUT = """\
<root>/dataset_dict.json + <split>/ ...   (DatasetDict.save_to_disk), with a domain column
<root>/<split>/*.parquet or <root>/*.parquet or <root>/data/<split>-*.parquet
<root>/<domain>/<one of the above>         one directory per domain (no domain column)
"""


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(
            f"data set 'hf' needs the Hugging Face datasets library: {install_hint('hf')} "
            "(or pip install 'datasets>=2.14')"
        ) from exc
    return datasets


def _is_saved(folder: Path) -> bool:
    return (folder / "dataset_dict.json").exists() or (folder / "state.json").exists()


def _parquet_splits(folder: Path) -> dict[str, list[str]]:
    """Parquet files by split: ``<split>/*.parquet``, ``data/<split>-*.parquet`` or, for
    loose files, ``<split>-*.parquet`` / everything as ``train``."""
    out: dict[str, list[str]] = {}
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        files = sorted(str(f) for f in sub.glob("*.parquet"))
        if files and sub.name != "data":
            out[sub.name] = files
    loose = sorted(folder.glob("*.parquet")) + sorted((folder / "data").glob("*.parquet"))
    for f in loose:
        stem = f.name.split("-")[0] if "-" in f.name else "train"
        out.setdefault(stem if stem in ("train", "test", "validation") else "train", []).append(
            str(f)
        )
    return out


def _is_source(folder: Path) -> bool:
    return folder.is_dir() and (_is_saved(folder) or bool(_parquet_splits(folder)))


def _open(folder: Path, home: Path) -> dict[str, Any]:
    """The splits of one ``datasets`` directory, as a dict split -> ``Dataset``."""
    ds = _datasets()
    if _is_saved(folder):
        loaded = ds.load_from_disk(str(folder))
        if isinstance(loaded, ds.DatasetDict):
            return dict(loaded)
        return {"train": loaded}
    files = _parquet_splits(folder)
    if not files:
        raise DatasetRootError(
            f"hf: {folder} holds no datasets directory (save_to_disk output) and no parquet "
            f"files. Layout:\n{HF_LAYOUT.rstrip()}"
        )
    loaded = ds.load_dataset("parquet", data_files=files, cache_dir=str(home / "hf-cache"))
    return dict(loaded)


def _column(
    kind: str,
    given: str | None,
    columns: Sequence[str],
    features: Any,
    feature_type: str,
    names: Sequence[str],
    where: Path,
) -> str:
    """The image or label column: the given name, else the column of ``feature_type``, else a
    conventional name; fails naming the columns found."""
    found = ", ".join(columns) or "(none)"
    if given is not None:
        if given not in columns:
            raise ConfigError(
                f"hf: {where} has no {kind} column {given!r} (data.options.{kind}_column); "
                f"columns found: {found}"
            )
        return given
    typed = [c for c in columns if type(features[c]).__name__ == feature_type]
    if len(typed) == 1:
        return typed[0]
    for name in names:
        if name in columns:
            return name
    raise ConfigError(
        f"hf: {where} has no {kind} column (looked for a {feature_type} feature or "
        f"{', '.join(names)}); columns found: {found}; name it with data.options.{kind}_column"
    )


def _pixels(image: Any, size: int | None, where: str) -> np.ndarray:
    from PIL import Image

    if isinstance(image, dict) and image.get("bytes") is not None:  # undecoded Image feature
        import io

        image = Image.open(io.BytesIO(image["bytes"]))
    if isinstance(image, list | tuple):  # an array column (nested lists H x W [x C])
        image = np.asarray(image)
    if isinstance(image, np.ndarray):
        if image.ndim == 3 and image.shape[-1] == 1:
            image = image[..., 0]
        image = Image.fromarray(image.astype(np.uint8))
    if not isinstance(image, Image.Image):
        raise ConfigError(f"hf: {where}: the image column holds {type(image).__name__}, not images")
    rgb = image.convert("RGB")
    if size is not None and rgb.size != (size, size):
        rgb = rgb.resize((size, size), RESAMPLE)
    return np.asarray(rgb, dtype=np.uint8)


class _Columns:
    """The resolved column names and the label space of one directory."""

    def __init__(
        self,
        split: Any,
        where: Path,
        *,
        image_column: str | None,
        label_column: str | None,
        domain_column: str | None,
        need_domain: bool,
    ) -> None:
        columns = list(split.column_names)
        features = split.features
        self.image = _column("image", image_column, columns, features, "Image", IMAGE_NAMES, where)
        self.label = _column(
            "label", label_column, columns, features, "ClassLabel", LABEL_NAMES, where
        )
        self.domain: str | None = None
        name = domain_column or "domain"
        if name in columns:
            self.domain = name
        elif need_domain or domain_column is not None:
            raise ConfigError(
                f"hf: {where} has no domain column {name!r} (data.options.domain_column) and "
                "is not one directory per domain; columns found: " + ", ".join(columns)
            )
        label_feature = features[self.label]
        self.class_names: tuple[str, ...] | None = (
            tuple(label_feature.names) if type(label_feature).__name__ == "ClassLabel" else None
        )
        dom = features[self.domain] if self.domain is not None else None
        self.domain_names: tuple[str, ...] | None = (
            tuple(dom.names) if dom is not None and type(dom).__name__ == "ClassLabel" else None
        )


def _rows(
    split: Any, cols: _Columns, size: int | None, where: str
) -> tuple[list[np.ndarray], list[Any], list[str]]:
    images, labels, domains = [], [], []
    for i, row in enumerate(split):
        images.append(_pixels(row[cols.image], size, f"{where} row {i}"))
        labels.append(row[cols.label])
        if cols.domain is not None:
            value = row[cols.domain]
            if cols.domain_names is not None:
                value = cols.domain_names[int(value)]
            domains.append(str(value))
    return images, labels, domains


def _stack(images: list[np.ndarray], where: str) -> np.ndarray:
    if not images:
        return np.zeros((0, 1, 1, 3), np.uint8)
    shapes = {im.shape for im in images}
    if len(shapes) > 1:
        raise ConfigError(
            f"hf: {where}: images of different sizes {sorted(shapes)[:3]}; give an image size "
            "(backbone.image_size or data.options.image_size)"
        )
    return np.stack(images)


def _root_sources(root: str | None) -> tuple[Path, list[tuple[str | None, Path]]]:
    """The root and its datasets directories: ``[(None, root)]``, or one per domain."""
    given = root or os.environ.get(HF_ENV)
    if not given:
        raise DatasetRootError(
            f"data set 'hf' needs data.root (or {HF_ENV}): a local datasets directory. "
            f"Layout:\n{HF_LAYOUT.rstrip()}"
        )
    base = Path(given).expanduser()
    if not base.is_dir():
        raise DatasetRootError(f"hf: data.root={given!r} is not a directory")
    if _is_source(base):
        return base, [(None, base)]
    sources: list[tuple[str | None, Path]] = [
        (p.name, p) for p in sorted(base.iterdir()) if _is_source(p)
    ]
    if not sources:
        raise DatasetRootError(
            f"hf: {base} is neither a datasets directory nor one directory per domain. "
            f"Layout:\n{HF_LAYOUT.rstrip()}"
        )
    return base, sources


def _array_shape(feature: Any) -> tuple[int, str | None]:
    """(number of dimensions, element dtype) of a (nested) list or ArrayND feature; (-1, None)
    for anything else."""
    depth = 0
    while type(feature).__name__ in ("List", "Sequence", "LargeList"):
        depth += 1
        feature = feature.feature
    kind = type(feature).__name__
    if kind in ("Array2D", "Array3D", "Array4D", "Array5D"):
        return depth + len(feature.shape), str(feature.dtype)
    if kind == "Value":
        return depth, str(feature.dtype)
    return -1, None


def image_feature_ok(feature: Any) -> bool:
    """An ``Image`` feature, or a numeric array of 2 (H x W) or 3 (H x W x C) dimensions."""
    if type(feature).__name__ == "Image":
        return True
    ndim, dtype = _array_shape(feature)
    return ndim in (2, 3) and dtype is not None and dtype.startswith(("uint", "int", "float"))


def _schema(folder: Path, split: str) -> tuple[list[str], Any]:
    """Column names and ``Features`` of one split, read without loading its rows."""
    ds = _datasets()
    if _is_saved(folder):
        loaded = ds.load_from_disk(str(folder))  # memory-mapped: nothing is decoded or copied
        splits = dict(loaded) if isinstance(loaded, ds.DatasetDict) else {"train": loaded}
        if split not in splits:
            raise ConfigError(
                f"hf: {folder} has no split {split!r} (data.options.train_split); splits: "
                + ", ".join(splits)
            )
        return list(splits[split].column_names), splits[split].features
    files = _parquet_splits(folder)
    if split not in files:
        raise ConfigError(
            f"hf: {folder} has no split {split!r} (data.options.train_split); splits: "
            + ", ".join(files)
        )
    import pyarrow.parquet as pq

    features = ds.Features.from_arrow_schema(pq.read_schema(files[split][0]))
    return list(features), features


def preflight_hf(root: str | None, options: Mapping[str, Any]) -> None:
    """The root, its layout and every directory's columns, checked from the schemas alone
    (before a run folder is made): the image column must hold images (an ``Image`` feature or
    a numeric H x W [x C] array), and the label and domain columns must be there."""
    _base, sources = _root_sources(root)
    split = str(options.get("train_split", "train"))
    for domain_dir, folder in sources:
        columns, features = _schema(folder, split)
        cols = _Columns(
            SimpleNamespace(column_names=columns, features=features),
            folder,
            image_column=options.get("image_column"),
            label_column=options.get("label_column"),
            domain_column=options.get("domain_column"),
            need_domain=domain_dir is None,
        )
        feature = features[cols.image]
        if not image_feature_ok(feature):
            raise ConfigError(
                f"hf: {folder}: the image column {cols.image!r} holds {feature}, not images (an "
                "Image feature, or a numeric H x W or H x W x C array); name the image column "
                "with data.options.image_column; columns found: " + ", ".join(columns)
            )


def load_hf_dataset(
    home: Path,
    root: str | None = None,
    *,
    image_column: str | None = None,
    label_column: str | None = None,
    domain_column: str | None = None,
    train_split: str = "train",
    test_split: str = "test",
    classes: Sequence[str] | str | None = None,
    domains: Sequence[str] | str | None = None,
    image_size: int | None = None,
    split_seed: int = VPDR_SPLIT_SEED,
    test_fraction: float = 0.2,
    name: str = "hf",
) -> MultiDomainDataset:
    """Load a local Hugging Face ``datasets`` directory as protofl's multi-domain data set (see
    the module docstring for layouts and options)."""
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"hf: data.options.test_fraction={test_fraction}: give 0 < x < 1")
    base, sources = _root_sources(root)
    # per domain: train and test rows (images, raw labels)
    parts: dict[str, dict[str, tuple[list[np.ndarray], list[Any]]]] = {}
    class_names: tuple[str, ...] | None = None
    for domain_dir, folder in sources:
        splits = _open(folder, home)
        if train_split not in splits:
            raise ConfigError(
                f"hf: {folder} has no split {train_split!r} (data.options.train_split); "
                "splits: " + ", ".join(splits)
            )
        cols = _Columns(
            splits[train_split],
            folder,
            image_column=image_column,
            label_column=label_column,
            domain_column=domain_column,
            need_domain=domain_dir is None,
        )
        if cols.class_names is not None:
            if class_names is not None and class_names != cols.class_names:
                raise ConfigError(
                    f"hf: {folder}: its ClassLabel names {cols.class_names} differ from "
                    f"{class_names}"
                )
            class_names = cols.class_names
        for kind, split_name in (("train", train_split), ("test", test_split)):
            if split_name not in splits:
                continue
            images, labels, doms = _rows(splits[split_name], cols, image_size, str(folder))
            keys = doms if domain_dir is None else [domain_dir] * len(images)
            for im, lab, key in zip(images, labels, keys):
                parts.setdefault(key, {}).setdefault(kind, ([], []))
                parts[key][kind][0].append(im)
                parts[key][kind][1].append(lab)
        if test_split not in splits:
            log.info(
                "hf: %s has no %r split; each domain's train rows are split %d/%d (seed %d)",
                folder,
                test_split,
                round(100 * (1 - test_fraction)),
                round(100 * test_fraction),
                split_seed,
            )
    label_space = _label_space(parts, class_names, classes)
    index = {c: i for i, c in enumerate(label_space)}
    selected = _selected(domains, sorted(parts))
    built = []
    for d in selected:
        where = f"{base}/{d}"
        tr_im, tr_lab = parts[d].get("train", ([], []))
        if "test" in parts[d]:
            te_im, te_lab = parts[d]["test"]
        else:
            perm = np.random.default_rng(split_seed).permutation(len(tr_im))
            n_test = int(test_fraction * len(tr_im))
            te_idx, tr_idx = perm[len(perm) - n_test :], perm[: len(perm) - n_test]
            te_im, te_lab = [tr_im[i] for i in te_idx], [tr_lab[i] for i in te_idx]
            tr_im, tr_lab = [tr_im[i] for i in tr_idx], [tr_lab[i] for i in tr_idx]
        train = DomainSplit(_stack(tr_im, where), _label_ids(tr_lab, index, label_space, where))
        test = DomainSplit(_stack(te_im, where), _label_ids(te_lab, index, label_space, where))
        built.append(DomainData(d, train, test, real=True, source=f"hf: {base}"))
    return MultiDomainDataset(name, label_space, tuple(built))


def _names(value: Sequence[str] | str | None) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return [str(v) for v in value]


def _selected(domains: Sequence[str] | str | None, found: list[str]) -> list[str]:
    wanted = _names(domains)
    if wanted is None:
        return found
    unknown = [d for d in wanted if d not in found]
    if unknown:
        raise ConfigError(
            f"hf: data.options.domains names {unknown}, not in the data; domains: "
            + ", ".join(found)
        )
    return wanted


def _label_space(
    parts: dict[str, dict[str, tuple[list[np.ndarray], list[Any]]]],
    class_names: tuple[str, ...] | None,
    classes: Sequence[str] | str | None,
) -> tuple[str, ...]:
    """ClassLabel names, else ``classes``, else the sorted labels (numerically for integers)."""
    if class_names is not None:
        return class_names
    given = _names(classes)
    if given is not None:
        return tuple(given)
    values = {lab for split in parts.values() for _, labs in split.values() for lab in labs}
    if all(isinstance(v, (int, np.integer)) for v in values):
        return tuple(str(i) for i in range(int(max(values, default=-1)) + 1))
    return tuple(sorted(str(v) for v in values))


def _label_ids(
    labels: list[Any], index: dict[str, int], space: tuple[str, ...], where: str
) -> np.ndarray:
    out = np.empty(len(labels), dtype=np.int64)
    for i, lab in enumerate(labels):
        if isinstance(lab, (int, np.integer)) and not isinstance(lab, bool):
            if not 0 <= int(lab) < len(space):
                raise ConfigError(f"hf: {where}: label {lab} outside 0..{len(space) - 1}")
            out[i] = int(lab)
            continue
        key = str(lab)
        if key not in index:
            raise ConfigError(f"hf: {where}: label {key!r} is not a class ({', '.join(space)})")
        out[i] = index[key]
    return out


def _available(home: Path) -> bool:
    root = os.environ.get(HF_ENV)
    return bool(root) and Path(str(root)).is_dir()


DATASET_REGISTRY.add(
    "hf",
    DatasetInfo(
        name="hf",
        loader=load_hf_dataset,
        description="a local Hugging Face datasets directory (save_to_disk or parquet) with "
        "image, label and domain columns, or one directory per domain",
        how_to_get=f"{install_hint('hf')}; set data.root (or {HF_ENV}). Layout:\n"
        + HF_LAYOUT.rstrip(),
        is_available=_available,
        preflight=preflight_hf,
    ),
)

__all__ = ["HF_ENV", "load_hf_dataset"]
