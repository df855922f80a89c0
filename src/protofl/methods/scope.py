"""What a privacy mechanism protects for a method: nothing, when the method releases no
prototypes (the mechanisms act on prototype releases only)."""

from __future__ import annotations

import logging

from protofl.config import ExperimentConfig
from protofl.methods.base import METHOD_REGISTRY

log = logging.getLogger(__name__)


def mechanism_scope(config: ExperimentConfig) -> str | None:
    """One line when ``privacy.mechanism`` protects nothing because the method releases no
    prototypes (the mechanism only acts on prototype releases), else None."""
    mechanism = config.privacy.mechanism
    method = METHOD_REGISTRY.get(config.method.name)
    if mechanism == "none" or method.uses_prototypes:
        return None
    dcr = " (DCR still changes local training)" if config.privacy.use_dcr else ""
    if method.shares_weights:
        sent = "its model weights leave every client without noise"
    else:
        sent = "it uploads no prototypes"
    return (
        f"method {config.method.name} releases no prototypes: privacy.mechanism={mechanism} "
        f"adds no noise and protects nothing here; {sent}{dcr}; the run's guarantee says "
        "'no privacy guarantee'"
    )


def warn_mechanism_scope(config: ExperimentConfig) -> None:
    """Log :func:`mechanism_scope`'s line as a warning (it reaches the console)."""
    line = mechanism_scope(config)
    if line is not None:
        log.warning("%s", line)
