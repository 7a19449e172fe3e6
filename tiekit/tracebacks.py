"""Failures that do not hold on to tiekit's memory: an exception kept (a background save's, for
`SaveHandle.wait`) or propagating through a process group's close keeps every frame of its
traceback alive, and with them the host copies of the state, or the wrapped model and its group."""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator

import torch

_LIBRARY_CODE = (os.path.dirname(__file__) + os.sep, os.path.dirname(torch.__file__) + os.sep)


def drop_library_locals(failure: BaseException) -> None:
    """Local: clear the locals of tiekit's and torch's finished frames in ``failure``'s traceback
    and in those of its causes (see `tiekit.backends.torch_distributed.collective_close_process_group`
    and `SaveHandle`)."""
    for exc in chained(failure):
        for frame, _ in traceback.walk_tb(exc.__traceback__):
            if frame.f_code.co_filename.startswith(_LIBRARY_CODE):
                with contextlib.suppress(RuntimeError):  # a frame still running (the caller's)
                    frame.clear()


def without_frames(failure: BaseException) -> str:
    """Local: ``failure``'s traceback as text, then dropped from it and from its causes: a frame
    keeps its function, and a closure's cells (a background save's ``write`` holds the state's
    host copies), even once its locals are cleared."""
    text = "".join(traceback.format_exception(failure))
    drop_frames(failure)
    return text


def drop_frames(failure: BaseException) -> None:
    """Local: drop the traceback of ``failure`` and of every exception it was raised from or
    during (a cause's frames hold what its function held: a DCP writer's, the tensors written)."""
    for exc in chained(failure):
        exc.__traceback__ = None


def chained(failure: BaseException) -> Iterator[BaseException]:
    """``failure`` and every exception it was raised from or during, each once (local)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [failure]
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        pending += [exc.__cause__, exc.__context__]
        yield exc
