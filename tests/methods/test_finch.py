"""FINCH on small cases with known partitions (Sarfraz et al., CVPR 2019)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from protofl.methods.base import Upload
from protofl.methods.finch import (
    cluster_per_class,
    coarsest_partition,
    finch,
    finch_cluster_fn,
    first_neighbours,
    relabel,
)
from tests.methods.helpers import _release


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


# ----- early exit (the reference code's ensure_early_exit) ---------------------------------------
# On a line (euclidean): five first-level clusters, G1 = {0, 1, 2} (links 0<->1 mutual, weight 2
# x distance 1; 2->1, 1 x 1; 0 and 2 share their first neighbour, 1 x 2), so the longest weighted
# first-level link is min_sim = 2; G2 = {10, 10.2}, G3 = {10.9, 11.1}, G4 = {40, 40.2},
# G5 = {45, 45.2} (mutual pairs, 2 x 0.2). Level 2 on the means 1, 10.1, 11, 40.1, 45.1:
# G2<->G3 is mutual at 0.9 (2 x 0.9 = 1.8 <= 2: kept); G1->G2 (9.1), G1~G3 (shared first
# neighbour, 10) and G4<->G5 (2 x 5) are longer than min_sim: cut with early exit.
LINE = torch.tensor([[v] for v in (0.0, 1.0, 2.0, 10.0, 10.2, 10.9, 11.1, 40.0, 40.2, 45.0, 45.2)])
FIRST_LEVEL = [0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_early_exit_cuts_links_longer_than_the_first_levels_longest() -> None:
    plain = finch(LINE, metric="euclidean")
    assert [lv.tolist() for lv in plain] == [
        FIRST_LEVEL,
        [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1],  # G1-G2-G3 and G4-G5
        [0] * 11,
    ]
    early = finch(LINE, metric="euclidean", early_exit=True)
    # only G2 and G3 merge; a level that merges exactly one pair is the reference's last one
    assert [lv.tolist() for lv in early] == [FIRST_LEVEL, [0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3]]
    assert coarsest_partition(LINE, "euclidean").tolist() == plain[1].tolist()
    assert coarsest_partition(LINE, "euclidean", early_exit=True).tolist() == early[1].tolist()
    # the default is unchanged: no early exit
    assert [lv.tolist() for lv in finch(LINE, "euclidean", early_exit=False)] == [
        lv.tolist() for lv in plain
    ]


def test_early_exit_stops_at_a_level_that_merges_nothing() -> None:
    # four tight pairs far apart: the first level's longest link is 2 x 0.1, every later link is
    # longer, so nothing merges and the first level is the result (without: 2 clusters, then 1)
    x = torch.tensor([[0.0], [0.1], [1.0], [1.1], [10.0], [10.1], [11.0], [11.1]])
    assert [lv.tolist() for lv in finch(x, "euclidean", early_exit=True)] == [
        [0, 0, 1, 1, 2, 2, 3, 3]
    ]
    assert coarsest_partition(x, "euclidean").tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    # n <= 2 has no threshold (as in the reference) and gives one cluster either way
    assert coarsest_partition(torch.tensor([[0.0], [5.0]]), "euclidean", True).tolist() == [0, 0]


def test_fpl_and_fedplvm_take_the_early_exit_option() -> None:
    from protofl.methods import create_method

    protos = torch.cat([LINE, torch.zeros_like(LINE)], dim=1)
    classes = torch.zeros(len(LINE), dtype=torch.long)
    for name in ("fpl", "fedplvm"):
        default = create_method(
            name, {"metric": "euclidean"}, num_classes=1, num_domains=1, proto_dim=2
        )
        assert default.params["finch_early_exit"] is False
        early = create_method(
            name,
            {"metric": "euclidean", "finch_early_exit": True},
            num_classes=1,
            num_domains=1,
            proto_dim=2,
        )
        ups = [Upload(0, 0, _release(protos.tolist(), classes.tolist(), [1] * len(LINE)), 11)]
        assert default.aggregate(ups, 0)["cluster_prototypes"].shape[0] == 2
        got = early.aggregate(ups, 0)["cluster_prototypes"]
        # the server's cluster prototypes are the early-exit partition's means: G1, G2+G3, G4, G5
        assert torch.allclose(got[:, 0], torch.tensor([1.0, 10.55, 40.1, 45.1]))
        with pytest.raises(ValueError, match=rf"{name}\.finch_early_exit='yes' must be a bool"):
            create_method(
                name, {"finch_early_exit": "yes"}, num_classes=1, num_domains=1, proto_dim=2
            )
    # FedPLVM's client-side clustering (inside the mechanism) follows the same option
    plvm = create_method(
        "fedplvm",
        {"metric": "euclidean", "finch_early_exit": True},
        num_classes=1,
        num_domains=1,
        proto_dim=2,
    )
    fn = plvm.cluster_fn()
    assert fn is not None
    assert fn(protos).tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3]
