"""YAML as users write it: ``1e-5`` is a number.

PyYAML follows YAML 1.1, where a float needs a dot (``1.0e-5``), so ``lr: 1e-3`` in a file and
``--set federation.weight_decay=1e-5`` on the command line arrived as the *strings* ``'1e-3'``
and ``'1e-5'`` and were refused as "must be a number".  :func:`load` is ``yaml.safe_load`` with
YAML 1.2's float rule (an exponent without a dot is a float); everything else is unchanged.
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-5`` / ``-2E3`` as floats."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load(text: str) -> Any:
    """``yaml.safe_load(text)``, with ``1e-5`` read as a float."""
    return yaml.load(text, Loader=_Loader)


__all__ = ["load"]
