"""Planning a sweep: a section-valued grid axis (``privacy: [{mechanism: igpp}, ...]``) merges
into its section, whatever the order of the axes, and is never changed by another axis."""

from __future__ import annotations

from typing import Any

from protofl.sweeps.plan import plan_sweep

BASE = {"data": {"name": "toy"}, "backbone": {"name": "pixels"}}
OPTIONS = [{"mechanism": "igpp"}, {"mechanism": "vpp", "vpp_rho": 0.3}]


def _plan(grid: dict[str, Any], base: dict[str, Any] | None = None) -> Any:
    return plan_sweep({"name": "t", "base": base or BASE, "grid": grid}, source="t.yaml")


def test_a_dotted_axis_lands_inside_a_section_axis_in_either_order() -> None:
    after = _plan({"privacy": OPTIONS, "privacy.epsilon": [0.5, 2.0]})
    before = _plan({"privacy.epsilon": [0.5, 2.0], "privacy": OPTIONS})
    for plan in (after, before):
        got = sorted((p.config.privacy.mechanism, p.config.privacy.epsilon) for p in plan.points)
        assert got == [("igpp", 0.5), ("igpp", 2.0), ("vpp", 0.5), ("vpp", 2.0)]
        rho = {p.config.privacy.mechanism: p.config.privacy.vpp_rho for p in plan.points}
        assert rho == {"igpp": 0.2, "vpp": 0.3}


def test_the_grid_values_are_not_changed_by_the_other_axes() -> None:
    plan = _plan({"privacy": OPTIONS, "privacy.epsilon": [0.5, 1.0, 2.0]})
    assert OPTIONS == [{"mechanism": "igpp"}, {"mechanism": "vpp", "vpp_rho": 0.3}]
    for p in plan.points:
        assert "epsilon" not in p.overrides["privacy"]  # shown as written
    # one option, one folder hash, at every epsilon
    hashes = {p.dirname.split("_")[0].split("-", 1)[1] for p in plan.points[:3]}
    assert len(hashes) == 1


def test_a_section_axis_keeps_the_bases_other_keys_of_that_section() -> None:
    base = {**BASE, "privacy": {"clip": 10.0, "epsilon": 3.0}}
    plan = _plan({"privacy": OPTIONS}, base)
    assert [p.config.privacy.clip for p in plan.points] == [10.0, 10.0]
    assert [p.config.privacy.epsilon for p in plan.points] == [3.0, 3.0]
