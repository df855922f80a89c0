from __future__ import annotations

import pytest

from protofl.registry import Registry


def test_registry_refuses_duplicates_and_explains_unknown_names() -> None:
    reg: Registry[int] = Registry("widget")
    reg.add("alpha", 1)
    with pytest.raises(ValueError, match="already registered"):
        reg.add("alpha", 2)
    reg.add("alpha", 3, force=True)
    assert reg.get("alpha") == 3
    with pytest.raises(ValueError, match=r"unknown widget 'alpah' \(did you mean 'alpha'\?\)"):
        reg.get("alpah")
    assert reg.names() == ["alpha"]
    assert "alpha" in reg


def test_unknown_method_dataset_backbone_list_valid_names() -> None:
    from protofl.data import DATASET_REGISTRY
    from protofl.methods import METHOD_REGISTRY
    from protofl.models.backbones import BACKBONE_REGISTRY

    for reg, valid in (
        (METHOD_REGISTRY, "fedproto"),
        (DATASET_REGISTRY, "toy"),
        (BACKBONE_REGISTRY, "efficientnet_lite0"),
    ):
        with pytest.raises(ValueError, match=valid):
            reg.get("nonsense")
