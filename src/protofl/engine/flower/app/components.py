"""The shipped Flower App components, named in a generated app's ``pyproject.toml``::

    [tool.flwr.app.components]
    serverapp = "protofl.engine.flower.app.components:serverapp"
    clientapp = "protofl.engine.flower.app.components:clientapp"

Both read the experiment from the run config (``protofl-config`` JSON, ``protofl-set``
overrides), so ``flwr run APP ... --run-config 'protofl-set="federation.rounds=2"'`` works.
"""

from __future__ import annotations

from protofl.engine.flower.client_app import make_client_app
from protofl.engine.flower.server_app import make_server_app

serverapp = make_server_app()
clientapp = make_client_app()
