"""The Python API in one call: what ``protofl run`` does, returning the run's summary.

::

    from protofl.api import run
    summary = run({"method": {"name": "feddap"}, "privacy": {"mechanism": "vpdr"}},
                  overrides=["federation.rounds=5"], out="runs")
    summary["avg_acc"], summary["privacy"]["guarantee"]["statement"], summary["run_dir"]

The plug-in for your own training code is :class:`protofl.privacy.PrototypePrivacy`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from protofl.config import ExperimentConfig


def run(
    config: ExperimentConfig | Mapping[str, Any] | str | Path | None = None,
    *,
    overrides: Sequence[str] = (),
    out: str | Path | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Run one experiment on its engine (``run.engine``) and return its summary.

    ``config``: an :class:`~protofl.config.ExperimentConfig`, a nested mapping of config
    sections, a YAML file, or None (the defaults: FedProto on digits4); ``overrides``: dotted
    overrides as ``protofl run --set`` takes them (``"federation.rounds=5"``); ``out``: the
    folder the run folder is made in (default ``run.out_dir``).  Bad input fails with the
    config's one-line errors before any folder is made.
    """
    import protofl.attacks  # noqa: F401  (registers the engine's diagnostic hooks: run.mia_every)
    from protofl.config import ExperimentConfig
    from protofl.engine.engines import EngineOptions, run_engine

    if config is None:
        cfg = ExperimentConfig()
    elif isinstance(config, ExperimentConfig):
        cfg = config
    elif isinstance(config, Mapping):
        cfg = ExperimentConfig.from_dict(config)
    elif isinstance(config, str | Path):
        cfg = ExperimentConfig.from_yaml(config)
    else:
        raise TypeError(
            f"protofl.run: config must be an ExperimentConfig, a mapping, a YAML path or None, "
            f"got {type(config).__name__}"
        )
    if isinstance(overrides, str):
        raise TypeError(
            "protofl.run: overrides= takes a list of 'key=value' strings, not one string"
        )
    cfg = cfg.with_overrides(list(overrides))
    result = run_engine(cfg, EngineOptions(out=out, progress=progress))
    return {**result.summary, "run_dir": str(result.run_dir)}


__all__ = ["run"]
