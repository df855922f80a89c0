"""protofl.report."""
