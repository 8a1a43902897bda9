"""The exception types for bad user input or configuration (and a step the memory plan predicts cannot fit)."""


class OOMBConfigError(ValueError):
    """Raised before any large allocation when an input or option cannot work.

    Messages say what is wrong, why, and what to do instead.
    """


class OOMBOutOfMemoryError(OOMBConfigError, RuntimeError):
    """The memory plan predicts the step cannot fit (raised before it allocates). Also a ``RuntimeError`` whose
    message, on a GPU, starts "CUDA out of memory", as torch's own: what Lightning's ``is_oom_error`` reads, so its
    batch-size finder (``Tuner.scale_batch_size``, ``BatchSizeFinder``) backs off from such a batch as from a real
    out-of-memory error."""
