"""protofl.models."""
