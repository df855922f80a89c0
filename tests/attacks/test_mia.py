from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from protofl.attacks.mia import (
    as_released,
    cap_per_class,
    distance_scores,
    membership_metrics,
    mia_on_release,
)
from protofl.privacy import PrivacyConfig, create_mechanism


def _overfit_fixture(
    n_members: int = 5, d: int = 256, classes: int = 4, seed: int = 0
) -> tuple[np.ndarray, ...]:
    """Few members per class in high dimension, released exact class means (no privacy)."""
    rng = np.random.default_rng(seed)
    mus = rng.normal(0, 1, (classes, d))
    fm = np.concatenate([mus[c] + rng.normal(0, 1, (n_members, d)) for c in range(classes)])
    ym = np.repeat(np.arange(classes), n_members)
    fn = np.concatenate([mus[c] + rng.normal(0, 1, (100, d)) for c in range(classes)])
    yn = np.repeat(np.arange(classes), 100)
    protos = np.stack([fm[ym == c].mean(axis=0) for c in range(classes)])
    return fm, ym, fn, yn, protos


def _release(protos: np.ndarray, counts: int, std: float = 0.0) -> dict[str, torch.Tensor]:
    k = protos.shape[0]
    return {
        "prototypes": torch.tensor(protos),
        "classes": torch.arange(k),
        "counts": torch.full((k,), counts),
        "noise_std_mean": torch.full((k,), std),
    }


def test_metrics_on_known_scores() -> None:
    perfect = membership_metrics([3.0, 4.0, 5.0], [0.0, 1.0, 2.0])
    assert perfect == {"auc": 1.0, "tpr_at_1fpr": 1.0, "advantage": 1.0, "f1": 1.0}
    reversed_ = membership_metrics([0.0, 1.0], [2.0, 3.0])
    assert reversed_["auc"] == 0.0 and reversed_["advantage"] == 0.0
    # members {2, 0}, non-members {1, -1}: AUC = 3/4; best threshold 2 -> TPR 1/2, FPR 0
    m = membership_metrics([2.0, 0.0], [1.0, -1.0])
    assert m["auc"] == pytest.approx(0.75)
    assert m["tpr_at_1fpr"] == pytest.approx(0.5)
    assert m["advantage"] == pytest.approx(0.5)
    assert m["f1"] == pytest.approx(max(2 * 1 * 0.5 / 1.5, 2 * (2 / 3) * 1 / (5 / 3)))
    assert all(math.isnan(v) for v in membership_metrics([], [1.0]).values())


def test_mia_is_strong_on_an_overfit_non_private_release() -> None:
    fm, ym, fn, yn, protos = _overfit_fixture()
    out = mia_on_release(fm, ym, fn, yn, _release(protos, 5))
    assert out["mia_auc"] > 0.95
    assert out["mia_pc_auc"] > 0.95 and out["mia_cal_auc"] > 0.95
    assert out["mia_tpr_at_1fpr"] > 0.5
    assert out["mia_members"] == 20 and out["mia_nonmembers"] == 400


def test_calibrated_attack_is_stronger_when_members_are_many() -> None:
    fm, ym, fn, yn, protos = _overfit_fixture(n_members=60, seed=1)
    out = mia_on_release(fm, ym, fn, yn, _release(protos, 60))
    assert out["mia_cal_auc"] > out["mia_auc"] + 0.1
    assert out["mia_cal_auc"] > 0.75


def test_mia_is_near_chance_on_pure_noise() -> None:
    rng = np.random.default_rng(3)
    d, classes = 64, 4
    fm = rng.normal(size=(800, d))
    ym = rng.integers(0, classes, 800)
    fn = rng.normal(size=(800, d))
    yn = rng.integers(0, classes, 800)
    protos = rng.normal(size=(classes, d))  # made from neither set
    out = mia_on_release(fm, ym, fn, yn, _release(protos, 200))
    assert abs(out["mia_auc"] - 0.5) < 0.05
    assert abs(out["mia_pc_auc"] - 0.5) < 0.05
    assert abs(out["mia_cal_auc"] - 0.5) < 0.05
    assert out["mia_advantage"] < 0.1


def test_heavy_dp_noise_brings_the_attack_to_chance() -> None:
    fm, ym, fn, yn, _ = _overfit_fixture(n_members=5, d=32, seed=2)
    mech = create_mechanism(
        PrivacyConfig(mechanism="igpp", epsilon=1.0, clip=1.0, warn_min_count=0), rounds=20, dim=32
    )
    release = mech.release(
        torch.tensor(fm, dtype=torch.float32),
        torch.tensor(ym),
        num_classes=4,
        generator=torch.Generator().manual_seed(0),
    )
    out = mia_on_release(fm, ym, fn, yn, release)  # a Release object works too
    assert abs(out["mia_auc"] - 0.5) < 0.2
    assert abs(out["mia_pc_auc"] - 0.5) < 0.2
    assert abs(out["mia_cal_auc"] - 0.5) < 0.2
    rel = as_released(release)
    assert rel.noise_std.shape == rel.prototypes.shape and (rel.noise_std > 0).all()


def test_unreleased_classes_are_skipped_and_clusters_use_the_nearest_prototype() -> None:
    feats = np.array([[0.0, 0.0], [10.0, 10.0], [5.0, 5.0]])
    labels = np.array([0, 0, 1])
    release = _release(np.array([[0.0, 1.0], [10.0, 9.0]]), 3)
    release["classes"] = torch.tensor([0, 0])  # two clusters of class 0, class 1 not released
    s = distance_scores(feats, labels, release)
    assert s[0] == pytest.approx(-1.0) and s[1] == pytest.approx(-1.0) and np.isnan(s[2])


def test_cap_per_class_and_determinism() -> None:
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(3), [1000, 10, 900])
    keep = cap_per_class(labels, 800, rng)
    assert np.bincount(labels[keep]).tolist() == [800, 10, 800]
    fm, ym, fn, yn, protos = _overfit_fixture(n_members=30)
    a = mia_on_release(fm, ym, fn, yn, _release(protos, 30), seed=4)
    b = mia_on_release(fm, ym, fn, yn, _release(protos, 30), seed=4)
    assert a == b
    assert "mia_cal_auc" not in mia_on_release(
        fm, ym, fn, yn, _release(protos, 30), calibrated=False
    )


def test_bad_shapes_fail_clearly() -> None:
    fm, ym, fn, yn, protos = _overfit_fixture()
    with pytest.raises(ValueError, match="features must be"):
        mia_on_release(fm[:, :10], ym, fn, yn, _release(protos, 5))
    with pytest.raises(ValueError, match="labels"):
        mia_on_release(fm, ym[:-1], fn, yn, _release(protos, 5))
