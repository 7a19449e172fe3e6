"""XLA replicas: one copy of the model per device, started by ``torch_xla.launch`` (on one host
of XLA:CPU: one process, one thread per device), gradients all-reduced in the step's graph."""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from tiekit.backends.base import ALONE
from tiekit.backends.xla import XlaBackend, xla_device_count_hint, xla_module, xla_replica, xla_replicas
from tiekit.collective import ranks
from tiekit.devices import resolve_device, xla
from tiekit.plan import TiePlan


@contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def xla_launch(fn: Callable[..., object], args: tuple[Any, ...], num_devices: int | None) -> None:
    """Run ``fn(ordinal, *args)`` once per XLA device through ``torch_xla.launch``.

    On XLA:CPU, ``num_devices`` sets ``CPU_NUM_DEVICES`` for the launched process, and with
    several devices buffer donation is turned off there (``XLA_ENABLE_PARAM_ALIASING=0``):
    measured with torch_xla 2.9, a launch thread whose step releases a donated buffer can block
    while its peer waits in the gradient all-reduce, and the rendezvous aborts. TPUs keep it.
    The launched process also gets a thread pool with room for every replica's computation at
    once (``XLA_THREAD_POOL_SIZE``, see `xla_cpu_pool_threads`).
    """
    torch_xla = xla()
    env: dict[str, str] = {}
    count = 0
    if os.environ.get("PJRT_DEVICE", "").upper() == "CPU":
        if num_devices is not None:
            env["CPU_NUM_DEVICES"] = str(num_devices)
        count = num_devices if num_devices is not None else xla_device_count_hint() or 1
        if count > 1 and "XLA_ENABLE_PARAM_ALIASING" not in os.environ:
            env["XLA_ENABLE_PARAM_ALIASING"] = "0"
        if count > 1 and "XLA_THREAD_POOL_SIZE" not in os.environ and xla_cpu_pool_threads() < count:
            env["XLA_THREAD_POOL_SIZE"] = str(count + (os.cpu_count() or 1))
    with _environ(env):
        check_cpu_pool(count)  # XLA_THREAD_POOL_SIZE set too small by you
        torch_xla.launch(functools.partial(_ending_with_caller, os.getpid(), fn), args=args)


def xla_cpu_pool_threads() -> int:
    """Threads of the pool torch_xla runs a process's computations on (``XLA_THREAD_POOL_SIZE``,
    by default the machine's cores), read from the environment as torch_xla reads it when the
    runtime starts.

    On XLA:CPU every launch thread's step is one computation on that pool, and a step's
    all-reduce waits in its pool thread until every replica's has started. With more replicas
    than pool threads (3 replicas on 2 cores), the last replica's step waited in the pool's
    queue behind the others, which waited for it: XLA aborted the process after 10 s ("Expected
    3 threads to join the rendezvous, but only 2 of them arrived on time")."""
    configured = os.environ.get("XLA_THREAD_POOL_SIZE", "").strip()
    if not configured:
        return os.cpu_count() or 1
    try:
        return int(configured)
    except ValueError:
        return 0  # torch_xla reads what is no number as 0 threads, and aborts the process starting its pool


def check_cpu_pool(replicas: int) -> None:
    """A `TiekitError` when ``replicas`` XLA:CPU launch threads cannot all compute at once on the
    process's thread pool (`xla_cpu_pool_threads`): the first step's all-reduce would abort it."""
    threads = xla_cpu_pool_threads()
    if replicas > threads:
        from tiekit.errors import TiekitError

        configured = os.environ.get("XLA_THREAD_POOL_SIZE")
        pool = f"XLA_THREAD_POOL_SIZE={configured}" if configured else f"the machine's {threads} cores"
        raise TiekitError(
            f"torch_xla's thread pool ({pool}) is too small for {replicas} XLA:CPU replicas: every "
            "replica's step must run at once for its all-reduce, and XLA aborts the process otherwise. "
            f"Set XLA_THREAD_POOL_SIZE to at least {replicas} before the XLA runtime starts (before your "
            "torch_xla.launch), or use fewer devices"
        )


def _ending_with_caller(caller: int, fn: Callable[..., object], ordinal: int, *args: Any) -> None:
    """``fn(ordinal, *args)`` in a launched process that ends when the process that launched it
    (``caller``) ends, killed too, as torch's spawn arranges for the processes it starts.
    Otherwise, with nobody to collect its result, the replica trained on, wrote checkpoints and
    held the checkpoint folder's lock against the run started again in the caller's place; then
    it waited forever to hand its result back."""
    # Under torchrun, torch_xla.launch runs fn in the caller itself: nothing to arrange.
    if sys.platform.startswith("linux") and os.getpid() != caller:
        import ctypes

        pr_set_pdeathsig = 1  # <sys/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != caller:  # the caller ended before this process asked
            os.kill(os.getpid(), signal.SIGKILL)
    fn(ordinal, *args)


