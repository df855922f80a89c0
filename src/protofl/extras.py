"""Install hints for the optional extras that work where protofl was installed from.

protofl is installed from a checkout (``pip install -e .``, what ``make`` does), not from a
package index: ``pip install 'protofl[hf]'`` would fail there.  :func:`install_hint` names the
command that works: ``pip install -e '<checkout>[extra]'`` from a checkout, the index form
otherwise.
"""

from __future__ import annotations

from pathlib import Path


def checkout_root() -> Path | None:
    """The source checkout protofl runs from (``src/protofl`` under a ``pyproject.toml``)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


def install_hint(extra: str) -> str:
    """The pip command that installs protofl's optional ``extra`` here."""
    root = checkout_root()
    if root is None:
        return f"pip install 'protofl[{extra}]'"
    where = "." if root == Path.cwd().resolve() else str(root)
    return f"pip install -e '{where}[{extra}]'"


__all__ = ["checkout_root", "install_hint"]
