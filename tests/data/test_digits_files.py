"""``digits`` from files (MNIST IDX, USPS bz2/h5, SVHN .mat, SynthDigits, MNIST-M) and CIFAR."""

from __future__ import annotations

import bz2
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy.io import savemat

from protofl.data import DATASET_REGISTRY
from protofl.data.cifar import CIFAR10_CLASSES, load_cifar10
from protofl.data.digits_files import DIGITS_ENV, load_digits, parse_usps_libsvm
from protofl.data.imagefolder import DataFileError, DatasetRootError
from protofl.data.mnist import MNIST_FILES, write_idx
from protofl.data.partition import dirichlet_split
from protofl.engine.federated_data import preflight
from tests.data.helpers import missing_root_makes_nothing, preflight_config, refused

RNG = np.random.default_rng(0)


def digit_images(labels: np.ndarray, size: int, channels: int = 0) -> np.ndarray:
    """Images whose mean brightness encodes the label (label * 20 + 30)."""
    shape = (len(labels), size, size) + ((channels,) if channels else ())
    return np.broadcast_to(
        (labels * 20 + 30).astype(np.uint8).reshape((-1,) + (1,) * (len(shape) - 1)), shape
    ).copy()


def write_usps(folder: Path, n: int, name: str) -> np.ndarray:
    labels = np.arange(n) % 10
    lines = []
    for y in labels:
        value = (y * 20 + 30) / 255 * 2 - 1
        lines.append(f"{y + 1} " + " ".join(f"{k}:{value:.6f}" for k in range(1, 257)))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(bz2.compress(("\n".join(lines) + "\n").encode()))
    return labels


def write_svhn_mat(path: Path, n: int) -> None:
    labels = np.arange(n) % 10
    x = digit_images(labels, 32, 3).transpose(1, 2, 3, 0)
    y = np.where(labels == 0, 10, labels).reshape(-1, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    savemat(path, {"X": x, "y": y})


def write_class_folders(folder: Path, per_class: int, size: int = 32) -> None:
    for c in range(10):
        for i in range(per_class):
            p = folder / str(c) / f"{i}.png"
            p.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (size, size), (c * 20 + 30,) * 3).save(p)


def make_digits(root: Path, *, syn: str = "rethinkfl", mnistm: bool = False) -> Path:
    ytr, yte = np.arange(20) % 10, np.arange(10) % 10
    raw = root / "MNIST" / "raw"
    write_idx(raw / "train-images-idx3-ubyte.gz", digit_images(ytr, 28), compress=True)
    write_idx(raw / "train-labels-idx1-ubyte.gz", ytr, compress=True)
    write_idx(raw / "t10k-images-idx3-ubyte", digit_images(yte, 28))
    write_idx(raw / "t10k-labels-idx1-ubyte", yte)
    write_usps(root / "USPS", 12, "usps.bz2")
    write_usps(root / "USPS", 6, "usps.t.bz2")
    write_svhn_mat(root / "SVHN" / "train_32x32.mat", 15)
    write_svhn_mat(root / "SVHN" / "test_32x32.mat", 5)
    if syn == "rethinkfl":
        write_class_folders(root / "syn" / "train", 2)
        write_class_folders(root / "syn" / "val", 1)
    elif syn == "vpdr":
        write_class_folders(root / "synthetic_digits" / "imgs_train", 2)
        write_class_folders(root / "synthetic_digits" / "imgs_valid", 1)
    else:
        write_svhn_mat(root / "SynthDigits" / "synth_train_32x32.mat", 20)
        write_svhn_mat(root / "SynthDigits" / "synth_test_32x32.mat", 10)
    if mnistm:
        for split, n in (("train", 10), ("test", 5)):
            folder = root / "mnist_m" / f"mnist_m_{split}"
            folder.mkdir(parents=True)
            lines = []
            for i in range(n):
                Image.new("RGB", (28, 28), (i % 10 * 20 + 30,) * 3).save(folder / f"{i:08d}.png")
                lines.append(f"{i:08d}.png {i % 10}")
            (root / "mnist_m" / f"mnist_m_{split}_labels.txt").write_text("\n".join(lines))
    return root


