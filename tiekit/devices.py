"""Everything device-specific, torch_xla above all, lives here; the rest of tiekit asks this module.

torch_xla takes seconds to import and is optional, so it is imported only when an XLA
device is actually asked for, never by ``import tiekit``.
"""

from __future__ import annotations

import importlib.util
import threading
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


def _xla_replicas() -> tuple[int, int, int] | None:
    """(global ordinal, world size, process count) when this process runs several XLA replicas.

    Neither imports torch_xla nor starts its runtime: a process that has not started it
    cannot be one of several XLA replicas.
    """
    import sys

    torch_xla = sys.modules.get("torch_xla")
    if torch_xla is None or not torch_xla._XLAC._xla_runtime_is_initialized():
        return None
    import torch_xla.runtime as xr

    if xr.world_size() <= 1:
        return None
    return int(xr.global_ordinal()), int(xr.world_size()), int(xr.process_count())


def _distributed_world_size() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


def is_master() -> bool:
    """True in the one replica that writes shared files: XLA global ordinal 0, torch.distributed
    rank 0, or the only process there is."""
    replicas = _xla_replicas()
    if replicas is not None:
        return replicas[0] == 0
    if _distributed_world_size() > 1:
        return int(torch.distributed.get_rank()) == 0
    return True


_thread_barriers: dict[str, threading.Barrier] = {}
_thread_barriers_lock = threading.Lock()


def barrier(tag: str, timeout: float | None = None) -> None:
    """Block until every replica has called ``barrier(tag)``; a no-op without replicas.

    ``torch_xla.launch`` on one host runs one thread per device in a single process: those
    threads meet at a ``threading.Barrier``, because XLA's collective rendezvous aborts on
    XLA:CPU when the threads compile it at the same time. Replicas spread over several
    processes meet at ``xm.rendezvous``; torch.distributed ranks at ``dist.barrier``.
    """
    replicas = _xla_replicas()
    if replicas is not None:
        _, world, processes = replicas
        if processes == 1:
            with _thread_barriers_lock:
                waiter = _thread_barriers.setdefault(tag, threading.Barrier(world))
            try:
                waiter.wait(timeout)
            except threading.BrokenBarrierError as exc:
                raise TimeoutError(f"barrier {tag!r}: not every replica arrived within {timeout} s") from exc
            return
        import torch_xla.core.xla_model as xm

        xm.rendezvous(tag)
        return
    if _distributed_world_size() > 1:
        torch.distributed.barrier()
