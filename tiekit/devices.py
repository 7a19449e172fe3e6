"""Everything device-specific, torch_xla above all, lives here; the rest of tiekit asks this module.

torch_xla takes seconds to import and is optional, so it is imported only when an XLA
device is actually asked for, never by ``import tiekit``.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch


def xla_available() -> bool:
    """True when torch_xla is installed (does not import it)."""
    return importlib.util.find_spec("torch_xla") is not None


def xla() -> ModuleType:
    """The imported ``torch_xla`` module; a clear ImportError when it is not installed."""
    try:
        import torch_xla
    except ImportError as exc:
        raise ImportError(
            "an XLA device was requested but torch_xla is not installed; "
            "install tiekit[xla] (torch==2.9.1, torch_xla==2.9.0)"
        ) from exc
    return torch_xla


def is_xla(device: torch.device | str | None) -> bool:
    """True if ``device`` names an XLA device ("xla", "xla:0", torch.device("xla", 1))."""
    if device is None:
        return False
    return torch.device(device).type == "xla"


def resolve_device(device: torch.device | str | int | None) -> torch.device | None:
    """Turn "xla" into the current process's XLA device (importing torch_xla); pass others through."""
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device(device)
    dev = torch.device(device)
    if dev.type == "xla":
        torch_xla = xla()
        resolved: torch.device = torch_xla.device() if dev.index is None else torch_xla.device(dev.index)
        return resolved
    return dev


def memory_visible(t: torch.Tensor) -> bool:
    """True where a tensor has a real data pointer, so storage sharing can be observed."""
    return t.device.type in ("cpu", "cuda") and not t.is_meta


def storage_key(t: torch.Tensor) -> int | None:
    """Address of the tensor's StorageImpl: equal for a tensor and all its views on every device
    (CPU, CUDA, meta, and XLA's functional storage); None where there is no storage (sparse)."""
    try:
        return int(t.untyped_storage()._cdata)
    except Exception:  # noqa: BLE001 - sparse, lazy (uninitialised) and some subclasses refuse
        return None


def xla_buffer_handles(tensors: list[torch.Tensor]) -> list[int]:
    """torch_xla's device-data handle of each tensor: equal handles mean one buffer in device memory."""
    torch_xla = xla()
    torch_xla.sync()  # materialise pending computations so every tensor is backed by device data
    return [int(h) for h in torch_xla._XLAC._get_tensors_handle(tensors)]


def sync() -> None:
    """Cut and run the pending XLA graph (no-op when torch_xla was never imported)."""
    import sys

    if "torch_xla" in sys.modules:
        sys.modules["torch_xla"].sync()


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy tensors to CPU; XLA tensors cross in one batched transfer."""
    xla_tensors = [t for t in tensors if t.device.type == "xla"]
    if not xla_tensors:
        return [t.detach().cpu() for t in tensors]
    torch_xla = xla()
    host = iter(torch_xla._XLAC._xla_get_cpu_tensors(xla_tensors))
    return [next(host) if t.device.type == "xla" else t.detach().cpu() for t in tensors]


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Copy host tensors to ``device``; onto XLA in one batched transfer."""
    if device.type != "xla":
        return [t.to(device) for t in tensors]
    xla()
    import torch_xla.core.xla_model as xm

    moved: Any = xm.send_cpu_data_to_device(tensors, device)
    return list(moved)


def xla_replicas() -> tuple[int, int, int] | None:
    """(global ordinal, world size, process count) when this process runs one of several XLA
    replicas (``torch_xla.launch``), else None.

    Neither imports torch_xla nor starts its runtime: a process that has not started it
    cannot be one of several XLA replicas. Under SPMD the world size is 1 (see `spmd_hosts`).
    """
    import sys

    torch_xla = sys.modules.get("torch_xla")
    if torch_xla is None or not torch_xla._XLAC._xla_runtime_is_initialized():
        return None
    import torch_xla.runtime as xr

    if bool(xr.is_spmd()) or xr.world_size() <= 1:  # type: ignore[no-untyped-call]
        return None
    return int(xr.global_ordinal()), int(xr.world_size()), int(xr.process_count())


def spmd_hosts() -> tuple[int, int] | None:
    """(process index, process count) when this process is one host of a multi-host SPMD run,
    else None; never imports torch_xla. Under SPMD every host is XLA replica 0 of 1, so hosts
    are told apart by their process index."""
    import sys

    torch_xla = sys.modules.get("torch_xla")
    if torch_xla is None or not torch_xla._XLAC._xla_runtime_is_initialized():
        return None
    import torch_xla.runtime as xr

    if not xr.is_spmd() or xr.process_count() <= 1:  # type: ignore[no-untyped-call]
        return None
    return int(xr.process_index()), int(xr.process_count())


