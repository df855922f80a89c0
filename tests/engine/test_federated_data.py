"""``data.validation_fraction``: a seeded, stratified validation part of every client's training
data takes the test set's place, and the test set is never read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import protofl.engine.federated_data as federated_data
from protofl.config import ConfigError
from protofl.engine.federated_data import build_federated_data
from protofl.methods.checks import tiny_config


def _config(**data: Any) -> Any:
    cfg = tiny_config("fedproto", "none", clients_per_domain=2)
    return cfg.with_overrides([f"data.{k}={v}" for k, v in data.items()])


class _Unreadable:
    """Stands in for a test split's images: any read fails the test."""

    def __getitem__(self, item: Any) -> Any:
        raise AssertionError("the test images were read")


def test_validation_replaces_the_test_set_which_is_never_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from protofl.data.toy import make_toy

    splits: list[str] = []
    real = federated_data.cached_features

    def spy(home: Path, backbone: Any, dataset: str, domain: str, split: str, *a: Any, **k: Any):
        splits.append(split)
        return real(home, backbone, dataset, domain, split, *a, **k)

    monkeypatch.setattr(federated_data, "cached_features", spy)
    toy = make_toy()
    for dom in toy.domains:
        object.__setattr__(dom.test, "images", _Unreadable())  # reading it fails
    plain = build_federated_data(_config(), tmp_path, dataset=make_toy())
    assert "test" in splits
    splits.clear()
    held = build_federated_data(_config(validation_fraction=0.25), tmp_path, dataset=toy)
    assert splits and set(splits) == {"train"}  # no test feature was encoded or loaded
    assert [c.name for c in held.clients] == [c.name for c in plain.clients]
    for p, c in zip(plain.clients, held.clients):
        # the validation rows are the client's own training rows, disjoint from what it trains on
        assert len(c.train_y) + len(c.test_y) == len(p.train_y)
        assert torch.equal(
            torch.cat([c.train_z, c.test_z]).sort(0).values, p.train_z.sort(0).values
        )
        for y in torch.unique(p.train_y):  # stratified: every class gives about a quarter
            n = int((p.train_y == y).sum())
            assert int((c.test_y == y).sum()) == min(round(0.25 * n), n - 1)
    # seeded: the same seed gives the same split, another seed another one
    again = build_federated_data(_config(validation_fraction=0.25), tmp_path, dataset=toy)
    assert all(torch.equal(a.test_z, b.test_z) for a, b in zip(held.clients, again.clients))
    other = build_federated_data(
        _config(validation_fraction=0.25).with_overrides(["seed=1"]), tmp_path, dataset=toy
    )
    assert any(
        not np.array_equal(a.train_indices, b.train_indices)
        for a, b in zip(held.clients, other.clients)
    )


def test_unset_keeps_the_test_set() -> None:
    assert _config().data.validation_fraction is None


@pytest.mark.parametrize("bad", ["0", "1", "1.5", "-0.2"])
def test_bad_fraction_is_one_line_naming_the_key(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"^data\.validation_fraction=.* is out of range") as err:
        _config(validation_fraction=bad)
    assert "\n" not in str(err.value)


def test_a_fraction_that_holds_out_nothing_names_the_client(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data\.validation_fraction=0\.01 holds out no sample"):
        build_federated_data(_config(validation_fraction=0.01), tmp_path)


def test_the_console_names_texts_for_a_text_encoder() -> None:
    """The data and feature lines say "texts" for a text encoder (they said "images" for
    Rotten Tomatoes reviews through MiniLM)."""
    from protofl.engine.federated_data import fraction_line
    from protofl.models.backbones import FrozenBackbone
    from protofl.models.transformers_backbones import MiniLM

    assert MiniLM.items == "texts" and FrozenBackbone.items == "images"
    line = fraction_line("rotten_tomatoes", 0.1, 1020, 10201, 40, items=MiniLM.items)
    assert "1020 of 10201 training texts used by 40 client(s)" in line
