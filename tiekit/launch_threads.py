"""Collectives among the ``torch_xla.launch`` threads of one process (XLA:CPU runs every replica
as a thread of one process): each gather meets the same gather of the other threads, and a
replica's failure releases the others at once, with that failure. Used by
`tiekit.collective.collective_gather`; ``tiekit.fit`` marks where each of its runs begins.
"""

from __future__ import annotations

import threading
from typing import Any

from tiekit.errors import ReplicaStopped, TiekitError


class _ThreadRendezvous:
    """Gathers for the launch threads of one process: the n-th collective of every thread meets
    the n-th of the others (they run the same program), each meeting a slot table and a barrier.

    Each thread counts its ``fit`` calls (`begin`), and a failure belongs to the fit it happened
    in: a later fit in the same launch (your own ``torch_xla.launch`` function caught the error
    and called fit again) is refused at once with a `ReplicaStopped` saying why. Its replicas
    stopped at different points of a step, with computations traced on their devices that the
    others never ran: the next step's all-reduces no longer match, and XLA aborts the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._meetings: dict[tuple[int, int], tuple[threading.Barrier, list[Any], list[int]]] = {}
        self._count = threading.local()  # this thread's fit (``fit``) and collective in it (``n``)
        self._failures: dict[int, tuple[str, BaseException | None]] = {}  # by fit: the reason, the exception

    def begin(self) -> None:
        """This thread starts a new fit: its collectives are counted from 0."""
        fit = getattr(self._count, "fit", 0) + 1
        self._count.fit, self._count.n = fit, 0
        with self._lock:
            # Older fits' exceptions are nobody's any more (a peer is at most one fit behind), and
            # their tracebacks hold the frames of a failed step: only the reason is kept.
            for old, (reason, _) in list(self._failures.items()):
                if old < fit - 1:
                    self._failures[old] = (reason, None)

    def gather(self, rank: int, world: int, value: Any, timeout: float) -> list[Any]:
        fit, n = getattr(self._count, "fit", 0), getattr(self._count, "n", 0)
        self._count.n = n + 1
        with self._lock:
            # Checked under the lock abort() takes: a failure either is seen here, or comes later
            # and aborts this meeting's barrier. Checked before taking the lock, an abort in between
            # left this thread waiting in a new meeting until the timeout.
            self._refuse_after_failure(rank, fit, n)
            barrier, slots, left = self._meetings.setdefault(
                (fit, n), (threading.Barrier(world), [None] * world, [world])
            )
        slots[rank] = value
        try:
            barrier.wait(timeout)
        except threading.BrokenBarrierError:
            with self._lock:
                self._refuse_after_failure(rank, fit, n)
            reason = f"not every replica arrived within {timeout:g} s (one is stuck)"
            raise TiekitError(f"replica {rank}: collective #{n} failed: {reason}") from None
        result = list(slots)
        with self._lock:
            left[0] -= 1
            if left[0] == 0:
                del self._meetings[(fit, n)]
        return result

    def _refuse_after_failure(self, rank: int, fit: int, n: int) -> None:
        """`ReplicaStopped` when a replica failed in this fit, or in an earlier fit of this launch.
        Called under the lock."""
        if fit in self._failures:
            reason = self._failures[fit][0]
            raise ReplicaStopped(f"replica {rank}: stopped because another replica failed (collective #{n}): {reason}")
        earlier = [f for f in self._failures if f < fit]
        if earlier:
            raise ReplicaStopped(
                f"replica {rank}: an earlier tiekit.fit in this torch_xla.launch failed "
                f"({self._failures[min(earlier)][0]}), and its replicas stopped at different points of a step, "
                "with computations traced on their devices that the others never ran: the next all-reduce "
                "would not match and XLA would abort the process. Train again in a new torch_xla.launch"
            )

    def abort(self, reason: str, failed: BaseException | None = None) -> None:
        """Release every thread waiting in this thread's fit or a later one, and fail their later
        gathers: a replica failed (``failed``). A replica stopped by another's failure
        (``ReplicaStopped``) only releases: the failure is the other's."""
        fit = getattr(self._count, "fit", 0)
        with self._lock:
            if not isinstance(failed, ReplicaStopped):
                self._failures.setdefault(fit, (reason, failed))
            for (meeting_fit, _), (barrier, _, _) in self._meetings.items():
                if meeting_fit >= fit:  # a peer whose fit ended before this failure, in the next one
                    barrier.abort()

    def failure(self) -> BaseException | None:
        """The exception of the first replica that failed in this thread's fit, else in the fit of
        this launch before it (older ones are dropped)."""
        fit = getattr(self._count, "fit", 0)
        found = self._failures.get(fit) or self._failures.get(fit - 1)
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


def abort_thread_collectives(reason: str, failed: BaseException | None = None) -> None:
    """Local: release this process's launch threads waiting in a collective of this thread's fit,
    with ``reason`` (a replica failed, raising ``failed``); its later collectives fail at once."""
    _threads.abort(reason, failed)


def thread_failure() -> BaseException | None:
    """Local: the exception of the first launch thread of this process that failed in this
    thread's fit (its traceback, with the line of your code, is the one a replica it stopped
    should show)."""
    return _threads.failure()
