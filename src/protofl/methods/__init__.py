"""Federated methods: one module per method, registered by name."""

from protofl.methods import baselines as _baselines  # noqa: F401  (fedavg, fedprox, moon)
from protofl.methods import copa as _copa  # noqa: F401  (registers copa)
from protofl.methods import feddap as _feddap  # noqa: F401  (registers feddap)
from protofl.methods import fedga as _fedga  # noqa: F401  (registers fedga)
from protofl.methods import fedpcl as _fedpcl  # noqa: F401  (registers fedpcl)
from protofl.methods import fedplvm as _fedplvm  # noqa: F401  (registers fedplvm)
from protofl.methods import fedproto as _fedproto  # noqa: F401  (registers local, fedproto)
from protofl.methods import fedrdn as _fedrdn  # noqa: F401  (registers fedrdn)
from protofl.methods import fedtgp as _fedtgp  # noqa: F401  (registers fedtgp)
from protofl.methods import fpl as _fpl  # noqa: F401  (registers fpl)
from protofl.methods import mpft as _mpft  # noqa: F401  (registers mpft)
from protofl.methods.base import METHOD_REGISTRY, Method, create_method

__all__ = ["METHOD_REGISTRY", "Method", "create_method"]
