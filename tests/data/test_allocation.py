"""Client allocations and the papers' data presets."""

from __future__ import annotations

import numpy as np
import pytest

from protofl.data.allocation import (
    FEDDAP_ALLOCATIONS,
    PRESETS,
    per_client_fraction_shards,
    preset_values,
    resolve_allocation,
)
from protofl.data.domainnet import DOMAINNET_DOMAINS
from protofl.data.office import OFFICE_CALTECH10_DOMAINS
from protofl.data.pacs import PACS_DOMAINS
from protofl.data.partition import PartitionError


def test_feddap_tables_match_the_paper() -> None:
    assert resolve_allocation("feddap", OFFICE_CALTECH10_DOMAINS, 1, "office_caltech10") == {
        "amazon": 2,
        "caltech": 3,
        "dslr": 4,
        "webcam": 1,
    }
    pacs = resolve_allocation("feddap", PACS_DOMAINS, 1, "pacs")
    assert pacs == {"photo": 3, "art_painting": 2, "cartoon": 1, "sketch": 4}
    assert list(pacs) == list(PACS_DOMAINS)  # order of the given domains
    dn = resolve_allocation("feddap", DOMAINNET_DOMAINS, 1, "domainnet")
    assert dn == {
        "clipart": 3,
        "infograph": 1,
        "painting": 4,
        "quickdraw": 6,
        "real": 4,
        "sketch": 2,
    }
    assert sum(dn.values()) == 20
    for name, table in FEDDAP_ALLOCATIONS.items():
        assert all(v >= 1 for v in table.values()), name


def test_one_per_domain_equal_and_none() -> None:
    doms = ["a", "b", "c"]
    assert resolve_allocation(None, doms, 5) == {"a": 5, "b": 5, "c": 5}
    assert resolve_allocation("equal", doms, 2) == {"a": 2, "b": 2, "c": 2}
    assert resolve_allocation("one_per_domain", doms, 7) == {"a": 1, "b": 1, "c": 1}
    assert resolve_allocation("vpdr", doms, 7) == {"a": 1, "b": 1, "c": 1}


def test_holdout_subset_and_mapping() -> None:
    no_sketch = [d for d in PACS_DOMAINS if d != "sketch"]
    assert resolve_allocation("feddap", no_sketch, 1, "pacs") == {
        "photo": 3,
        "art_painting": 2,
        "cartoon": 1,
    }
    assert resolve_allocation({"a": 2, "b": 0}, ["a", "b"], 1) == {"a": 2, "b": 0}


@pytest.mark.parametrize(
    ("spec", "domains", "dataset", "match"),
    [
        ("feddap", ["mnist"], "digits", "defined for office_caltech10, pacs, domainnet"),
        ("feddap", ["photo", "mars"], "pacs", "mars"),
        ("uneven", ["a"], None, "valid: equal, one_per_domain, vpdr, feddap"),
        ({"a": 1}, ["a", "b"], None, r"missing \['b'\]"),
        ({"a": 1, "b": 1, "z": 1}, ["a", "b"], None, r"unknown \['z'\]"),
        ({"a": -1}, ["a"], None, "int >= 0"),
        ({"a": 0}, ["a"], None, "no client"),
    ],
)
def test_bad_allocations_fail_clearly(
    spec: object, domains: list[str], dataset: str | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_allocation(spec, domains, 1, dataset)  # type: ignore[arg-type]


def test_presets_values() -> None:
    assert preset_values("vpdr", "pacs")["train_fraction"] == 0.3
    assert preset_values("vpdr", "office_caltech10")["train_fraction"] == 0.3
    assert preset_values("vpdr", "digits")["train_fraction"] == 0.1
    assert preset_values("feddap", "pacs")["train_fraction"] == 0.3
    assert preset_values("feddap", "office_caltech10")["train_fraction"] == 0.2
    assert preset_values("feddap", "domainnet")["train_fraction"] == 0.1
    assert preset_values("feddap", "digits")["train_fraction"] == 0.01
    values = preset_values("feddap", "pacs")
    values["train_fraction"] = 1.0  # a copy
    assert PRESETS["feddap"]["pacs"]["train_fraction"] == 0.3
    with pytest.raises(ValueError, match="valid presets: vpdr, feddap"):
        preset_values("fedavg", "pacs")
    with pytest.raises(ValueError, match="covers: pacs, office_caltech10, digits"):
        preset_values("vpdr", "domainnet")


def test_per_client_fraction_shards_feddap_sampling() -> None:
    rng = np.random.default_rng(0)
    idx = np.arange(100)
    shards = per_client_fraction_shards(idx, 4, 0.3, rng)  # PACS sketch: 4 clients at 30%
    assert [len(s) for s in shards] == [30, 30, 30, 10]
    assert len(np.unique(np.concatenate(shards))) == 100
    with pytest.raises(PartitionError, match="client 4 with none"):
        per_client_fraction_shards(idx, 5, 0.3, rng)
    with pytest.raises(PartitionError, match="0 samples"):
        per_client_fraction_shards(np.arange(5), 2, 0.1, rng)
