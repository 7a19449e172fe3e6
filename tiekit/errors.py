"""tiekit's exception and warning hierarchy."""

from __future__ import annotations


class TiekitError(Exception):
    """Base class of every error tiekit raises on purpose."""


class TieError(TiekitError):
    """A tie could not be found, applied or verified; the message names the module path."""


class CheckpointError(TiekitError):
    """A checkpoint could not be written or read; the message names the file and key."""


class ReplicaStopped(TiekitError):
    """This replica stopped because another replica of the run failed (launch threads of one
    process), or failed in an earlier ``fit`` of the same ``torch_xla.launch``; the message
    carries that replica's failure, and its ``__cause__`` is that
    replica's exception (with its traceback) when ``tiekit.fit`` raised it."""


class TieWarning(UserWarning):
    """A tie problem reported with ``on_error="warn"`` instead of raised."""
