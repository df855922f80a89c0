"""Privacy attacks on prototype releases and an empirical DP audit.

* :func:`mia_on_release` / :func:`mia_on_run`: membership inference (VPDR App. E.6.2) plus a
  calibrated likelihood-ratio variant.
* :func:`hijack` / :func:`fsh_on_run`: feature-space hijacking (VPDR App. E.6.1).
* :func:`audit_mechanism`: a model-free test of a mechanism's real releases against its stated
  privacy (a violation is flagged only on a bound valid for any mechanism; the GDP figure is an
  estimate beside it).
* :func:`load_run` / :func:`rebuild_clients`: a finished run's releases and feature paths.
* :func:`add_attack_parsers`: the ``attack`` and ``audit`` sub-commands.

Importing the package registers the engine's ``mia`` diagnostic hook (``run.mia_every``, see
:mod:`protofl.engine.hooks`); :mod:`protofl.api` and the ``protofl`` command import it.
"""

from protofl.attacks.artifacts import load_run, rebuild_clients
from protofl.attacks.audit import audit_mechanism, per_release_epsilon
from protofl.attacks.cli import add_attack_parsers
from protofl.attacks.fsh import fsh_metrics, fsh_on_run, hijack, hijack_release
from protofl.attacks.mia import membership_metrics, mia_on_release, mia_on_run
from protofl.attacks.verdict import epsilon_lower_bound

__all__ = [
    "add_attack_parsers",
    "audit_mechanism",
    "epsilon_lower_bound",
    "fsh_metrics",
    "fsh_on_run",
    "hijack",
    "hijack_release",
    "load_run",
    "membership_metrics",
    "mia_on_release",
    "mia_on_run",
    "per_release_epsilon",
    "rebuild_clients",
]
