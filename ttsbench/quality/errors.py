"""The one error type of the quality step: its message tells the user what to install or where to put files."""


class QualityError(RuntimeError):
    """A backend's package or weights are missing, or a run directory cannot be scored."""
