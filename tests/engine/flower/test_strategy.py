"""``ProtoStrategy``: what the Flower server sends before any client answers."""

from __future__ import annotations

from protofl.methods.checks import tiny_config


def test_a_round_that_is_not_evaluated_sends_no_evaluation_without_weights() -> None:
    """``federation.eval_every`` skips rounds: a method that shares no weights then sends no
    evaluate message at all (the cost the setting exists to save)."""
    from protofl.engine.flower.strategy import ProtoStrategy

    cfg = tiny_config("fedproto", "none", rounds=8).with_overrides(["federation.eval_every=2"])
    strategy = ProtoStrategy(cfg)
    assert strategy.avg_weights is None
    assert list(strategy.configure_evaluate(1, None, None, None)) == []  # type: ignore[arg-type]


def test_a_secure_sum_mechanism_is_refused_by_the_flower_server() -> None:
    """``privacy.mechanism: ddg`` needs SecAgg+, which the Flower engine does not run: a
    deployment's server (no preflight of its own) refuses it in one line, naming the fix."""
    import pytest

    from protofl.engine.flower.strategy import ProtoStrategy
    from protofl.errors import ConfigError

    cfg = tiny_config("fedproto", "ddg", rounds=2)
    with pytest.raises(
        ConfigError, match=r"privacy.mechanism=ddg needs a secure sum.*run.engine=sim"
    ):
        ProtoStrategy(cfg)