def brightness_ok(images: np.ndarray, labels: np.ndarray) -> bool:
    means = images.reshape(len(images), -1).mean(axis=1)
    return bool(np.all(np.abs(means - (labels * 20 + 30)) < 3))


@pytest.mark.parametrize("syn", ["rethinkfl", "vpdr", "mat"])
def test_digits_four_domains_native_sizes_and_labels(tmp_path: Path, syn: str) -> None:
    root = make_digits(tmp_path / "digits", syn=syn)
    ds = load_digits(tmp_path / "home", str(root))
    assert ds.classes == tuple("0123456789")
    assert [d.name for d in ds.domains] == ["mnist", "usps", "svhn", "syn"]
    sizes = {d.name: d.train.images.shape[1] for d in ds.domains}
    assert sizes == {"mnist": 28, "usps": 16, "svhn": 32, "syn": 32}
    counts = {d.name: (len(d.train), len(d.test)) for d in ds.domains}
    assert counts["mnist"] == (20, 10) and counts["usps"] == (12, 6)
    assert counts["svhn"] == (15, 5)
    assert counts["syn"] == ((20, 10))
    assert [d.real for d in ds.domains] == [True, True, True, False]
    for d in ds.domains:
        assert d.train.images.ndim == 4 and d.train.images.shape[-1] == 3
        assert brightness_ok(d.train.images, d.train.labels), d.name
        assert brightness_ok(d.test.images, d.test.labels), d.name
    # SVHN's label 10 is digit 0
    assert 0 in ds.domain("svhn").train.labels and 10 not in ds.domain("svhn").train.labels


def test_digits_image_size_only_shrinks(tmp_path: Path) -> None:
    root = make_digits(tmp_path / "d")
    small = load_digits(tmp_path, str(root), image_size=20)
    assert {d.name: d.train.images.shape[1] for d in small.domains} == {
        "mnist": 20,
        "usps": 16,
        "svhn": 20,
        "syn": 20,
    }
    big = load_digits(tmp_path, str(root), image_size=224)
    assert big.domain("mnist").train.images.shape[1:] == (28, 28, 3)


def test_digits_mnistm_domain_and_holdout(tmp_path: Path) -> None:
    root = make_digits(tmp_path / "d", mnistm=True)
    ds = load_digits(tmp_path, str(root), domains=["mnist", "mnistm"], holdout_domain="mnistm")
    assert [d.name for d in ds.domains] == ["mnist", "mnistm"]
    m = ds.domain("mnistm")
    assert len(m.train) == 0 and len(m.test) == 5 and not m.real
    assert brightness_ok(m.test.images, m.test.labels)


def test_digits_missing_domain_names_files_and_layout(tmp_path: Path) -> None:
    root = make_digits(tmp_path / "d")
    for f in (root / "SVHN").iterdir():
        f.unlink()
    with pytest.raises(DatasetRootError) as err:
        load_digits(tmp_path, str(root))
    msg = str(err.value)
    assert "train_32x32.mat" in msg and str(root / "SVHN") in msg and "ufldl" in msg
    ds = load_digits(tmp_path, str(root), domains=["mnist", "usps"])
    assert len(ds.domains) == 2


def test_digits_corrupt_files_fail_naming_them(tmp_path: Path) -> None:
    root = make_digits(tmp_path / "d")
    bad = root / "SVHN" / "test_32x32.mat"
    bad.write_bytes(b"MATLAB 5.0 but not really" * 3)
    with pytest.raises(DataFileError, match=r"test_32x32\.mat"):
        load_digits(tmp_path, str(root), domains=["svhn"])
    usps = root / "USPS" / "usps.t.bz2"
    usps.write_bytes(usps.read_bytes()[:40])
    with pytest.raises(DataFileError, match=r"usps\.t\.bz2"):
        load_digits(tmp_path, str(root), domains=["usps"])
    img = root / "syn" / "train" / "3" / "0.png"
    img.write_bytes(b"\x89PNG broken")
    with pytest.raises(DataFileError, match=str(img)):
        load_digits(tmp_path, str(root), domains=["syn"])
    ds = load_digits(tmp_path, str(root), domains=["syn"], skip_corrupt=True)
    assert len(ds.domains[0].train) == 19 and "1 file(s) skipped" in ds.domains[0].source


