"""protofl's version (a module of its own, so modules need not import the package)."""

__version__ = "0.2.0"
