"""The error type of user mistakes (bad config values, names, files): one line, no traceback."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value, name or file that protofl cannot use; the message names it."""