def test_digits_rejects_unknown_options_and_protocols(tmp_path: Path) -> None:
    root = make_digits(tmp_path / "d")
    with pytest.raises(ValueError, match="classes"):
        load_digits(tmp_path, str(root), classes=["1"])
    with pytest.raises(ValueError, match="valid protocols: official"):
        load_digits(tmp_path, str(root), protocol="vpdr")


def test_usps_libsvm_matches_torchvision_scaling() -> None:
    data = b"1 1:-1 2:1 3:0\n10 256:1\n"
    x, y = parse_usps_libsvm(data, "u")
    assert y.tolist() == [0, 9]
    assert x.shape == (2, 16, 16)
    assert x[0, 0, :3].tolist() == [0, 255, 127]  # (v + 1) / 2 * 255, truncated
    assert x[1, 15, 15] == 255 and x[1, 0, 0] == 0  # absent entries are -1


def test_usps_h5(tmp_path: Path) -> None:
    h5py = pytest.importorskip("h5py", reason="h5py not installed; the bz2 form is tested")
    root = tmp_path / "d"
    (root / "USPS").mkdir(parents=True)
    with h5py.File(root / "USPS" / "usps.h5", "w") as fh:
        for split, n in (("train", 8), ("test", 4)):
            g = fh.create_group(split)
            y = np.arange(n) % 10
            g["data"] = np.repeat(((y * 20 + 30) / 255.0)[:, None], 256, axis=1)
            g["target"] = y
    ds = load_digits(tmp_path, str(root), domains=["usps"])
    assert brightness_ok(ds.domains[0].train.images, ds.domains[0].train.labels)


# ---------------------------------------------------------------- preflight


def test_digits_without_a_root_makes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing_root_makes_nothing(tmp_path, monkeypatch, "digits", DIGITS_ENV)


def test_digits_files_are_checked_before_anything_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PROTOFL_MNIST_DIR", raising=False)
    root = make_digits(tmp_path / "d")
    preflight(preflight_config("data.name=digits", f"data.root={root}"))  # the four domains
    for f in (root / "SVHN").iterdir():
        f.unlink()
    msg = refused(
        tmp_path,
        DatasetRootError,
        r"digits/svhn: train_32x32\.mat \+ test_32x32\.mat not found \(searched: .*SVHN",
        "data.name=digits",
        f"data.root={root}",
    )
    assert "Expected layout" in msg
    preflight(  # a domain left out is not looked for
        preflight_config(
            "data.name=digits", f"data.root={root}", "data.options.domains=[mnist, usps]"
        )
    )
    refused(
        tmp_path,
        DatasetRootError,
        r"digits/mnistm: mnist_m/mnist_m_train .* not found",
        "data.name=digits",
        f"data.root={root}",
        "data.options.domains=[mnistm]",
    )


def test_digits_preflight_lets_mnist_come_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PROTOFL_MNIST_DIR", raising=False)
    root = make_digits(tmp_path / "d")
    shutil.rmtree(root / "MNIST")
    only_mnist = ["data.name=digits", f"data.root={root}", "data.options.domains=[mnist]"]
    refused(tmp_path, DatasetRootError, r"digits/mnist: the four MNIST IDX files", *only_mnist)
    home = tmp_path / "cache-home"  # the loader falls back to protofl's MNIST cache
    cache = home / "raw" / "mnist"
    cache.mkdir(parents=True)
    for f in MNIST_FILES:
        (cache / f.dotted).write_bytes(b"")
    monkeypatch.setenv("PROTOFL_HOME", str(home))
    preflight(preflight_config(*only_mnist))


