"""``data.name: imagefolder``: your own images, in folders of any names (issue 43, item 2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from protofl.data import DATASET_REGISTRY
from protofl.data.imagefolder import DataFileError, DatasetRootError
from protofl.data.user_images import load_user_imagefolder


def _pngs(folder: Path, n: int, seed: int, size: tuple[int, int] = (10, 12)) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img_{i:02d}.png")


def _tree(root: Path, domains: dict[str, list[str]], n: int = 5) -> Path:
    for d_i, (domain, classes) in enumerate(domains.items()):
        for c_i, cls in enumerate(classes):
            _pngs(root / domain / cls, n, 100 * d_i + c_i)
    return root


def test_one_root_with_a_folder_per_domain_and_per_class(tmp_path: Path) -> None:
    root = _tree(
        tmp_path / "mine",
        {"studio": ["pear", "Apple", "fig"], "garden": ["fig", "apple", "pear"]},
    )
    data = load_user_imagefolder(tmp_path, str(root), image_size=8)
    assert data.name == "imagefolder"
    # the union of the class folder names (matched in any case), sorted: same label everywhere
    assert data.classes == ("apple", "fig", "pear")
    assert [d.name for d in data.domains] == ["garden", "studio"]
    for dom in data.domains:
        assert dom.train.images.shape[1:] == (8, 8, 3)
        assert len(dom.train) + len(dom.test) == 15
        assert len(dom.test) == 3  # the vpdr 80/20 split by default
        assert sorted(set(dom.train.labels.tolist()) | set(dom.test.labels.tolist())) == [0, 1, 2]
    assert "imagefolder" in DATASET_REGISTRY


def test_one_root_per_domain_as_a_mapping_or_a_list(tmp_path: Path) -> None:
    _pngs(tmp_path / "cam_a" / "cat", 5, 1)
    _pngs(tmp_path / "cam_a" / "dog", 5, 2)
    _pngs(tmp_path / "elsewhere" / "phone" / "dog", 5, 3)
    _pngs(tmp_path / "elsewhere" / "phone" / "cat", 5, 4)
    roots = {"camera": str(tmp_path / "cam_a"), "phone": str(tmp_path / "elsewhere" / "phone")}
    data = load_user_imagefolder(tmp_path, None, roots=roots, image_size=6)
    assert [d.name for d in data.domains] == ["camera", "phone"]  # the mapping's order
    assert data.classes == ("cat", "dog")
    listed = load_user_imagefolder(tmp_path, None, roots=list(roots.values()), image_size=6)
    assert [d.name for d in listed.domains] == ["cam_a", "phone"]  # named like their folders
    # a root of class folders is one domain
    single = load_user_imagefolder(tmp_path, str(tmp_path / "cam_a"), image_size=6)
    assert [d.name for d in single.domains] == ["cam_a"] and single.classes == ("cat", "dog")


def test_errors_name_the_folder(tmp_path: Path) -> None:
    root = _tree(tmp_path / "a", {"one": ["x", "y"], "two": ["x"]})
    with pytest.raises(DataFileError, match=r"domain 'two' \(.*two\) has no images for class"):
        load_user_imagefolder(tmp_path, str(root), image_size=8)
    both = load_user_imagefolder(tmp_path, str(root), image_size=8, allow_missing_classes=True)
    assert both.classes == ("x", "y")

    empty = tmp_path / "b"
    _tree(empty, {"one": ["x"]})
    (empty / "two" / "x").mkdir(parents=True)
    with pytest.raises(DataFileError, match=r"class folder .*two.x has no images"):
        load_user_imagefolder(tmp_path, str(empty), image_size=8)
    with pytest.raises(DataFileError, match=r"domain 'two': .*two has no images"):
        load_user_imagefolder(tmp_path, str(empty), image_size=8, skip_corrupt=True)

    flat = tmp_path / "c"
    _tree(flat, {"one": ["x"]})
    (flat / "two").mkdir()
    (flat / "two" / "notes.txt").write_text("no class folders here")
    with pytest.raises(DatasetRootError, match=r"domain 'two': .*two holds no class folders"):
        load_user_imagefolder(tmp_path, str(flat), image_size=8)

    with pytest.raises(DatasetRootError, match=r"root of domain 'gone' .*nowhere"):
        load_user_imagefolder(tmp_path, None, roots={"gone": str(tmp_path / "nowhere")})
    with pytest.raises(ValueError, match="unknown option"):
        load_user_imagefolder(tmp_path, str(root), colour="red")


def test_a_run_states_the_train_fraction_on_the_console(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from protofl.config import ExperimentConfig
    from protofl.engine.runner import run_experiment

    root = _tree(tmp_path / "mine", {"studio": ["a", "b"], "garden": ["a", "b"]}, n=20)
    config = ExperimentConfig().with_overrides(
        [
            "data.name=imagefolder",
            f"data.root={root}",
            "backbone.name=pixels",
            "backbone.image_size=8",
            "federation.rounds=1",
            "method.name=fedproto",
        ]
    )
    run_experiment(config, out=tmp_path / "runs", home=tmp_path / "home", progress=True)
    err = capsys.readouterr().err
    # 32 training images per domain (80% of 40); 10% of each class (16) rounds up to 2
    assert (
        "data: imagefolder, train_fraction 0.1: 8 of 64 training images used by 2 client(s) "
        "(data.train_fraction; 1 uses them all)" in err
    )
