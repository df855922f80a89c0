from __future__ import annotations

import numpy as np
import pytest

from protofl.data.partition import (
    PartitionError,
    dirichlet_label_split,
    dirichlet_split,
    equal_shards,
    subsample,
    validation_split,
)


def test_subsample_is_stratified_and_deterministic() -> None:
    labels = np.repeat(np.arange(10), 100)
    a = subsample(labels, 0.1, np.random.default_rng(0))
    b = subsample(labels, 0.1, np.random.default_rng(0))
    assert np.array_equal(a, b)
    assert len(a) == 100
    assert np.all(np.bincount(labels[a]) == 10)
    assert len(np.unique(a)) == len(a)


def test_subsample_fraction_one_and_cap() -> None:
    labels = np.repeat(np.arange(4), 5)
    assert np.array_equal(subsample(labels, 1.0, np.random.default_rng(0)), np.arange(20))
    assert len(subsample(labels, 1.0, np.random.default_rng(0), max_count=8)) == 8


def test_equal_shards_cover_everything_once() -> None:
    idx = np.arange(103)
    shards = equal_shards(idx, 4, np.random.default_rng(1))
    assert sorted(np.concatenate(shards).tolist()) == idx.tolist()
    assert {len(s) for s in shards} <= {25, 26}
    with pytest.raises(PartitionError, match="3 samples"):
        equal_shards(np.arange(3), 4, np.random.default_rng(0))


def test_dirichlet_split_respects_minimum_and_fails_with_numbers() -> None:
    labels = np.repeat(np.arange(10), 50)
    idx = np.arange(500)
    shards = dirichlet_split(idx, labels, 5, 0.5, np.random.default_rng(0), min_size=10)
    assert sum(len(s) for s in shards) == 500
    assert min(len(s) for s in shards) >= 10
    with pytest.raises(PartitionError, match=r"after 5 tries \(minimum 60\)"):
        dirichlet_split(idx, labels, 8, 0.01, np.random.default_rng(0), min_size=60, max_tries=5)
    with pytest.raises(PartitionError, match="cannot give 20 clients"):
        dirichlet_split(idx[:10], labels[:10], 20, 1.0, np.random.default_rng(0))


def test_per_class_dirichlet_leaves_clients_empty_at_cross_device_scale() -> None:
    labels = np.repeat(np.arange(10), 2000)  # 20,000 samples, 4,000 clients: 5 each on average
    with pytest.raises(PartitionError, match="only 0 samples"):
        dirichlet_split(np.arange(20_000), labels, 4000, 0.5, np.random.default_rng(0), max_tries=3)


def test_client_wise_dirichlet_gives_every_client_an_equal_skewed_share() -> None:
    labels = np.repeat(np.arange(10), 2000)
    idx = np.arange(20_000)
    shards = dirichlet_label_split(idx, labels, 4000, 0.5, np.random.default_rng(0))
    assert sorted(np.concatenate(shards).tolist()) == idx.tolist()  # a partition
    assert {len(s) for s in shards} == {5}
    again = dirichlet_label_split(idx, labels, 4000, 0.5, np.random.default_rng(0))
    assert all(np.array_equal(a, b) for a, b in zip(shards, again))

    def classes_per_client(parts: list[np.ndarray]) -> float:
        return float(np.mean([len(np.unique(labels[p])) for p in parts]))

    # label skew: fewer distinct classes per client than an iid split of the same sizes, and
    # the more so the smaller alpha
    iid = equal_shards(idx, 400, np.random.default_rng(0))
    skewed = dirichlet_label_split(idx, labels, 400, 0.5, np.random.default_rng(0))
    flat = dirichlet_label_split(idx, labels, 400, 100.0, np.random.default_rng(0))
    assert classes_per_client(skewed) < classes_per_client(flat) - 2
    assert abs(classes_per_client(flat) - classes_per_client(iid)) < 0.5
    with pytest.raises(PartitionError, match="cannot give 20 clients"):
        dirichlet_label_split(idx[:10], labels[:10], 20, 1.0, np.random.default_rng(0))


def test_validation_split_is_stratified_and_keeps_a_training_sample() -> None:
    labels = np.array([0] * 10 + [1] * 4 + [2])
    train, val = validation_split(labels, 0.5, np.random.default_rng(0))
    assert np.bincount(labels[val], minlength=3).tolist() == [5, 2, 0]  # class 2 keeps its one
    assert sorted([*train, *val]) == list(range(len(labels)))


def test_validation_split_refuses_a_fraction_that_holds_out_nothing() -> None:
    with pytest.raises(PartitionError, match="holds out none"):
        validation_split(np.array([0, 1, 2]), 0.2, np.random.default_rng(0))
    with pytest.raises(PartitionError, match=r"must lie in \(0, 1\)"):
        validation_split(np.array([0, 0]), 1.0, np.random.default_rng(0))
