"""Run the app with Flower's simulation engine (one virtual SuperNode per client).

    python examples/flower_prototypes/run.py        # about 30-60 s on two cores (Ray start-up)

The same app runs with ``flwr run examples/flower_prototypes`` (pyproject.toml beside this file).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # task.py, client_app.py, server_app.py

from client_app import app as client_app
from flwr.simulation import run_simulation
from server_app import app as server_app

if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=3,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": max(os.cpu_count() or 1, 1)},
        },
    )
