"""Preflight covers data roots, layouts, HF columns and optional extras: nothing is created
under --out before they pass (issue 43, item 6)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from protofl.cli import main
from protofl.config import ExperimentConfig
from protofl.data.imagefolder import DatasetRootError
from protofl.engine.runner import run_experiment
from protofl.errors import ConfigError

FAST = ["backbone.name=pixels", "backbone.image_size=8", "federation.rounds=1"]


def _config(*overrides: str) -> ExperimentConfig:
    return ExperimentConfig().with_overrides([*FAST, *overrides])


def _nothing_made(out: Path) -> None:
    assert not out.exists() or not any(out.iterdir()), sorted(out.rglob("*"))


def test_pacs_without_a_root_or_with_a_wrong_layout_makes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PROTOFL_PACS_ROOT", raising=False)
    out = tmp_path / "runs"
    with pytest.raises(DatasetRootError, match="needs its root folder"):
        run_experiment(_config("data.name=pacs"), out=out, home=tmp_path)
    _nothing_made(out)
    wrong = tmp_path / "wrong"
    (wrong / "dogs" / "img").mkdir(parents=True)  # no PACS domain folder anywhere
    with pytest.raises(DatasetRootError, match=r"no domain folder .* under .*wrong"):
        run_experiment(_config("data.name=pacs", f"data.root={wrong}"), out=out, home=tmp_path)
    _nothing_made(out)
    (wrong / "photo" / "dog").mkdir(parents=True)  # one domain of four
    with pytest.raises(DatasetRootError, match=r"'art_painting'.* is missing"):
        run_experiment(_config("data.name=pacs", f"data.root={wrong}"), out=out, home=tmp_path)
    _nothing_made(out)


def test_imagefolder_layout_is_checked_first(tmp_path: Path) -> None:
    root = tmp_path / "mine"
    (root / "studio" / "apple").mkdir(parents=True)  # a class folder without images
    out = tmp_path / "runs"
    with pytest.raises(ValueError, match=r"class folder .*apple has no images"):
        run_experiment(
            _config("data.name=imagefolder", f"data.root={root}"), out=out, home=tmp_path
        )
    _nothing_made(out)


def test_tensorboard_missing_is_one_line_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the checkout: pip install -e '.'
    out = tmp_path / "runs"
    argv = ["run", "--out", str(out)]
    for o in [*FAST, "run.tensorboard=true"]:
        argv += ["--set", o]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "pip install -e '.[tensorboard]'" in err and "run.tensorboard=false" in err
    _nothing_made(out)


datasets = pytest.importorskip("datasets", reason="the optional extra protofl[hf] is missing")


def _hf_set(root: Path, image: object, features: object | None = None) -> None:
    n = 10
    datasets.Dataset.from_dict(
        {"image": image, "label": [i % 2 for i in range(n)], "domain": ["a", "b"] * (n // 2)},
        features=features,
    ).save_to_disk(str(root))


def test_hf_columns_are_checked_before_anything_is_made(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    vectors = tmp_path / "vectors"  # a 1-D float column is no image column
    _hf_set(vectors, [np.linspace(0, 1, 16, dtype=np.float32) for _ in range(10)])
    with pytest.raises(ConfigError, match=r"image column 'image' holds .*not images"):
        run_experiment(_config("data.name=hf", f"data.root={vectors}"), out=out, home=tmp_path)
    _nothing_made(out)
    missing = tmp_path / "missing"
    _hf_set(missing, [np.zeros((4, 4, 3), np.uint8) for _ in range(10)])
    with pytest.raises(ConfigError, match=r"no label column 'kind'.*columns found"):
        run_experiment(
            _config("data.name=hf", f"data.root={missing}", "data.options.label_column=kind"),
            out=out,
            home=tmp_path,
        )
    _nothing_made(out)


def test_hf_array_image_column_is_read_as_images(tmp_path: Path) -> None:
    from protofl.data.hfdatasets import load_hf_dataset

    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (6, 6, 3), dtype=np.uint8) for _ in range(10)]
    nested = tmp_path / "nested"  # numpy arrays become nested lists of uint8
    _hf_set(nested, images)
    fixed = tmp_path / "array3d"
    feats = datasets.Features(
        {
            "image": datasets.Array3D((6, 6, 3), "uint8"),
            "label": datasets.Value("int64"),
            "domain": datasets.Value("string"),
        }
    )
    _hf_set(fixed, images, feats)
    for root in (nested, fixed):
        data = load_hf_dataset(tmp_path, str(root))
        a = data.domain("a")
        assert a.train.images.dtype == np.uint8 and a.train.images.shape[1:] == (6, 6, 3)
        rows = np.concatenate([a.train.images, a.test.images])
        assert any(np.array_equal(rows[0], im) for im in images[0::2])
