"""protofl: privacy-preserving prototype-based personalized FL under domain shift.

Python API: :func:`protofl.run` (the same as :func:`protofl.api.run`) runs an experiment as
``protofl run`` does and returns its summary; :class:`protofl.privacy.PrototypePrivacy` is the
plug-in for your own training code.
"""

from typing import Any

from protofl._version import __version__


def __getattr__(name: str) -> Any:
    """``protofl.run``, loaded on first use: importing the package stays cheap (no torch)."""
    if name == "run":
        from protofl.api import run

        return run
    raise AttributeError(f"module 'protofl' has no attribute {name!r}")


__all__ = ["__version__", "run"]
