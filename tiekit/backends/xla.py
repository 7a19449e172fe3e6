"""The XLA runtime as a training run sees it, whether replicas or SPMD: who this process is, how
many devices it has, its loader, random numbers and counters.

Every function imports torch_xla on first use (`tiekit.devices.xla`); the ones that only ask
who this process is never start the runtime. `XlaBackend` is what the XLA backends share;
`tiekit.backends.xla_replicas` (one replica per device) and `tiekit.backends.xla_spmd` (one
program over every device) build on it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tiekit.backends.base import Backend
from tiekit.devices import xla


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
    xm = xla_module("torch_xla.core.xla_model")

    return [bytes(p) for p in xm.rendezvous(tag, payload)]


def xla_module(name: str) -> Any:
    """A torch_xla submodule, typed loosely (torch_xla's functions carry no annotations)."""
    xla()
    return importlib.import_module(name)


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
    xr = xla_module("torch_xla.runtime")
    return int(xr.local_ordinal())


def xla_device_count_hint() -> int | None:
    """XLA devices a launch would use, read from the environment without starting the runtime:
    ``CPU_NUM_DEVICES`` on XLA:CPU; None where only the runtime knows (TPU)."""
    if os.environ.get("PJRT_DEVICE", "").upper() == "CPU":
        return int(os.environ.get("CPU_NUM_DEVICES", "1"))
    return None


def xla_device_count() -> int:
    """Number of XLA devices of this process's (started) runtime."""
    xr = xla_module("torch_xla.runtime")

    return int(xr.global_runtime_device_count())


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
    loaders = xla_module("torch_xla.distributed.parallel_loader")

    kwargs = {} if input_sharding is None else {"input_sharding": input_sharding}
    caught = _Caught(loader)
    yield from loaders.MpDeviceLoader(caught, device, **kwargs)
    if caught.error is not None:
        raise caught.error


def xla_wait() -> None:
    """Block until every pending XLA computation of this process has run."""
    xm = xla_module("torch_xla.core.xla_model")

    xm.wait_device_ops()


def xla_rng_state() -> int:
    """This replica's XLA random seed state."""
    xm = xla_module("torch_xla.core.xla_model")

    return int(xm.get_rng_state())


def xla_set_rng_state(seed: int) -> None:
    """Seed this replica's XLA random number generator."""
    xm = xla_module("torch_xla.core.xla_model")

    xm.set_rng_state(seed)


def xla_host_transfers() -> int:
    """Device-to-host transfers so far in this process (``.item()``, ``.cpu()``, printing...)."""
    met = xla_module("torch_xla.debug.metrics")

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
    met = xla_module("torch_xla.debug.metrics")

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


class XlaBackend(Backend):
    """What every XLA backend shares: batches cross through torch_xla's loader, a step ends with a
    sync (compiled once, then launched), the device has its own random number generator, and the
    compiler's counters are watched. XLA devices (TPUs) compute 16-bit floating point as bfloat16."""

    compiles = True
    half_dtype = torch.bfloat16

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.run_id = ""
        self._sync: Callable[[], None] | None = None

    def step_sync(self, run_id: str) -> Callable[[], None]:
        """The call that ends a step of run ``run_id``."""
        return xla().sync  # type: ignore[no-any-return]

    def input_sharding(self, loader: Iterable[Any]) -> Any:
        """How the batches of ``loader`` are laid over the devices (None: on this one device)."""
        return None

    def start(self, run_id: str) -> None:
        self.run_id = run_id
        self._sync = self.step_sync(run_id)

    def batches(self, loader: Iterable[Any]) -> Iterable[Any]:
        return xla_loader(loader, self.device, self.input_sharding(loader))

    def end_step(self) -> None:
        if self._sync is None:
            raise RuntimeError("XlaBackend.start(run_id) must come before the first step")
        self._sync()

    def sum_over_replicas(self, t: torch.Tensor) -> torch.Tensor:
        self.end_step()
        return t

    def seed(self, seed: int) -> None:
        # The same seed on every replica, as torch's generator on every DDP rank.
        xla_set_rng_state(seed)

    def wait(self) -> None:
        xla_wait()

    def counters(self) -> XlaCounters | None:
        return xla_counters()

    def transfer_mark(self) -> Any:
        return xla_host_transfers()

    def transfers_since(self, mark: Any) -> int:
        return xla_host_transfers() - int(mark)
