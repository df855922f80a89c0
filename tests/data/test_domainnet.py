"""DomainNet's preflight: the root's layout is checked before a run makes anything (issue
43).  Loading DomainNet is tested in test_imagefolder.py."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from protofl.data.domainnet import DOMAINNET_ENV
from protofl.data.imagefolder import DatasetRootError
from protofl.engine.federated_data import preflight
from tests.data.helpers import missing_root_makes_nothing, preflight_config, refused
from tests.data.test_imagefolder import make_domainnet


def test_domainnet_without_a_root_makes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing_root_makes_nothing(tmp_path, monkeypatch, "domainnet", DOMAINNET_ENV)


def test_domainnet_layout_is_checked_before_anything_is_made(tmp_path: Path) -> None:
    root = make_domainnet(tmp_path / "dn")
    preflight(preflight_config("data.name=domainnet", f"data.root={root}"))  # a whole tree
    wrong = tmp_path / "wrong"
    (wrong / "dogs").mkdir(parents=True)
    refused(
        tmp_path,
        DatasetRootError,
        rf"no domain folder .* under {re.escape(str(wrong))}",
        "data.name=domainnet",
        f"data.root={wrong}",
    )
    shutil.rmtree(root / "sketch" / "bird")
    refused(
        tmp_path,
        ValueError,
        rf"class\(es\) \['bird'\] have no folder in {re.escape(str(root / 'sketch'))}",
        "data.name=domainnet",
        f"data.root={root}",
    )
    shutil.rmtree(root / "painting")
    refused(
        tmp_path,
        DatasetRootError,
        rf"domain folder for 'painting' .* is missing under {re.escape(str(root))}",
        "data.name=domainnet",
        f"data.root={root}",
    )


def test_domainnet_lists_are_needed_only_under_the_official_protocol(tmp_path: Path) -> None:
    root = make_domainnet(tmp_path / "dn", lists=False)
    preflight(preflight_config("data.name=domainnet", f"data.root={root}"))  # falls back: vpdr
    preflight(
        preflight_config("data.name=domainnet", f"data.root={root}", "data.options.protocol=feddap")
    )
    refused(
        tmp_path,
        DatasetRootError,
        r"protocol 'official' needs the split lists; missing clipart_train\.txt",
        "data.name=domainnet",
        f"data.root={root}",
        "data.options.protocol=official",
    )
