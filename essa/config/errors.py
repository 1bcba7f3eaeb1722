"""The one error type of config loading, shared by the loader and every section's checks."""


class ConfigError(ValueError):
    """A user error in a config file or override; the message is one line."""
