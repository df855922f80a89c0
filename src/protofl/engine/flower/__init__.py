"""protofl on Flower (``pip install "protofl[flower]"``): codec, strategy, apps, deployment.

Nothing here is imported by ``import protofl``; the names below load Flower on first use.

* :func:`run_flower_simulation` - a protofl config through Flower's simulation engine;
* :func:`resume_flower_simulation` - continue (or extend) such a run from its checkpoints;
* :class:`ProtoStrategy` - one Flower strategy for every protofl method;
* :func:`make_client_app` / :func:`make_server_app` - the ClientApp and ServerApp;
* :func:`write_flower_app` - a Flower App folder for ``flwr run``;
* :mod:`protofl.engine.flower.deploy` - SuperLink + SuperNodes on this machine's loopback.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "run_flower_simulation": "protofl.engine.flower.run",
    "resume_flower_simulation": "protofl.engine.flower.run",
    "FlowerRunResult": "protofl.engine.flower.run",
    "add_flower_arguments": "protofl.engine.flower.run",
    "add_flower_app_parser": "protofl.engine.flower.run",
    "run_with_flower": "protofl.engine.flower.run",
    "ProtoStrategy": "protofl.engine.flower.strategy",
    "make_client_app": "protofl.engine.flower.client_app",
    "make_server_app": "protofl.engine.flower.server_app",
    "write_flower_app": "protofl.engine.flower.app",
    "InlineGrid": "protofl.engine.flower.inline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'protofl.engine.flower' has no attribute {name!r}")
