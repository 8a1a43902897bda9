"""The one exception type for bad user input or configuration."""


class OOMBConfigError(ValueError):
    """Raised before any large allocation when an input or option cannot work.

    Messages say what is wrong, why, and what to do instead.
    """
