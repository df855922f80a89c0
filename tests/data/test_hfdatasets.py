"""The Hugging Face ``datasets`` loader on small data sets built here, offline."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from protofl.data import DATASET_REGISTRY
from protofl.data.hfdatasets import load_hf_dataset
from protofl.errors import ConfigError

datasets = pytest.importorskip("datasets", reason="the optional extra protofl[hf] is missing")

CLASSES = ["cat", "dog", "fish"]


def _images(n: int, seed: int, size: int = 12) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(n)]


def _split(n: int, seed: int, domains: list[str] | None = None, **extra: object) -> object:
    data: dict[str, object] = {
        "image": _images(n, seed),
        "label": [i % len(CLASSES) for i in range(n)],
    }
    feats = {
        "image": datasets.Image(),
        "label": datasets.ClassLabel(names=CLASSES),
    }
    if domains is not None:
        data["domain"] = [domains[i % len(domains)] for i in range(n)]
        feats["domain"] = datasets.Value("string")
    data.update(extra)
    return datasets.Dataset.from_dict(
        data, features=datasets.Features(feats) if not extra else None
    )


def test_save_to_disk_with_a_domain_column(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    datasets.DatasetDict(
        {"train": _split(12, 0, ["photo", "sketch"]), "test": _split(6, 1, ["photo", "sketch"])}
    ).save_to_disk(str(root))
    data = load_hf_dataset(tmp_path, str(root), image_size=8)
    assert data.classes == tuple(CLASSES)  # from the ClassLabel feature
    assert [d.name for d in data.domains] == ["photo", "sketch"]
    photo = data.domain("photo")
    assert photo.train.images.shape == (6, 8, 8, 3) and photo.train.images.dtype == np.uint8
    assert len(photo.test) == 3
    # rows 0, 2, 4, ... are photo: labels 0, 2, 1, 0, 2, 1
    assert photo.train.labels.tolist() == [0, 2, 1, 0, 2, 1]


def test_one_directory_per_domain_of_parquet_files(tmp_path: Path) -> None:
    root = tmp_path / "pq"
    for i, dom in enumerate(["art", "cartoon"]):
        for split, n in (("train", 10), ("test", 4)):
            (root / dom / split).mkdir(parents=True)
            _split(n, 10 * i + n).to_parquet(str(root / dom / split / "part-0.parquet"))
    data = load_hf_dataset(tmp_path, str(root), image_size=12)
    assert [d.name for d in data.domains] == ["art", "cartoon"]
    assert [len(d.train) for d in data.domains] == [10, 10]
    assert [len(d.test) for d in data.domains] == [4, 4]
    assert data.classes == tuple(CLASSES)  # the ClassLabel survives parquet's schema metadata
    # pixels are the images written (no resize at the same size)
    np.testing.assert_array_equal(data.domains[0].train.images[0], _images(10, 10)[0])


def test_configurable_columns_string_labels_and_a_split_of_train(tmp_path: Path) -> None:
    root = tmp_path / "cols"
    n = 20
    ds = datasets.Dataset.from_dict(
        {
            "picture": _images(n, 3),
            "kind": [CLASSES[i % 3] for i in range(n)],
            "site": ["a" if i < 10 else "b" for i in range(n)],
        },
        features=datasets.Features(
            {
                "picture": datasets.Image(),
                "kind": datasets.Value("string"),
                "site": datasets.Value("string"),
            }
        ),
    )
    ds.save_to_disk(str(root))
    data = load_hf_dataset(
        tmp_path,
        str(root),
        image_column="picture",
        label_column="kind",
        domain_column="site",
        image_size=12,
    )
    assert data.classes == ("cat", "dog", "fish")  # sorted string labels
    assert [(len(d.train), len(d.test)) for d in data.domains] == [(8, 2), (8, 2)]


def test_missing_columns_name_the_columns_found(tmp_path: Path) -> None:
    root = tmp_path / "bad"
    datasets.Dataset.from_dict(
        {"pixels": [[0, 1]] * 4, "y": [0, 1, 0, 1], "domain": ["a"] * 4}
    ).save_to_disk(str(root))
    with pytest.raises(ConfigError, match=r"no image column.*columns found: pixels, y, domain"):
        load_hf_dataset(tmp_path, str(root))
    with pytest.raises(ConfigError, match=r"no label column 'lab'.*columns found: pixels, y"):
        load_hf_dataset(tmp_path, str(root), image_column="pixels", label_column="lab")
    nodom = tmp_path / "nodom"
    _split(4, 0).save_to_disk(str(nodom))
    with pytest.raises(ConfigError, match=r"no domain column 'domain'.*found: image, label"):
        load_hf_dataset(tmp_path, str(nodom))


def test_registered_and_loaded_through_the_engine(tmp_path: Path) -> None:
    from protofl.config import ExperimentConfig
    from protofl.engine.federated_data import load_dataset

    root = tmp_path / "ds"
    datasets.DatasetDict(
        {"train": _split(12, 0, ["x", "y"]), "test": _split(6, 1, ["x", "y"])}
    ).save_to_disk(str(root))
    assert "hf" in DATASET_REGISTRY
    config = ExperimentConfig.from_dict(
        {
            "data": {"name": "hf", "root": str(root)},
            "backbone": {"name": "pixels", "image_size": 16},
        }
    )
    data = load_dataset(config, tmp_path)
    assert data.domains[0].train.images.shape[1:] == (16, 16, 3)  # the backbone's size
