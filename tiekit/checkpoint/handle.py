"""`SaveHandle`: a checkpoint save that may still be under way (``blocking=False``)."""

from __future__ import annotations

import atexit
import itertools
import sys
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tiekit.errors import CheckpointError
from tiekit.tracebacks import without_frames

# What failed saves nothing has waited for yet said, by handle serial number. A background save
# nobody waits for must not fail in silence: the next save into the same folder warns, and
# whatever is left at interpreter exit (after the writing threads were joined, which Python does
# before `atexit` runs) goes to stderr. Text, not handles: a failure's traceback holds the
# save's frames, and with them its host copies of the state.
_unseen: dict[int, str] = {}
_unseen_lock = threading.Lock()
_serials = itertools.count()


class SaveHandle:
    """A save under way (`save_checkpoint` or `save_sharded` with ``blocking=False``), or a
    finished one. ``done()`` never waits; ``wait()`` blocks until it finished and raises
    `CheckpointError` if it failed.

    For `save_sharded`: on rank 0 (and in a single process) done means committed, the marker
    names the new save; on other ranks it means this rank's part is written (rank 0 commits once
    every part is). For `save_checkpoint`: the file is in place.
    """

    def __init__(
        self, path: Path, save_id: str, future: Future[Any] | None, then: Callable[[], None] | None = None
    ) -> None:
        """``then`` runs on the writing thread once ``future`` succeeded (the commit); a failure of
        either is kept for `wait`. Without ``future`` the save is finished."""
        self.path = path
        self.save_id = save_id
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._trace = ""  # the failure's traceback in the writing thread, as text
        self._then = then
        self._serial = next(_serials)
        if future is None:
            self._finished.set()
        else:
            future.add_done_callback(self._complete)

    def _complete(self, future: Future[Any]) -> None:
        try:
            future.result()
            if self._then is not None:
                self._then()
        except BaseException as exc:  # noqa: BLE001 - kept for wait(), which raises it in the caller
            # Kept with its frames, it would keep the save's host copies of the state alive.
            self._trace = without_frames(exc)
            self._error = exc
            with _unseen_lock:
                _unseen[self._serial] = str(self._failure())
        finally:
            self._then = None  # it may hold the staged copies, which may be large: drop them once written
            self._finished.set()

    def done(self) -> bool:
        """True once the save finished (committed on rank 0), successfully or not. Never waits."""
        return self._finished.is_set()

    def join(self) -> None:
        """Block until the save finished, successfully or not; its failure stays for `wait` to
        raise. Local."""
        self._finished.wait()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save finished; `CheckpointError` if it failed or ``timeout`` seconds passed.
        Local: waits for this rank's own writing (and rank 0's commit on rank 0)."""
        if not self._finished.wait(timeout):
            raise CheckpointError(f"{self.path}: {self._what} not finished within {timeout} s")
        if self._error is not None:
            with _unseen_lock:
                _unseen.pop(self._serial, None)
            raise self._failure()

    def warn_unseen_failure(self) -> None:
        """Local: if the save failed and nothing waited for it, say so now, once (a
        ``RuntimeWarning``); `wait` still raises it."""
        warn_if_unseen(self._serial, stacklevel=4)

    @property
    def serial(self) -> int:
        """This save's number in the process, for `warn_if_unseen` once the handle is gone."""
        return self._serial

    @property
    def _what(self) -> str:
        return f"save {self.save_id}" if self.save_id else "save"

    def _failure(self) -> CheckpointError:
        if isinstance(self._error, CheckpointError):
            return self._error
        failure = CheckpointError(f"{self.path}: {self._what} failed: {self._error}")
        failure.__cause__ = self._error
        failure.add_note(f"where it failed, in the writing thread:\n{self._trace}")
        return failure


def warn_if_unseen(serial: int, stacklevel: int) -> None:
    """Local: if the save numbered ``serial`` (`SaveHandle.serial`) failed and nothing waited for
    it, say so now, once (a ``RuntimeWarning``). ``stacklevel`` as `warnings.warn`'s, counted from
    the caller. Its handle's `wait` still raises it."""
    with _unseen_lock:
        text = _unseen.pop(serial, None)
    if text is not None:
        warnings.warn(f"{text} (nothing waited for this save)", RuntimeWarning, stacklevel=stacklevel + 1)


@atexit.register
def _report_unseen_failures() -> None:
    with _unseen_lock:
        left = list(_unseen.values())
        _unseen.clear()
    for text in left:
        sys.stderr.write(f"tiekit: {text} (a background save nothing waited for: SaveHandle.wait() raises it)\n")
