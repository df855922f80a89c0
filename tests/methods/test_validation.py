"""Method parameters: bad values named, shared-weights options."""

from __future__ import annotations

import pytest

from protofl.methods import create_method


@pytest.mark.parametrize(
    ("method", "params", "named"),
    [
        ("fedpcl", {"tau": 0}, "tau"),
        ("fedpcl", {"ce_weight": -1}, "ce_weight"),
        ("fpl", {"temperature": -0.1}, "temperature"),
        ("fpl", {"w_mse": "x"}, "w_mse"),
        ("fpl", {"share_weights": 1}, "share_weights"),
        ("fedplvm", {"alpha": 1.5}, "alpha"),
        ("fedplvm", {"correction": "l1"}, "correction"),
        ("fedplvm", {"contrast": "x"}, "contrast"),
        ("fedplvm", {"lam": -1}, "lam"),
        ("fedplvm", {"metric": "l2"}, "metric"),
        ("fpl", {"temprature": 0.1}, "temprature"),
    ],
)
def test_bad_parameters_are_named(method: str, params: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        create_method(method, params, num_classes=2, num_domains=1, proto_dim=2)


def test_share_weights_option() -> None:
    for name in ("fpl", "fedplvm"):
        assert not create_method(name, {}, num_classes=2, num_domains=1, proto_dim=2).shares_weights
        on = create_method(name, {"share_weights": True}, num_classes=2, num_domains=1, proto_dim=2)
        assert on.shares_weights
