"""protofl.engine."""