def xla_rendezvous(tag: str, payload: bytes) -> list[bytes]:
    """Every XLA replica's (or SPMD host's) ``payload``, in ordinal order (waits for all of them)."""
    xm = _xla_module("torch_xla.core.xla_model")

    return [bytes(p) for p in xm.rendezvous(tag, payload)]


# -- training (tiekit.fit): launching replicas, ending steps, metrics ---------------------------


def _xla_module(name: str) -> Any:
    """A torch_xla submodule, typed loosely (torch_xla's functions carry no annotations)."""
    xla()
    return importlib.import_module(name)


def xla_wanted() -> bool:
    """True when torch_xla is installed and an XLA runtime is configured (``PJRT_DEVICE``, or libtpu
    on a TPU VM); neither imports torch_xla nor starts its runtime."""
    if not xla_available():
        return False
    return bool(os.environ.get("PJRT_DEVICE")) or importlib.util.find_spec("libtpu") is not None


def xla_runtime_started() -> bool:
    """True once this process has started torch_xla's runtime (after which it cannot launch)."""
    import sys

    torch_xla = sys.modules.get("torch_xla")
    return torch_xla is not None and bool(torch_xla._XLAC._xla_runtime_is_initialized())


def xla_replica() -> tuple[int, int] | None:
    """(global ordinal, world size) inside one of several XLA replicas, else None."""
    replicas = xla_replicas()
    return None if replicas is None else (replicas[0], replicas[1])


def xla_local_ordinal() -> int:
    """This replica's index among the XLA replicas of its host."""
    xr = _xla_module("torch_xla.runtime")
    return int(xr.local_ordinal())


def xla_device_count_hint() -> int | None:
    """XLA devices a launch would use, read from the environment without starting the runtime:
    ``CPU_NUM_DEVICES`` on XLA:CPU; None where only the runtime knows (TPU)."""
    if os.environ.get("PJRT_DEVICE", "").upper() == "CPU":
        return int(os.environ.get("CPU_NUM_DEVICES", "1"))
    return None


