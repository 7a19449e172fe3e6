"""`SaveHandle`: a checkpoint save that may still be under way (``blocking=False``)."""

from __future__ import annotations

import atexit
import itertools
import os
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
        self._watchers: list[Callable[[SaveHandle], None]] = []
        self._watchers_lock = threading.Lock()  # orders `_complete` against `_when_finished`
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
            with self._watchers_lock:  # each watcher runs once: here, or in `_when_finished`
                self._finished.set()
                watchers, self._watchers = self._watchers, []
            for watcher in watchers:
                watcher(self)

    def _when_finished(self, watcher: Callable[[SaveHandle], None]) -> None:
        """Run ``watcher(self)`` once the save finished: now if it has, else on the writing thread."""
        with self._watchers_lock:
            if not self._finished.is_set():
                self._watchers.append(watcher)
                return
        watcher(self)

    def done(self) -> bool:
        """True once the save finished (committed on rank 0), successfully or not. Never waits."""
        return self._finished.is_set()

    def join(self) -> None:
        """Block until the save finished, successfully or not; its failure stays for `wait` to
        raise. Local."""
        self._finished.wait()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save finished; `CheckpointError` if it failed or ``timeout`` seconds passed.

        Waits for this rank's own writing; on rank 0 of a sharded save also for its commit, which
        comes once every rank has written its part: there it waits for the other ranks' writing
        (a rank that died is reported, not waited for). Calls no collective itself."""
        if not self._finished.wait(timeout):
            raise CheckpointError(f"{self.path}: {self._what} not finished within {timeout} s")
        if self._error is not None:
            with _unseen_lock:
                _unseen.pop(self._serial, None)
            raise self._failure()

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


# This process's background saves, by the real path of their file or folder (a symlink, or a
# relative path, names the same one): a handle while its save is under way, its serial number
# once it failed (its handle's traceback may hold the state's host copies), nothing once it is
# written. A later save of the path waits for them: a blocking save writes at once, and an older
# background write landing after it would leave the older state; two sharded saves racing for
# one marker would leave either.
_pending: dict[str, list[SaveHandle | int]] = {}
_pending_lock = threading.Lock()


def _forget_the_parents_saves() -> None:
    # A fork child inherits the parent's background saves, whose writing threads are not in it:
    # they would never finish here, and the child's next save of the same path would wait for good.
    global _pending_lock, _unseen_lock
    _pending.clear()
    _unseen.clear()
    _pending_lock, _unseen_lock = threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_forget_the_parents_saves)


def register_pending(target: Path, handle: SaveHandle, key: str | None = None) -> None:
    """Local: ``handle`` is a background save of ``target`` (a file, or a sharded save's folder),
    for the next save of ``target`` in this process to wait for (`after_earlier_saves`). ``key``:
    the real path `after_earlier_saves` returned for ``target`` in the same save, if at hand (each
    costs a ``stat`` per component of the path)."""
    key = os.path.realpath(target) if key is None else key
    with _pending_lock:
        _pending.setdefault(key, []).append(handle)
    handle._when_finished(lambda finished: _forget(key, finished))


def after_earlier_saves(target: Path, stacklevel: int) -> str:
    """Local: return once every background save of ``target`` made by this process is written or
    failed (waits for this process's writer threads, for no other rank); a failure nothing waited
    for is a ``RuntimeWarning``, ``stacklevel`` as `warnings.warn`'s from the caller. Raising it
    instead could leave other ranks waiting in the next save's collectives: it is the earlier
    handle's `wait` that raises it. Returns ``target``'s real path (for `register_pending`)."""
    key = os.path.realpath(target)
    with _pending_lock:
        # Left registered while this waits: a save of the path from another thread meanwhile
        # must wait for them too (taken out, an older write landed on top of its newer one).
        earlier = list(_pending.get(key, []))
    for entry in earlier:
        if isinstance(entry, SaveHandle):
            entry.join()  # then `_forget` has removed it, or left its serial if it failed
    serials = {entry if isinstance(entry, int) else entry.serial for entry in earlier}
    with _pending_lock:
        left = [entry for entry in _pending.get(key, []) if not (isinstance(entry, int) and entry in serials)]
        if left:
            _pending[key] = left
        else:
            _pending.pop(key, None)
    for serial in sorted(serials):
        warn_if_unseen(serial, stacklevel + 1)
    return key


def report_failed_saves(target: Path, stacklevel: int) -> str:
    """Local, never waits: warn of the failed background saves of ``target`` nothing waited for
    (``stacklevel`` as `warnings.warn`'s from the caller); those under way stay registered.
    Returns ``target``'s real path (for `register_pending`)."""
    key = os.path.realpath(target)
    with _pending_lock:
        entries = _pending.pop(key, [])
        under_way: list[SaveHandle | int] = [entry for entry in entries if isinstance(entry, SaveHandle)]
        if under_way:
            _pending[key] = under_way
    for entry in entries:
        if isinstance(entry, int):
            warn_if_unseen(entry, stacklevel + 1)
    return key


def _forget(key: str, handle: SaveHandle) -> None:
    """Writer thread, once ``handle``'s save is over: a written save is forgotten; a failed one
    stays as its serial number, for the next save of the path to report."""
    with _pending_lock:
        entries = _pending.get(key, [])
        for i, entry in enumerate(entries):
            if entry is handle:
                entries[i : i + 1] = [handle.serial] if handle._error is not None else []
                break
        if not entries:
            _pending.pop(key, None)


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
