"""FINCH on small cases with known partitions (Sarfraz et al., CVPR 2019)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from protofl.methods.finch import (
    cluster_per_class,
    coarsest_partition,
    finch,
    finch_cluster_fn,
    first_neighbours,
    relabel,
)


def _angles(degrees: list[float]) -> torch.Tensor:
    return torch.tensor([[math.cos(math.radians(a)), math.sin(math.radians(a))] for a in degrees])


def test_two_direction_groups_give_two_clusters_then_one() -> None:
    # cosine first neighbours: 0->4, 4->0, 10->4 ; 90->97, 97->90
    x = _angles([0, 4, 10, 90, 97])
    assert first_neighbours(x).tolist() == [1, 0, 1, 4, 3]
    levels = finch(x)
    assert [lv.tolist() for lv in levels] == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]]
    assert coarsest_partition(x).tolist() == [0, 0, 0, 1, 1]


def test_three_level_hierarchy_on_a_line() -> None:
    # pairs merge first (4 clusters), then pairs of pairs by their means 0.5<->10.5,
    # 100.5<->110.5 (2 clusters), then everything (1 cluster)
    x = torch.tensor([[0.0], [1.0], [10.0], [11.0], [100.0], [101.0], [110.0], [111.0]])
    levels = finch(x, metric="euclidean")
    assert [lv.tolist() for lv in levels] == [
        [0, 0, 1, 1, 2, 2, 3, 3],
        [0, 0, 0, 0, 1, 1, 1, 1],
        [0] * 8,
    ]
    assert coarsest_partition(x, "euclidean").tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_small_inputs() -> None:
    assert finch(torch.zeros(0, 3)) == []
    assert finch(torch.ones(1, 3))[0].tolist() == [0]
    assert [
        lv.tolist() for lv in finch(torch.randn(2, 3, generator=torch.Generator().manual_seed(0)))
    ] == [[0, 0]]
    assert coarsest_partition(torch.zeros(0, 2)).tolist() == []
    assert coarsest_partition(torch.ones(1, 2)).tolist() == [0]
    assert coarsest_partition(torch.tensor([[1.0, 0.0], [0.0, 1.0]])).tolist() == [0, 0]


def test_levels_at_least_halve_and_are_nested_and_canonical() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(200, 8, generator=gen)
    levels = finch(x)
    ks = [int(lv.max()) + 1 for lv in levels]
    assert ks[-1] == 1
    for a, b in itertools.pairwise(ks):
        assert b <= a // 2
    for fine, coarse in itertools.pairwise(levels):
        # every fine cluster lies inside one coarse cluster
        for k in torch.unique(fine).tolist():
            assert len(torch.unique(coarse[fine == k])) == 1
    for lv in levels:
        assert lv.dtype == torch.long
        assert torch.equal(lv, relabel(lv))  # ids in order of first appearance
    assert int(coarsest_partition(x).max()) + 1 == ks[-2]


def test_deterministic_and_permutation_equivariant() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(60, 5, generator=gen)
    a = finch(x)
    b = finch(x.clone())
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    perm = torch.randperm(60, generator=gen)
    c = finch(x[perm])
    assert len(c) == len(a)
    for u, v in zip(a, c):
        assert torch.equal(relabel(u[perm]), v)


def test_duplicates_zero_vectors_and_bad_input() -> None:
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    labels = finch(x)[0]
    assert labels[0] == labels[1] and labels[2] == labels[3]
    with pytest.raises(ValueError, match="NaN or inf"):
        finch(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="metric"):
        finch(torch.ones(3, 2), metric="manhattan")
    with pytest.raises(ValueError, match="2-D"):
        finch(torch.ones(3))


def test_relabel_orders_by_first_appearance() -> None:
    assert relabel(torch.tensor([7, 7, 2, 9, 2])).tolist() == [0, 0, 1, 2, 1]


def test_cluster_fn_and_per_class_centres() -> None:
    fn = finch_cluster_fn()
    ids = fn(_angles([0, 4, 10, 90, 97]))
    assert ids.dtype == torch.long and ids.tolist() == [0, 0, 0, 1, 1]
    protos = torch.cat([_angles([0, 4]), _angles([0, 3, 90, 94]), torch.tensor([[2.0, 0.0]])])
    classes = torch.tensor([0, 0, 1, 1, 1, 1, 2])
    centres, owners = cluster_per_class(protos, classes)
    assert owners.tolist() == [0, 1, 1, 2]
    # two vectors always form one cluster: their plain mean
    assert torch.allclose(centres[0], protos[:2].mean(0))
    assert torch.allclose(centres[1], protos[2:4].mean(0))
    assert torch.allclose(centres[2], protos[4:6].mean(0))
    assert torch.allclose(centres[3], torch.tensor([2.0, 0.0]))