def xla_device_count() -> int:
    """Number of XLA devices of this process's (started) runtime."""
    xr = _xla_module("torch_xla.runtime")

    return int(xr.global_runtime_device_count())


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
    """
    torch_xla = xla()
    env: dict[str, str] = {}
    if os.environ.get("PJRT_DEVICE", "").upper() == "CPU":
        if num_devices is not None:
            env["CPU_NUM_DEVICES"] = str(num_devices)
        count = num_devices if num_devices is not None else xla_device_count_hint() or 1
        if count > 1 and "XLA_ENABLE_PARAM_ALIASING" not in os.environ:
            env["XLA_ENABLE_PARAM_ALIASING"] = "0"
    with _environ(env):
        torch_xla.launch(fn, args=args)


class _CompileGate:
    """Ends a step on XLA:CPU when several ``torch_xla.launch`` threads share one process.

    Each thread's ``sync`` looks its graph up in the shared compilation cache and compiles it
    on a miss; two threads compiling the same graph at once give its all-reduce two different
    ids and the rendezvous aborts. So ordinal 0 syncs first; the others wait until its sync
    has either compiled the graph (the cache grew) or found it (a cache hit was counted), then
    sync and hit the cache. A compiled graph is never compiled twice.
    """

    def __init__(self, parties: int) -> None:
        self._barrier = threading.Barrier(parties)
        self._cond = threading.Condition()
        self._round = 0
        self._marks = (0, 0)
        self._leader_done = False
        self._joined: dict[int, int] = {}
        self._failure = ""

    def sync(self, ordinal: int) -> None:
        torch_xla = xla()
        try:
            self._barrier.wait()  # every replica has traced its step and nobody is syncing
        except threading.BrokenBarrierError:
            from tiekit.errors import TiekitError

            raise TiekitError(f"replica {ordinal} stopped because another replica failed: {self._failure}") from None
        if ordinal == 0:
            with self._cond:
                self._round += 1
                self._marks = _compile_marks()
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
            self._cond.wait_for(lambda: self._round >= mine)
            marks = self._marks
        while True:
            with self._cond:
                if self._leader_done:
                    break
            if _compile_marks() != marks:
                break
            time.sleep(0.0002)
        torch_xla.sync()

    def abort(self, reason: str) -> None:
        self._failure = self._failure or reason
        self._barrier.abort()
        with self._cond:
            self._leader_done = True
            self._round += 1 << 30
            self._cond.notify_all()


def _compile_marks() -> tuple[int, int]:
    torch_xla = xla()
    met = _xla_module("torch_xla.debug.metrics")

    cached = met.counter_value("CachedCompile") or 0
    return int(torch_xla._XLAC._xla_get_num_cached_compilation_graph()), int(cached)


_gates: dict[str, _CompileGate] = {}
_gates_lock = threading.Lock()


def xla_cpu_threads() -> bool:
    """True when this process runs several XLA:CPU replicas as ``torch_xla.launch`` threads (one
    process, one thread per device), where threads share process-wide state a TPU process does
    not share; False elsewhere (TPUs, one replica, SPMD, no runtime). Never starts the runtime."""
    replicas = xla_replicas()
    if replicas is None or replicas[2] > 1:
        return False
    xr = _xla_module("torch_xla.runtime")
    return bool(xr.device_type() == "CPU")


def xla_step_sync(key: str) -> Callable[[], None]:
    """The call that ends a training step on this XLA replica: ``torch_xla.sync()``, except on
    XLA:CPU with several launch threads in the process, where it goes through a compile gate
    shared by the replicas of run ``key`` (see `_CompileGate`)."""
    torch_xla = xla()
    xr = _xla_module("torch_xla.runtime")

    if not xla_cpu_threads():
        return torch_xla.sync  # type: ignore[no-any-return]
    with _gates_lock:
        gate = _gates.setdefault(key, _CompileGate(int(xr.world_size())))
    ordinal = int(xr.global_ordinal())
    return lambda: gate.sync(ordinal)


def xla_abort_step_sync(key: str, reason: str) -> None:
    """Release the replicas of run ``key`` waiting in its compile gate: one of them failed."""
    with _gates_lock:
        gate = _gates.get(key)
    if gate is not None:
        gate.abort(reason)


class _Caught:
    """``loader`` with the error its iterator raises caught and kept, for the thread that reads the
    batches to raise: torch_xla 2.9's loader thread lets it end the thread, which the reader takes
    for the end of the epoch (a replica whose dataset raised would silently skip the rest of it)."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.error: BaseException | None = None

    def __iter__(self) -> Iterator[Any]:
        self.error = None
        try:
            yield from self.loader
        except Exception as exc:  # noqa: BLE001 - raised again by the reader, see xla_loader
            self.error = exc

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]


def xla_loader(loader: Iterable[Any], device: torch.device, input_sharding: Any = None) -> Iterator[Any]:
    """``MpDeviceLoader``: batches cross to ``device`` in background threads, one graph per batch.
    An error of ``loader`` (the dataset, the collate function) is raised here, in the reader."""
    loaders = _xla_module("torch_xla.distributed.parallel_loader")

    kwargs = {} if input_sharding is None else {"input_sharding": input_sharding}
    caught = _Caught(loader)
    yield from loaders.MpDeviceLoader(caught, device, **kwargs)
    if caught.error is not None:
        raise caught.error


def xla_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Average the gradients over the XLA replicas (in the step's graph), then step.

    XLA:CPU's all-reduce refuses 16-bit floats ("AllReduce for datatype 'bf16' is not
    supported"), so there 16-bit gradients are averaged in float32; TPUs reduce them as they are.
    """
    xm = _xla_module("torch_xla.core.xla_model")
    xr = _xla_module("torch_xla.runtime")
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


def xla_all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over the XLA replicas (lazy; the caller ends the step to run it)."""
    xm = _xla_module("torch_xla.core.xla_model")

    reduced: torch.Tensor = xm.all_reduce(xm.REDUCE_SUM, t)
    return reduced


def xla_wait() -> None:
    """Block until every pending XLA computation of this process has run."""
    xm = _xla_module("torch_xla.core.xla_model")

    xm.wait_device_ops()


def xla_rng_state() -> int:
    """This replica's XLA random seed state."""
    xm = _xla_module("torch_xla.core.xla_model")

    return int(xm.get_rng_state())


def xla_set_rng_state(seed: int) -> None:
    """Seed this replica's XLA random number generator."""
    xm = _xla_module("torch_xla.core.xla_model")

    xm.set_rng_state(seed)


def device_rng_state(device: torch.device) -> dict[str, Any]:
    """The state of ``device``'s own random number generator under its kind (``"cuda"``,
    ``"xla"``); empty for the CPU, whose generator is torch's global one."""
    if device.type == "cuda":
        return {"cuda": torch.cuda.get_rng_state(device)}
    if device.type == "xla":
        return {"xla": xla_rng_state()}
    return {}


def set_device_rng_state(device: torch.device, states: dict[str, Any]) -> None:
    """Restore what `device_rng_state` returned (a state of another kind of device is ignored)."""
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)
    if device.type == "xla" and "xla" in states:
        xla_set_rng_state(int(states["xla"]))


