"""Image-folder benchmarks (PACS, Office-Caltech-10, Office-Home, VLCS, DomainNet) on fixture trees.

Every fixture is built in the benchmark's distributed layout with a few tiny images per class and
domain. Each image is one flat colour that encodes its class, so label <-> image mapping can be
checked after decoding and resizing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from protofl.data import DATASET_REGISTRY
from protofl.data.domainnet import FEDDAP_CLASSES, load_domainnet
from protofl.data.imagefolder import (
    DataFileError,
    DatasetRootError,
    decode_image,
    protocol_split,
    skipped_files,
    walk_images,
)
from protofl.data.office import (
    OFFICE_CALTECH10_CLASSES,
    OFFICE_HOME_CLASSES,
    load_office_caltech10,
    load_office_home,
)
from protofl.data.pacs import PACS_CLASSES, PACS_DOMAINS, load_pacs
from protofl.data.vlcs import VLCS_CLASSES, load_vlcs


def colour(label: int) -> tuple[int, int, int]:
    """A flat colour per class (JPEG keeps flat colours within a few levels)."""
    return (20 + 9 * (label % 25), 200 - 7 * (label // 25) * 10, 90)


def write_image(path: Path, label: int, *, size: tuple[int, int] = (14, 10)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", size, colour(label))
    if path.suffix.lower() == ".png":
        img.save(path, format="PNG")
    else:
        img.save(path, format="JPEG", quality=95)


def labels_match_colours(images: np.ndarray, labels: np.ndarray) -> bool:
    means = images.reshape(len(images), -1, 3).mean(axis=1)
    want = np.array([colour(int(y)) for y in labels], dtype=np.float64)
    return bool(np.all(np.abs(means - want) < 6))


# ---------------------------------------------------------------- PACS


def make_pacs(root: Path, per_class: int = 3, *, lists: bool = True) -> Path:
    """<root>/kfold/<domain>/<class>/<file>; <root>/splits/<domain>_<split>_kfold.txt lists."""
    for d in PACS_DOMAINS:
        rows: list[tuple[str, int, int]] = []
        for c, cls in enumerate(PACS_CLASSES):
            for i in range(per_class):
                ext = ".png" if d == "sketch" else ".jpg"
                rel = f"{d}/{cls}/pic_{i:03d}{ext}"
                write_image(root / "kfold" / rel, c)
                rows.append((rel, c + 1, i))
        if lists:
            split = root / "splits"
            split.mkdir(parents=True, exist_ok=True)
            train = [f"{r} {y}" for r, y, i in rows if i < per_class - 1]
            cross = [f"{r} {y}" for r, y, i in rows if i == per_class - 1]
            (split / f"{d}_train_kfold.txt").write_text("\n".join(train) + "\n")
            (split / f"{d}_crossval_kfold.txt").write_text("\n".join(cross) + "\n")
            (split / f"{d}_test_kfold.txt").write_text("\n".join(train + cross) + "\n")
    return root


def test_pacs_official_lists_class_order_and_sizes(tmp_path: Path) -> None:
    root = make_pacs(tmp_path / "PACS")
    ds = load_pacs(tmp_path / "home", str(root), image_size=8)
    assert ds.classes == ("dog", "elephant", "giraffe", "guitar", "horse", "house", "person")
    assert [d.name for d in ds.domains] == ["photo", "art_painting", "cartoon", "sketch"]
    for dom in ds.domains:
        assert len(dom.train) == 14 and len(dom.test) == 7
        assert dom.train.images.shape == (14, 8, 8, 3)
        assert dom.train.images.dtype == np.uint8
        assert sorted(set(dom.test.labels.tolist())) == list(range(7))
        assert labels_match_colours(dom.train.images, dom.train.labels)
        assert labels_match_colours(dom.test.images, dom.test.labels)
        assert "crossval_kfold" in dom.source and dom.real


def test_pacs_feddap_protocol_uses_test_kfold_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = make_pacs(tmp_path / "PACS")
    with caplog.at_level(logging.WARNING, logger="protofl.data"):
        ds = load_pacs(tmp_path, str(root), image_size=8, protocol="feddap")
    dom = ds.domain("photo")
    assert len(dom.train) == 14 and len(dom.test) == 21
    assert "also training images" in dom.source
    assert any("test_kfold is the whole domain" in r.message for r in caplog.records)


def test_pacs_vpdr_protocol_is_deterministic_80_20(tmp_path: Path) -> None:
    root = make_pacs(tmp_path / "PACS")
    a = load_pacs(tmp_path, str(root), image_size=6, protocol="vpdr")
    b = load_pacs(tmp_path, str(root), image_size=6, protocol="vpdr")
    for da, db in zip(a.domains, b.domains):
        assert len(da.train) == 21 - int(21 * 0.2) and len(da.test) == int(21 * 0.2)
        np.testing.assert_array_equal(da.train.images, db.train.images)
        np.testing.assert_array_equal(da.test.labels, db.test.labels)
    c = load_pacs(tmp_path, str(root), image_size=6, protocol="vpdr", split_seed=3)
    assert any(
        not np.array_equal(x.test.labels, y.test.labels) for x, y in zip(a.domains, c.domains)
    )


def test_pacs_without_lists_falls_back_to_vpdr_or_fails_when_asked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = make_pacs(tmp_path / "PACS", lists=False)
    with caplog.at_level(logging.WARNING, logger="protofl.data"):
        ds = load_pacs(tmp_path, str(root), image_size=6)
    assert "protocol vpdr" in ds.domains[0].source
    assert any("split lists not found" in r.message for r in caplog.records)
    with pytest.raises(DatasetRootError, match=r"photo_train_kfold\.txt"):
        load_pacs(tmp_path, str(root), image_size=6, protocol="official")


def test_pacs_holdout_domain_tests_on_whole_domain(tmp_path: Path) -> None:
    root = make_pacs(tmp_path / "PACS")
    ds = load_pacs(tmp_path, str(root), image_size=6, holdout_domain="sketch")
    sketch = ds.domain("sketch")
    assert len(sketch.train) == 0 and sketch.train.images.shape == (0, 6, 6, 3)
    assert len(sketch.test) == 21 and "held out" in sketch.source
    assert len(ds.domain("photo").train) == 14


def test_pacs_domains_option_and_env_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_pacs(tmp_path / "PACS", per_class=2)
    monkeypatch.setenv("PROTOFL_PACS_ROOT", str(root))
    assert DATASET_REGISTRY.get("pacs").is_available(tmp_path)
    loader: Any = DATASET_REGISTRY.get("pacs").loader
    ds = loader(tmp_path, None, image_size=5, domains=["sketch"])
    assert [d.name for d in ds.domains] == ["sketch"]


def test_pacs_missing_root_names_path_layout_and_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetRootError) as err:
        load_pacs(tmp_path, str(missing))
    msg = str(err.value)
    assert str(missing) in msg and "kfold/" in msg and "_train_kfold.txt" in msg
    assert "domaingeneralization.github.io" in msg
    monkeypatch.delenv("PROTOFL_PACS_ROOT", raising=False)
    with pytest.raises(DatasetRootError, match="PROTOFL_PACS_ROOT"):
        load_pacs(tmp_path, None)
    assert not DATASET_REGISTRY.get("pacs").is_available(tmp_path)


def test_pacs_root_without_domains_says_what_is_there(tmp_path: Path) -> None:
    (tmp_path / "x" / "something").mkdir(parents=True)
    with pytest.raises(DatasetRootError, match="something"):
        load_pacs(tmp_path, str(tmp_path / "x"))


def test_unknown_option_names_it_and_the_allowed_ones(tmp_path: Path) -> None:
    root = make_pacs(tmp_path / "PACS", per_class=1)
    with pytest.raises(ValueError, match=r"(?s)'colour_jitter'.*allowed options.*image_size"):
        load_pacs(tmp_path, str(root), colour_jitter=True)
    with pytest.raises(ValueError, match="valid protocols"):
        load_pacs(tmp_path, str(root), protocol="random")
    with pytest.raises(ValueError, match="image_size"):
        load_pacs(tmp_path, str(root), image_size=0)


def test_pacs_corrupt_image_fails_naming_file_or_is_skipped_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = make_pacs(tmp_path / "PACS")
    bad = root / "kfold" / "photo" / "dog" / "pic_000.jpg"
    bad.write_bytes(b"not an image at all")
    with pytest.raises(DataFileError) as err:
        load_pacs(tmp_path, str(root), image_size=6)
    assert str(bad) in str(err.value) and "skip_corrupt" in str(err.value)
    with caplog.at_level(logging.WARNING, logger="protofl.data"):
        ds = load_pacs(tmp_path, str(root), image_size=6, skip_corrupt=True)
    assert len(ds.domain("photo").train) == 13
    assert "skip_corrupt: 1 file(s) skipped" in ds.domain("photo").source
    assert skipped_files("pacs") == {"photo": [(str(bad), skipped_files("pacs")["photo"][0][1])]}
    assert any("skipped 1" in r.message for r in caplog.records)


def test_truncated_image_fails_naming_file(tmp_path: Path) -> None:
    path = tmp_path / "a.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(
        path, quality=95
    )
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataFileError, match=r"a\.jpg"):
        decode_image(path, 8)


def test_pacs_split_list_naming_missing_file(tmp_path: Path) -> None:
    root = make_pacs(tmp_path / "PACS")
    gone = root / "kfold" / "cartoon" / "horse" / "pic_001.jpg"
    gone.unlink()
    with pytest.raises(DataFileError) as err:
        load_pacs(tmp_path, str(root), image_size=6)
    assert str(gone) in str(err.value) and "cartoon_train_kfold.txt" in str(err.value)
    ds = load_pacs(tmp_path, str(root), image_size=6, skip_corrupt=True)
    assert len(ds.domain("cartoon").train) == 13
    assert skipped_files("pacs")["cartoon"][0][0] == str(gone)


def test_pacs_list_label_disagreeing_with_folder_fails(tmp_path: Path) -> None:
    root = make_pacs(tmp_path / "PACS", per_class=2)
    lst = root / "splits" / "photo_train_kfold.txt"
    lst.write_text(lst.read_text().replace("photo/dog/pic_000.jpg 1", "photo/dog/pic_000.jpg 3"))
    with pytest.raises(DataFileError, match=r"photo_train_kfold\.txt"):
        load_pacs(tmp_path, str(root), image_size=6)


def test_empty_class_folder_fails_naming_it(tmp_path: Path) -> None:
    root = make_pacs(tmp_path / "PACS", per_class=2, lists=False)
    empty = root / "kfold" / "photo" / "giraffe"
    for f in empty.iterdir():
        f.unlink()
    with pytest.raises(DataFileError, match=str(empty)):
        load_pacs(tmp_path, str(root), image_size=6, protocol="vpdr")
    ds = load_pacs(tmp_path, str(root), image_size=6, protocol="vpdr", skip_corrupt=True)
    assert "skip_corrupt: 1" in ds.domain("photo").source


# ---------------------------------------------------------------- Office-Caltech-10


def make_office(root: Path, per_class: int = 2) -> Path:
    base = root / "Office_Caltech_10"
    for d in ("amazon", "Caltech", "dslr", "webcam"):
        for c, cls in enumerate(OFFICE_CALTECH10_CLASSES):
            for i in range(per_class):
                sub = base / d / "images" if d == "dslr" else base / d
                write_image(sub / cls / f"frame_{i:04d}.jpg", c, size=(9 + i, 7))
    return root


def test_office_caltech10_default_vpdr_and_feddap_rule(tmp_path: Path) -> None:
    root = make_office(tmp_path / "data")
    ds = load_office_caltech10(tmp_path, str(root), image_size=7)
    assert ds.classes == OFFICE_CALTECH10_CLASSES
    assert [d.name for d in ds.domains] == ["amazon", "caltech", "dslr", "webcam"]
    for dom in ds.domains:
        assert (len(dom.train), len(dom.test)) == (16, 4)
        assert "protocol vpdr" in dom.source
        assert labels_match_colours(dom.train.images, dom.train.labels)
    fd = load_office_caltech10(tmp_path, str(root), image_size=7, protocol="feddap")
    for dom in fd.domains:
        # ImageFolder order: 2 images per class, so samples 8, 9, 18, 19 are test.
        assert dom.test.labels.tolist() == [4, 4, 9, 9]
        assert len(dom.train) == 16
    with pytest.raises(ValueError, match="no official split"):
        load_office_caltech10(tmp_path, str(root), protocol="official")


def test_office_presplit_folders_are_the_official_split(tmp_path: Path) -> None:
    base = tmp_path / "oc"
    for d in ("amazon", "caltech", "dslr", "webcam"):
        for split, n in (("train", 2), ("test", 1)):
            for c, cls in enumerate(OFFICE_CALTECH10_CLASSES):
                for i in range(n):
                    write_image(base / d / split / cls / f"{i}.jpg", c)
    ds = load_office_caltech10(tmp_path, str(base), image_size=5)
    assert (len(ds.domains[0].train), len(ds.domains[0].test)) == (20, 10)
    assert "official" in ds.domains[0].source


def test_unknown_class_folder_fails(tmp_path: Path) -> None:
    root = make_office(tmp_path / "data", per_class=1)
    (root / "Office_Caltech_10" / "amazon" / "tripod").mkdir()
    with pytest.raises(DataFileError, match="tripod"):
        load_office_caltech10(tmp_path, str(root), image_size=5)


# ---------------------------------------------------------------- Office-Home


def test_office_home_65_classes_sorted_with_real_world_space(tmp_path: Path) -> None:
    base = tmp_path / "OfficeHomeDataset_10072016"
    for d in ("Art", "Real World"):
        for c, cls in enumerate(OFFICE_HOME_CLASSES):
            write_image(base / d / cls / "00001.jpg", c)
    ds = load_office_home(
        tmp_path, str(tmp_path), image_size=4, domains=["art", "real_world"], protocol="feddap"
    )
    assert len(ds.classes) == 65
    assert ds.classes.index("TV") + 1 == ds.classes.index("Table")
    assert ds.classes[0] == "Alarm_Clock" and ds.classes[-1] == "Webcam"
    dom = ds.domain("real_world")
    assert len(dom.train) + len(dom.test) == 65
    assert len(dom.test) == sum(1 for i in range(65) if i % 10 > 7)
    assert labels_match_colours(dom.test.images, dom.test.labels)


# ---------------------------------------------------------------- VLCS


def test_vlcs_aliases_and_original_presplit_layout(tmp_path: Path) -> None:
    base = tmp_path / "VLCS"
    # Original form: numbered class folders, train/ and test/ per domain.
    for split, n in (("train", 3), ("test", 1)):
        for c in range(5):
            for i in range(n):
                write_image(base / "CALTECH" / split / str(c) / f"{i}.jpg", c)
    # DomainBed form with domainlab-style alias folder names.
    alias = {"vogel": 0, "auto": 1, "stuhl": 2, "hund": 3, "mensch": 4}
    for d in ("LabelMe", "SUN09", "VOC2007"):
        for folder, c in alias.items():
            for i in range(4):
                write_image(base / d / folder / f"{i}.jpg", c)
        write_image(base / d / "dog" / "extra.jpg", 3)  # merges with hund
    ds = load_vlcs(tmp_path, str(tmp_path), image_size=6)
    assert ds.classes == VLCS_CLASSES == ("bird", "car", "chair", "dog", "person")
    cal = ds.domain("caltech")
    assert (len(cal.train), len(cal.test)) == (15, 5) and "official" in cal.source
    lab = ds.domain("labelme")
    assert len(lab.train) + len(lab.test) == 21 and "vpdr" in lab.source
    allx = np.concatenate([lab.train.images, lab.test.images])
    ally = np.concatenate([lab.train.labels, lab.test.labels])
    assert labels_match_colours(allx, ally)
    assert np.bincount(ally).tolist() == [4, 4, 4, 5, 4]


# ---------------------------------------------------------------- DomainNet


def make_domainnet(root: Path, *, lists: bool = True) -> Path:
    classes = ["aircraft_carrier", *FEDDAP_CLASSES, "zigzag"]
    from protofl.data.domainnet import DOMAINNET_DOMAINS

    for d in DOMAINNET_DOMAINS:
        train: list[str] = []
        test: list[str] = []
        for k, cls in enumerate(classes):
            for i in range(2):
                rel = f"{d}/{cls}/{d}_{k:03d}_{i:06d}.jpg"
                write_image(root / rel, k)
                (train if i == 0 else test).append(f"{rel} {k * 7}")
        if lists:
            (root / f"{d}_train.txt").write_text("\n".join(train) + "\n")
            (root / f"{d}_test.txt").write_text("\n".join(test) + "\n")
    return root


def test_domainnet_feddap_subset_official_lists(tmp_path: Path) -> None:
    root = make_domainnet(tmp_path / "domainnet")
    ds = load_domainnet(tmp_path, str(root), image_size=5)
    assert ds.classes == FEDDAP_CLASSES
    assert [d.name for d in ds.domains] == [
        "clipart",
        "infograph",
        "painting",
        "quickdraw",
        "real",
        "sketch",
    ]
    for dom in ds.domains:
        assert (len(dom.train), len(dom.test)) == (10, 10)
        assert dom.train.labels.tolist() == list(range(10))
        # Fixture colours are keyed by the folder position (bird is folder 1).
        means = dom.train.images.reshape(10, -1, 3).mean(axis=1)
        want = np.array([colour(k + 1) for k in range(10)], dtype=np.float64)
        assert np.all(np.abs(means - want) < 6)


def test_domainnet_classes_option_and_typo(tmp_path: Path) -> None:
    root = make_domainnet(tmp_path / "dn")
    ds = load_domainnet(tmp_path, str(root), image_size=5, classes=["zigzag", "bird"])
    assert ds.classes == ("zigzag", "bird")
    assert sorted(ds.domains[0].train.labels.tolist()) == [0, 1]
    every = load_domainnet(tmp_path, str(root), image_size=4, classes="all", domains=["real"])
    assert len(every.classes) == 12 and every.classes[0] == "aircraft_carrier"
    with pytest.raises(ValueError, match="did you mean 'zebra'"):
        load_domainnet(tmp_path, str(root), classes=["zebraa"])


def test_domainnet_feddap_index_rule_and_missing_lists(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = make_domainnet(tmp_path / "dn", lists=False)
    ds = load_domainnet(tmp_path, str(root), image_size=4, protocol="feddap", domains=["sketch"])
    dom = ds.domains[0]
    assert (len(dom.train), len(dom.test)) == (16, 4)
    assert dom.test.labels.tolist() == [4, 4, 9, 9]
    with caplog.at_level(logging.WARNING, logger="protofl.data"):
        fallback = load_domainnet(tmp_path, str(root), image_size=4, domains=["real"])
    assert "vpdr" in fallback.domains[0].source
    with pytest.raises(DatasetRootError, match=r"real_train\.txt"):
        load_domainnet(tmp_path, str(root), protocol="official", domains=["real"])


# ---------------------------------------------------------------- helpers


def test_protocol_split_rules() -> None:
    tr, te = protocol_split(25, "feddap")
    assert te.tolist() == [8, 9, 18, 19] and len(tr) == 21
    tr, te = protocol_split(10, "vpdr", 1)
    assert len(te) == 2 and sorted([*tr, *te]) == list(range(10))
    with pytest.raises(ValueError):
        protocol_split(3, "other")


def test_walk_images_imagefolder_order_skips_hidden(tmp_path: Path) -> None:
    for name in ("b.jpg", "a.PNG", "._a.jpg", "notes.txt", "sub/c.jpeg"):
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")
    assert [p.relative_to(tmp_path).as_posix() for p in walk_images(tmp_path)] == [
        "a.PNG",
        "b.jpg",
        "sub/c.jpeg",
    ]


def test_resize_uses_fixed_filter_and_converts_grey_and_rgba(tmp_path: Path) -> None:
    grey = tmp_path / "g.png"
    Image.new("L", (20, 30), 77).save(grey)
    rgba = tmp_path / "r.png"
    Image.new("RGBA", (5, 5), (10, 20, 30, 0)).save(rgba)
    g = decode_image(grey, 16)
    assert g.shape == (16, 16, 3) and (g == 77).all()
    r = decode_image(rgba, None)
    assert r.shape == (5, 5, 3) and r[0, 0].tolist() == [10, 20, 30]
