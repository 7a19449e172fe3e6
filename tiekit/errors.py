"""tiekit's exception and warning hierarchy, and where its warnings point."""

from __future__ import annotations

import os
import sys

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


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


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the calling function point at the first
    line outside tiekit (your call of ``save_checkpoint``, ``fit``...), however deep it is. Local."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
