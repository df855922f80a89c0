"""CIFAR's preflight: the root's layout is checked before a run makes anything (issue 43).
Loading CIFAR from its batches is tested in test_digits_files.py."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from protofl.data.cifar import CIFAR_ENV
from protofl.data.imagefolder import DataFileError, DatasetRootError
from protofl.engine.federated_data import preflight
from tests.data.helpers import missing_root_makes_nothing, preflight_config, refused
from tests.data.test_digits_files import cifar_batch, make_cifar10


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_without_a_root_makes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    missing_root_makes_nothing(tmp_path, monkeypatch, name, CIFAR_ENV)


def test_cifar10_layout_is_checked_before_anything_is_made(tmp_path: Path) -> None:
    root = make_cifar10(tmp_path / "c", per_batch=2)
    preflight(preflight_config("data.name=cifar10", f"data.root={root}"))  # a whole tree passes
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(
        tmp_path,
        DatasetRootError,
        rf"no cifar-10-batches-py/ folder with test_batch under {re.escape(str(empty))}",
        "data.name=cifar10",
        f"data.root={empty}",
    )
    gone = root / "cifar-10-batches-py" / "data_batch_3"
    gone.unlink()
    msg = refused(
        tmp_path,
        DataFileError,
        f"{re.escape(str(gone))} is missing",
        "data.name=cifar10",
        f"data.root={root}",
    )
    assert len(msg.splitlines()) == 1 and "data_batch_1 .. 5" in msg


def test_cifar100_layout_is_checked_before_anything_is_made(tmp_path: Path) -> None:
    folder = tmp_path / "c" / "cifar-100-python"
    folder.mkdir(parents=True)
    for split in ("train", "test"):
        (folder / split).write_bytes(pickle.dumps(cifar_batch(4, 0, 100, b"fine_labels")))
    msg = refused(
        tmp_path,
        DataFileError,
        f"{re.escape(str(folder / 'meta'))} is missing",
        "data.name=cifar100",
        f"data.root={tmp_path / 'c'}",
    )
    assert len(msg.splitlines()) == 1 and "names the 100 classes" in msg
    (folder / "meta").write_bytes(pickle.dumps({b"fine_label_names": [b"x"] * 100}))
    preflight(preflight_config("data.name=cifar100", f"data.root={tmp_path / 'c'}"))