# ---------------------------------------------------------------- CIFAR


def cifar_batch(n: int, offset: int, n_classes: int, key: bytes) -> dict[bytes, object]:
    labels = [(offset + i) % n_classes for i in range(n)]
    data = np.zeros((n, 3072), np.uint8)
    for i, y in enumerate(labels):
        data[i, :1024], data[i, 1024:2048], data[i, 2048:] = y, 100 + y % 100, 200
    return {b"batch_label": b"x", key: labels, b"data": data, b"filenames": [b"f"] * n}


def make_cifar10(root: Path, per_batch: int = 40) -> Path:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for i in range(1, 6):
        batch = cifar_batch(per_batch, i, 10, b"labels")
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(batch, protocol=2))
    (folder / "test_batch").write_bytes(pickle.dumps(cifar_batch(20, 0, 10, b"labels")))
    meta = {b"label_names": [c.encode() for c in CIFAR10_CLASSES], b"num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))
    return root


def test_cifar10_one_domain_channel_layout_and_dirichlet(tmp_path: Path) -> None:
    root = make_cifar10(tmp_path / "c")
    ds = load_cifar10(tmp_path, str(root))
    assert ds.classes == CIFAR10_CLASSES and [d.name for d in ds.domains] == ["cifar10"]
    dom = ds.domains[0]
    assert dom.train.images.shape == (200, 32, 32, 3) and len(dom.test) == 20
    px = dom.train.images[:, 5, 7]
    assert (px[:, 0] == dom.train.labels).all() and (px[:, 2] == 200).all()
    assert (px[:, 1] == 100 + dom.train.labels).all()
    shards = dirichlet_split(
        np.arange(200), dom.train.labels, 20, 0.5, np.random.default_rng(0), min_size=1
    )
    assert len(shards) == 20 and sum(len(s) for s in shards) == 200
    small = load_cifar10(tmp_path, str(root), image_size=16)
    assert small.domains[0].train.images.shape[1:] == (16, 16, 3)
    assert load_cifar10(tmp_path, str(root), image_size=224).domains[0].train.images.shape[1] == 32


def test_cifar100_fine_labels_and_meta(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    (folder / "train").write_bytes(pickle.dumps(cifar_batch(30, 0, 100, b"fine_labels")))
    (folder / "test").write_bytes(pickle.dumps(cifar_batch(10, 5, 100, b"fine_labels")))
    names = [f"class{i:02d}".encode() for i in range(100)]
    (folder / "meta").write_bytes(pickle.dumps({b"fine_label_names": names}))
    monkeypatch.setenv("PROTOFL_CIFAR_ROOT", str(tmp_path))
    assert DATASET_REGISTRY.get("cifar100").is_available(tmp_path)
    assert not DATASET_REGISTRY.get("cifar10").is_available(tmp_path)
    ds = DATASET_REGISTRY.get("cifar100").loader(tmp_path, None)
    assert len(ds.classes) == 100 and ds.classes[3] == "class03"
    assert ds.domains[0].name == "cifar100" and len(ds.domains[0].test) == 10


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned",))


def test_cifar_refuses_code_in_pickles_and_names_bad_files(tmp_path: Path) -> None:
    root = make_cifar10(tmp_path / "c")
    folder = root / "cifar-10-batches-py"
    (folder / "data_batch_2").write_bytes(pickle.dumps({b"data": _Evil()}))
    with pytest.raises(DataFileError, match=r"data_batch_2.*refusing"):
        load_cifar10(tmp_path, str(root))
    (folder / "data_batch_2").write_bytes(pickle.dumps(cifar_batch(4, 0, 10, b"labels"))[:50])
    with pytest.raises(DataFileError, match="data_batch_2"):
        load_cifar10(tmp_path, str(root))
    with pytest.raises(DatasetRootError, match="cifar-10-batches-py"):
        load_cifar10(tmp_path, str(tmp_path))
    with pytest.raises(ValueError, match="protocol"):
        load_cifar10(tmp_path, str(root), protocol="vpdr")