class _CompileGate:
    """Ends a step on XLA:CPU when several ``torch_xla.launch`` threads share one process.

    Each thread's ``sync`` looks its graph up in the shared compilation cache and compiles it
    on a miss; two threads compiling the same graph at once give its all-reduce two different
    ids and the rendezvous aborts. So ordinal 0 syncs first; the others sync once its sync has
    returned (the graph compiled and cached; it runs in the background) and hit the cache. A
    step's graph is never compiled twice. Syncs outside the gate (the loader's, a checkpoint's
    transfers) must find no collective pending: fit ends each collective's step here.

    It also tells a replica whether the others were between steps, fetching from the device:
    torch_xla counts transfers per process, so a step counted another thread's (`aside`).
    """

    def __init__(self, parties: int) -> None:
        self._barrier = threading.Barrier(parties)
        self._cond = threading.Condition()
        self._round = 0
        self._leader_done = False
        self._joined: dict[int, int] = {}
        self._failure = ""
        self._aside = 0  # replicas now between steps, fetching (or done with their steps)
        self._asides = 0  # times a replica began to, so far

    @contextmanager
    def aside(self) -> Iterator[None]:
        """Around a replica's work between its steps that may fetch from the device."""
        self.leave()
        try:
            yield
        finally:
            with self._cond:
                self._aside -= 1

    def leave(self) -> None:
        """A replica is done with its steps: from here on, it may fetch at any time."""
        with self._cond:
            self._aside += 1
            self._asides += 1

    def quiet(self) -> int | None:
        """None while a replica is aside; else how many times one went aside so far. Equal
        readings around a step: no other replica fetched in it (read before the first count
        and after the second, since an aside ends only once its fetches are counted)."""
        with self._cond:
            return None if self._aside else self._asides

    def sync(self, ordinal: int) -> None:
        torch_xla = xla()
        try:
            self._barrier.wait()  # every replica has traced its step and nobody is syncing
        except threading.BrokenBarrierError:
            from tiekit.errors import ReplicaStopped

            raise ReplicaStopped(f"replica {ordinal} stopped because another replica failed: {self._failure}") from None
        if ordinal == 0:
            with self._cond:
                self._round += 1
                self._leader_done = False
                self._cond.notify_all()
            try:
                torch_xla.sync()
            finally:
                with self._cond:
                    self._leader_done = True
                    self._cond.notify_all()
            return
        mine = self._joined.get(ordinal, 0) + 1
        self._joined[ordinal] = mine
        with self._cond:
            # Until ordinal 0's sync has returned: its graph is compiled and cached by then. The
            # process-wide compile counters said so too early whenever another thread compiled or
            # looked up a graph meanwhile (a peer's loader, a background checkpoint's copy): this
            # replica then compiled the step's graph a second time, with an all-reduce of another id.
            self._cond.wait_for(lambda: self._round >= mine and self._leader_done)
        torch_xla.sync()

    def abort(self, reason: str) -> None:
        self._failure = self._failure or reason
        self._barrier.abort()
        with self._cond:
            self._leader_done = True
            self._round += 1 << 30
            self._cond.notify_all()


_gates: dict[str, _CompileGate] = {}
_gates_lock = threading.Lock()


def xla_cpu_threads() -> bool:
    """True when this process runs several XLA:CPU replicas as ``torch_xla.launch`` threads (one
    process, one thread per device), where threads share process-wide state a TPU process does
    not share; False elsewhere (TPUs, one replica, SPMD, no runtime). Never starts the runtime."""
    replicas = xla_replicas()
    if replicas is None or replicas[2] > 1:
        return False
    xr = xla_module("torch_xla.runtime")
    return bool(xr.device_type() == "CPU")


def _step_gate(key: str) -> _CompileGate | None:
    """The compile gate of run ``key`` shared by this process's launch threads (XLA:CPU with
    several), else None."""
    if not xla_cpu_threads():
        return None
    xr = xla_module("torch_xla.runtime")
    with _gates_lock:
        return _gates.setdefault(key, _CompileGate(int(xr.world_size())))


def xla_step_sync(key: str) -> Callable[[], None]:
    """The call that ends a training step on this XLA replica: ``torch_xla.sync()``, except on
    XLA:CPU with several launch threads in the process, where it goes through a compile gate
    shared by the replicas of run ``key`` (see `_CompileGate`)."""
    torch_xla = xla()
    xr = xla_module("torch_xla.runtime")

    gate = _step_gate(key)
    if gate is None:
        return torch_xla.sync  # type: ignore[no-any-return]
    ordinal = int(xr.global_ordinal())
    return lambda: gate.sync(ordinal)


def xla_abort_step_sync(key: str, reason: str) -> None:
    """Release the replicas of run ``key`` waiting in its compile gate: one of them failed."""
    with _gates_lock:
        gate = _gates.get(key)
    if gate is not None:
        gate.abort(reason)


