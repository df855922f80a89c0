"""protofl.attacks."""