def xla_host_transfers() -> int:
    """Device-to-host transfers so far in this process (``.item()``, ``.cpu()``, printing...)."""
    met = _xla_module("torch_xla.debug.metrics")

    data = met.metric_data("TransferFromDeviceTime")
    return 0 if data is None else int(data[0])


@dataclass(frozen=True)
class XlaCounters:
    """What ``torch_xla.debug.metrics`` says about this process so far (times in seconds)."""

    compilations: int
    compile_seconds: float
    executions: int
    execute_seconds: float
    host_transfers: int
    fallback_ops: tuple[str, ...]

    def since(self, start: XlaCounters) -> XlaCounters:
        """What happened after ``start`` was read: the counters are process-wide, and a
        process may have compiled other graphs before this run."""
        return XlaCounters(
            self.compilations - start.compilations,
            self.compile_seconds - start.compile_seconds,
            self.executions - start.executions,
            self.execute_seconds - start.execute_seconds,
            self.host_transfers - start.host_transfers,
            tuple(op for op in self.fallback_ops if op not in start.fallback_ops),
        )

    def report(self) -> str:
        """A short human-readable summary."""
        fallbacks = ", ".join(self.fallback_ops) if self.fallback_ops else "none"
        return (
            f"XLA: {self.compilations} compilation(s) in {self.compile_seconds:.1f} s, "
            f"{self.executions} execution(s) in {self.execute_seconds:.1f} s, "
            f"{self.host_transfers} device-to-host transfer(s), CPU fallback ops: {fallbacks}"
        )


def xla_counters() -> XlaCounters:
    """`XlaCounters` of this process (torch_xla must be imported)."""
    met = _xla_module("torch_xla.debug.metrics")

    def metric(name: str) -> tuple[int, float]:
        data = met.metric_data(name)
        return (0, 0.0) if data is None else (int(data[0]), float(data[1]) / 1e9)

    compilations, compile_seconds = metric("CompileTime")
    executions, execute_seconds = metric("ExecuteTime")
    replicated, replicated_seconds = metric("ExecuteReplicatedTime")  # SPMD programs
    executions, execute_seconds = executions + replicated, execute_seconds + replicated_seconds
    # `.item()` shows up as the aten::_local_scalar_dense "fallback": it is a transfer, not an op.
    fallbacks = tuple(op for op in met.executed_fallback_ops() if op != "aten::_local_scalar_dense")
    return XlaCounters(compilations, compile_seconds, executions, execute_seconds, xla_host_transfers(), fallbacks)


def spmd_mesh() -> tuple[torch.device, Any, int, int]:
    """Turn SPMD on; (device, a 1-D ``"data"`` mesh over every device, host index, host count)."""
    torch_xla = xla()
    import numpy as np

    xr = _xla_module("torch_xla.runtime")
    spmd = _xla_module("torch_xla.distributed.spmd")

    xr.use_spmd()
    count = int(xr.global_runtime_device_count())
    mesh = spmd.Mesh(np.arange(count), (count,), ("data",))
    return torch_xla.device(), mesh, int(xr.process_index()), int(xr.process_count())


def spmd_local_device_count() -> int:
    """Devices this host drives under SPMD."""
    xr = _xla_module("torch_xla.runtime")

    return int(xr.addressable_runtime_device_count())


def spmd_input_sharding(mesh: Any, example: Any, multi_host: bool) -> Any:
    """A ``ShardingSpec`` that splits the batch dimension over the mesh's ``"data"`` axis.

    Built from the first tensor of ``example`` (a tensor, a tuple/list, or a dict of tensors,
    one spec per key). Tensors of another rank stay replicated: still correct, only slower.
    """
    spmd = _xla_module("torch_xla.distributed.spmd")

    def spec(t: torch.Tensor) -> Any:
        return spmd.ShardingSpec(mesh, ("data",) + (None,) * (t.dim() - 1), minibatch=multi_host)

    if isinstance(example, dict):
        return {k: spec(v) for k, v in example.items() if isinstance(v, torch.Tensor)}
    first = example if isinstance(example, torch.Tensor) else next(t for t in example if isinstance(t, torch.Tensor))
    return spec(first)