def xla_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Average the gradients over the XLA replicas (in the step's graph), then step.

    XLA:CPU's all-reduce refuses 16-bit floats ("AllReduce for datatype 'bf16' is not
    supported"), so there 16-bit gradients are averaged in float32; TPUs reduce them as they are.
    """
    xm = xla_module("torch_xla.core.xla_model")
    xr = xla_module("torch_xla.runtime")
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    narrow = (torch.bfloat16, torch.float16)
    if xr.device_type() != "CPU" or not any(g.dtype in narrow for g in grads):
        xm.optimizer_step(optimizer)
        return
    wide = [g.float() for g in grads]
    xm.all_reduce(xm.REDUCE_SUM, wide, scale=1.0 / xr.world_size())
    with torch.no_grad():
        for g, w in zip(grads, wide, strict=True):
            g.copy_(w)
    optimizer.step()


def xla_broadcast_from_replica_0(tensors: list[torch.Tensor]) -> None:
    """Collective (lazy: the next step of every replica runs it): replica 0's values of the
    floating-point ``tensors`` written into every replica's, in place (torch_xla's broadcast, an
    all-reduce; XLA:CPU's refuses 16-bit floats, so those cross as float32 there)."""
    xm = xla_module("torch_xla.core.xla_model")
    xr = xla_module("torch_xla.runtime")
    floats = [t for t in tensors if t.is_floating_point()]
    widen = xr.device_type() == "CPU"
    with torch.no_grad():
        sent = [t.float() if widen and t.dtype in (torch.bfloat16, torch.float16) else t for t in floats]
        xm.collective_broadcast(sent)
        for t, value in zip(floats, sent, strict=True):
            if value is not t:
                t.copy_(value)


def xla_all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over the XLA replicas (lazy; the caller ends the step to run it)."""
    xm = xla_module("torch_xla.core.xla_model")

    reduced: torch.Tensor = xm.all_reduce(xm.REDUCE_SUM, t)
    return reduced


class XlaReplicaBackend(XlaBackend):
    """An XLA device: the process's only one, or one ``torch_xla.launch`` replica of several."""

    def __init__(self) -> None:
        super().__init__(resolve_device("xla") or torch.device("xla"))
        replica = xla_replica()
        rank, world = replica if replica is not None else (0, 1)
        self.name = "xla"
        self.replica_rank = self.data_rank = rank
        self.replica_count = self.data_replicas = self.devices_in_run = world
        self.ranks = ranks() if world > 1 else ALONE
        # Launch threads of one process hold the very same module a caller passed to fit.
        self.copies_model = world > 1
        # autocast's cast cache is process-wide: one launch thread leaving autocast clears the
        # casts another thread is still using, which then traces a different graph from its
        # peers (one more cast), whose all-reduce never meets theirs. So no cache for threads.
        self.autocast_cache = not xla_cpu_threads()
        if xla_cpu_threads():  # your own torch_xla.launch: its pool is sized already
            check_cpu_pool(world)
        self._gate: _CompileGate | None = None  # XLA:CPU launch threads: the run's, once started
        self._done = False

    def step_sync(self, run_id: str) -> Callable[[], None]:
        self._gate = _step_gate(run_id)
        return xla_step_sync(run_id)

    # torch_xla counts transfers per process: with launch threads, a step's count held the
    # other replicas' fetches between their steps (a loss check, the end of their run), and
    # fit advised against transfers the step never made. Such a count is not used.
    def transfer_mark(self) -> Any:
        if self._gate is None:
            return super().transfer_mark()
        quiet = self._gate.quiet()
        return None if quiet is None else (quiet, super().transfer_mark())

    def transfers_since(self, mark: Any) -> int:
        if self._gate is None:
            return super().transfers_since(mark)
        if mark is None:
            return 0
        quiet, count = mark
        transfers = super().transfers_since(count)
        return transfers if self._gate.quiet() == quiet else 0

    def between_steps(self) -> AbstractContextManager[None]:
        return nullcontext() if self._gate is None else self._gate.aside()

    def steps_done(self) -> None:
        if self._gate is not None and not self._done:
            self._done = True
            self._gate.leave()

    def place(self, model: nn.Module, dtype: torch.dtype | None, plan: TiePlan) -> None:
        """Moved, ties kept; with several replicas, collective: every replica then takes replica
        0's weights and buffers, as DDP does (a step of its own, before this returns). A model built differently
        in each replica (seeded by ordinal inside your own torch_xla.launch) would otherwise train
        apart for good, its gradients averaged over weights that differ."""
        super().place(model, dtype, plan)
        if self.replica_count > 1:
            # parameters() names each tie group once: one broadcast per shared tensor.
            xla_broadcast_from_replica_0([*model.parameters(), *model.buffers()])
            # Run now, through the gate: left pending, the broadcast ran in the next sync of any
            # kind, one a resume's reads make on each replica on its own (compiled once per
            # replica, two all-reduce ids: XLA aborted the resumed run).
            self.end_step()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.replica_count == 1:
            optimizer.step()
        else:
            xla_optimizer_step(optimizer)  # all-reduce in the step's graph, then step

    def sum_over_replicas(self, t: torch.Tensor) -> torch.Tensor:
        if self.replica_count > 1:
            t = xla_all_reduce_sum(t)
        self.end_step()
        return t

    def abort(self, reason: str) -> None:
        if self.run_id:
            xla_abort_step_sync(self.run_id, f"replica {self.replica_rank}: {reason}")
