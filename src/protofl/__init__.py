"""protofl: privacy-preserving prototype-based personalized FL under domain shift.

Python API: :func:`protofl.api.run` (``from protofl.api import run``) runs an experiment as
``protofl run`` does and returns its summary; :class:`protofl.privacy.PrototypePrivacy` is the
plug-in for your own training code.
"""

__version__ = "0.2.0"
