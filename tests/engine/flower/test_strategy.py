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
