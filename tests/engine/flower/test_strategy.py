"""``ProtoStrategy``: what the Flower server refuses before a run starts."""

from __future__ import annotations

import pytest

from protofl.methods.checks import tiny_config


def test_the_flower_engine_refuses_an_evaluation_budget() -> None:
    from protofl.engine.flower.strategy import ProtoStrategy

    cfg = tiny_config("fedproto", "none").with_overrides(["federation.eval_every=2"])
    with pytest.raises(ValueError, match=r"federation\.eval_every"):
        ProtoStrategy(cfg)
