"""The thread that writes this process's background sharded saves (``save_sharded(blocking=False)``).

One thread, the saves written in the order they were made (DCP's own ``async_save`` writes each
from a new thread, from a copy it makes in the call). A save of several ranks meets the others'
writing threads in DCP's collectives, so a process whose training failed can wait on it for good:
a peer's writer waits for its own training thread (`tiekit.checkpoint.deferred`), which waits in
a training collective for this failed rank. Python joins a ``ThreadPoolExecutor``'s threads at
exit without a bound, and the failed rank never exited (nor, then, did its peers). This thread is
a daemon, joined at exit by `_join_at_exit`: without a bound (a script that exits without
``wait()`` still commits its save), or for a few seconds once a failed ``fit`` abandoned the
writes (`abandon_writes`): the process then exits, its peers' collectives fail, and so do they.
The join runs where Python joins its own threads (``threading``'s exit hooks, as
``concurrent.futures`` does), which a ``multiprocessing`` child started by fork also runs (it
leaves by ``os._exit``, skipping ``atexit``); a fork child gets a writer of its own (the parent's
thread is not in it).
"""

from __future__ import annotations

import atexit
import functools
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

# Its atexit report of failures nothing waited for runs after this module's join (threading's
# exit hooks run before atexit's): the writes' failures are known by then.
import tiekit.checkpoint.handle  # noqa: F401

#: How long the exit of a process whose fit failed waits for its background writes.
ABANDONED_WAIT_SECONDS = 10.0


class _Writer:
    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tiekit-dcp-save", daemon=True)
        self._thread.start()
        self.abandoned = False
        self.pid = os.getpid()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """``fn(*args)``, written after the saves submitted before it."""
        future: Future[Any] = Future()
        self._jobs.put((future, functools.partial(fn, *args)))
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - kept for the save's handle
                future.set_exception(exc)
            del future, fn, job  # a finished save's closure holds its host copies

    def join(self) -> None:
        self._jobs.put(None)
        self._thread.join(ABANDONED_WAIT_SECONDS if self.abandoned else None)


_writer: _Writer | None = None
_lock = threading.Lock()


def background_writer() -> _Writer:
    """Local: the thread that writes this process's background sharded saves, started on first use."""
    global _writer
    with _lock:
        if _writer is None or _writer.pid != os.getpid():  # a fork child: the parent's thread is not here
            _writer = _Writer()
        return _writer


def abandon_writes() -> None:
    """Local: this process's training failed while other ranks share its background saves: its
    exit waits for them only `ABANDONED_WAIT_SECONDS` (a save not finished by then stays
    uncommitted, never taken for a checkpoint)."""
    if _writer is not None:
        _writer.abandoned = True


def _join_at_exit() -> None:
    if _writer is not None and _writer.pid == os.getpid():
        _writer.join()


# threading's exit hooks run before Python joins its threads, at the exit of the main interpreter
# and of a fork child; atexit's only at the former (and after them).
getattr(threading, "_register_atexit", atexit.register)(_join_at_exit)
