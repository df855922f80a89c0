"""protofl: privacy-preserving, prototype-based personalized federated learning under domain shift."""

__version__ = "0.1.0"
