"""Collectives among the ``torch_xla.launch`` threads of one process (XLA:CPU runs every replica
as a thread of one process): each gather meets the same gather of the other threads, and a
replica's failure releases the others at once, with that failure's traceback. Used by
`tiekit.collective.collective_gather`; ``tiekit.fit`` marks where each of its runs begins and ends.
"""

from __future__ import annotations

import threading
import traceback
from typing import Any

from tiekit.errors import ReplicaStopped, TiekitError


class ReplicaTraceback(Exception):
    """The traceback of a replica's failure, as text: the cause of the `ReplicaStopped` its peers
    raise. Text, not the exception: that would keep the failed replica's frames, and with them
    its model and step, alive for as long as the launch runs."""

    def __str__(self) -> str:
        return str(self.args[0])


class _ThreadRendezvous:
    """Gathers for the launch threads of one process: the n-th collective of every thread meets
    the n-th of the others (they run the same program), each meeting a slot table and a barrier.

    Each thread counts its ``fit`` calls (`begin`, `end`), and a failure belongs to the fit it
    happened in. Inside that fit, the other replicas' collectives raise `ReplicaStopped` with it.
    After it (your own ``torch_xla.launch`` function caught the error and goes on), every
    collective of the launch, a later fit's or your own ``tiekit.collective_*`` call, raises
    `ReplicaStopped` saying to start a new launch: the replicas stopped at different points of a
    step, so their collectives no longer pair up, and each left computations traced on its device
    that the others never ran (a later step's all-reduce would not match, and XLA aborts the
    process then)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._meetings: dict[tuple[int, int], tuple[threading.Barrier, list[Any], list[int]]] = {}
        self._mine = threading.local()  # this thread's fit (``fit``), collective in it (``n``), ``inside`` it
        self._failures: dict[int, tuple[str, ReplicaTraceback | None]] = {}  # by fit

    def _where(self) -> tuple[int, int, bool]:
        mine = self._mine
        return getattr(mine, "fit", 0), getattr(mine, "n", 0), getattr(mine, "inside", False)

    def begin(self) -> None:
        """This thread starts a new fit: its collectives are counted from 0."""
        fit = self._where()[0] + 1
        self._mine.fit, self._mine.n, self._mine.inside = fit, 0, True

    def end(self) -> None:
        """This thread's fit is over (returned or raised)."""
        self._mine.inside = False

    def gather(self, rank: int, world: int, value: Any, timeout: float) -> list[Any]:
        fit, n, inside = self._where()
        self._mine.n = n + 1
        with self._lock:
            # Checked under the lock abort() takes: a failure either is seen here, or comes later
            # and aborts this meeting's barrier. Checked before taking the lock, an abort in between
            # left this thread waiting in a new meeting until the timeout.
            self._refuse_after_failure(rank, fit, n, inside)
            barrier, slots, left = self._meetings.setdefault(
                (fit, n), (threading.Barrier(world), [None] * world, [world])
            )
        slots[rank] = value
        try:
            barrier.wait(timeout)
        except threading.BrokenBarrierError:
            with self._lock:
                self._refuse_after_failure(rank, fit, n, inside)
            reason = f"not every replica arrived within {timeout:g} s (one is stuck)"
            raise TiekitError(f"replica {rank}: collective #{n} failed: {reason}") from None
        result = list(slots)
        with self._lock:
            left[0] -= 1
            if left[0] == 0:
                del self._meetings[(fit, n)]
        return result

    def _refuse_after_failure(self, rank: int, fit: int, n: int, inside: bool) -> None:
        """`ReplicaStopped` (caused by the failure's traceback) when a replica failed in this fit,
        or in an earlier fit of this launch. Called under the lock."""
        if inside and fit in self._failures:
            reason, cause = self._failures[fit]
            raise ReplicaStopped(
                f"replica {rank}: stopped because another replica failed (collective #{n}): {reason}"
            ) from cause
        failed = [f for f in self._failures if f < fit or (f == fit and not inside)]
        if failed:
            reason, cause = self._failures[min(failed)]
            raise ReplicaStopped(
                f"replica {rank}: a tiekit.fit in this torch_xla.launch failed ({reason}), and its replicas "
                "stopped at different points of a step: their collectives no longer pair up, and each left "
                "computations traced on its device that the others never ran (the next all-reduce would not "
                "match, and XLA would abort the process). Train again, or call tiekit's collectives, in a new "
                "torch_xla.launch"
            ) from cause

    def abort(self, reason: str, failed: BaseException | None = None) -> None:
        """Release every thread waiting in this thread's fit or a later one, and fail their later
        gathers: a replica failed (``failed``, kept as its traceback's text). A replica stopped by
        another's failure (``ReplicaStopped``) only releases: the failure is the other's."""
        fit = self._where()[0]
        text = None if failed is None else ReplicaTraceback("".join(traceback.format_exception(failed)))
        with self._lock:
            if not isinstance(failed, ReplicaStopped):
                self._failures.setdefault(fit, (reason, text))
            for (meeting_fit, _), (barrier, _, _) in self._meetings.items():
                if meeting_fit >= fit:  # a peer whose fit ended before this failure, in the next one
                    barrier.abort()

    def failure(self) -> ReplicaTraceback | None:
        """The traceback of the first replica that failed in this thread's fit."""
        found = self._failures.get(self._where()[0])
        return None if found is None else found[1]


_threads = _ThreadRendezvous()


def gather(rank: int, world: int, value: Any, timeout: float) -> list[Any]:
    """Collective among this process's launch threads (`tiekit.collective.collective_gather`'s
    for them): every thread's ``value`` in rank order; `ReplicaStopped` once a replica failed."""
    return _threads.gather(rank, world, value, timeout)


def begin_thread_collectives() -> None:
    """Local: this launch thread starts a new ``fit``, whose collectives meet those of the other
    threads' same fit; after a fit of this launch failed, they raise a `ReplicaStopped` saying to
    start a new launch (see `_ThreadRendezvous`)."""
    _threads.begin()


def end_thread_collectives() -> None:
    """Local: this launch thread's ``fit`` is over; a failure in it now refuses every later
    collective of the launch with the advice to start a new one."""
    _threads.end()


def abort_thread_collectives(reason: str, failed: BaseException | None = None) -> None:
    """Local: release this process's launch threads waiting in a collective of this thread's fit,
    with ``reason`` (a replica failed, raising ``failed``); its later collectives fail at once."""
    _threads.abort(reason, failed)


def thread_failure() -> ReplicaTraceback | None:
    """Local: the traceback (as text) of the first launch thread of this process that failed in
    this thread's fit: the line of your code that raised, which a replica it stopped should show."""
    return _threads.failure()
