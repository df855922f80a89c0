"""protofl: privacy-preserving prototype-based personalized FL under domain shift."""

__version__ = "0.2.0"
