"""The engine's diagnostic hooks: local-only checks run on each client's release, registered
from the layers above the engine.

The engine owns the registry and never imports what fills it: :mod:`protofl.attacks.mia`
registers ``mia`` (the membership diagnostic of ``run.mia_every``) when ``protofl.attacks`` is
imported.  :mod:`protofl.api` and the ``protofl`` command import it; code that calls
:mod:`protofl.engine.runner` directly imports ``protofl.attacks`` first (the tests' conftest
does).  A run that asks for a diagnostic nobody registered fails before it starts rather than
running without it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from protofl.registry import Registry

if TYPE_CHECKING:
    from protofl.config import ExperimentConfig
    from protofl.engine.simulation import UploadHook

HookFactory = Callable[["ExperimentConfig"], "UploadHook | None"]
"""``config -> upload hook`` (``Simulation(upload_hooks=...)``), or None when the config does
not ask for it."""

DIAGNOSTIC_HOOKS: Registry[HookFactory] = Registry("diagnostic hook")

REQUESTS: dict[str, Callable[[ExperimentConfig], bool]] = {
    "mia": lambda config: int(config.run.mia_every) > 0,  # run.mia_every (protofl.attacks.mia)
}
"""The diagnostics a config can ask for, by the name their hook is registered under."""


def check_diagnostics(config: ExperimentConfig) -> None:
    """Fail when ``config`` asks for a diagnostic whose hook is not registered."""
    missing = [n for n, asks in REQUESTS.items() if asks(config) and n not in DIAGNOSTIC_HOOKS]
    if missing:
        raise RuntimeError(
            f"the config asks for the {', '.join(missing)} diagnostic, whose hook is not "
            "registered: import protofl.attacks before running (protofl.api and the protofl "
            "command do)"
        )


def upload_hooks_for(config: ExperimentConfig) -> list[UploadHook]:
    """The upload hooks ``config`` asks for, from every registered factory."""
    check_diagnostics(config)
    hooks = [DIAGNOSTIC_HOOKS.get(name)(config) for name in DIAGNOSTIC_HOOKS]
    return [h for h in hooks if h is not None]


def hook_modules() -> list[str]:
    """The modules whose factories are registered in this process: a sweep's worker processes
    import the same (:func:`load_hook_modules`), so a point there runs with the hooks it would
    run with in the driver."""
    return sorted({DIAGNOSTIC_HOOKS.get(name).__module__ for name in DIAGNOSTIC_HOOKS})


def load_hook_modules(modules: Sequence[str]) -> None:
    """Import ``modules`` (from :func:`hook_modules` of another process): they register their
    hooks.  The engine learns the names from the registry, it never names them itself."""
    for module in modules:
        importlib.import_module(module)
