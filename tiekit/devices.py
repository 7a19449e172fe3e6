"""Devices, whatever the runtime: naming them, telling tensors apart, copying to and from them.

The moves, checks and checkpoints of tiekit ask this module about devices; how a training run
uses a runtime (torch.distributed, XLA replicas, XLA SPMD) lives in `tiekit.backends`, one
module per runtime. torch_xla takes seconds to import and is optional, so it is imported only
when an XLA device is actually asked for, never by ``import tiekit``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import importlib.util
import os
import threading
import time
from collections.abc import Callable
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


def hides_view_geometry(t: torch.Tensor) -> bool:
    """Whether ``t``'s device reports every tensor as contiguous from offset 0, so which part of a
    shared storage a view covers cannot be read (XLA's functional storage)."""
    return t.device.type == "xla"


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


def one_device_buffer(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are one buffer in device memory that hides its pointers (XLA: its
    data handles, after a sync); False where that cannot be seen. Views of one storage at other
    offsets have buffers of their own."""
    if not (is_xla(a.device) and a.device == b.device):
        return False
    first, second = xla_buffer_handles([a, b])
    return first == second


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
    # Computed first where they live, as torch_xla's own xm.save does: fetched while still
    # pending, they were computed in a graph of their own, which may round differently from the
    # one that later computes the model's tensors (a file off by the last bit from the model).
    torch_xla._XLAC._xla_sync_multi(xla_tensors, devices=[], wait=True, sync_xla_data=False)
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


def spmd_sharding(t: torch.Tensor) -> Any | None:
    """``t``'s XLA SPMD sharding annotation (torch_xla's ``OpSharding``, as ``mark_sharding``
    gave it), or None: not an XLA tensor, or not annotated (SPMD off, or never sharded)."""
    if t.device.type != "xla":
        return None
    sharding: Any = xla()._XLAC._get_xla_op_sharding(t)
    return sharding


def to_device_sharded_as(host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A copy of host tensor ``host`` on ``like``'s device, sharded as ``like`` is (`spmd_sharding`):
    each device receives only its shard, straight from ``host``, which torch_xla copies before
    this returns (its buffer may be reused). What a tensor sharded under SPMD is overwritten from:
    torch_xla 2.9's ``copy_`` between two XLA tensors gives the target the source's sharding, and
    a host tensor transferred whole (`to_device`) is ``{replicated}``, on every device whole."""
    sharding = spmd_sharding(like)
    # Under SPMD a host tensor moved to the device stays on the host until it is annotated; the
    # annotation then transfers each device's shard (torch_xla's virtual device).
    moved = host.to(like.device)
    if sharding is not None:
        xla()._XLAC._xla_mark_sharding(moved, sharding)
    return moved


def mark_sharded_as(t: torch.Tensor, like: torch.Tensor) -> None:
    """Annotate XLA tensor ``t``, a new one of ``like``'s shape still being computed, with ``like``'s
    SPMD sharding (`spmd_sharding`), so that it is computed into each device's shard; nothing when
    ``like`` has none."""
    sharding = spmd_sharding(like)
    if sharding is not None:
        xla()._XLAC._xla_mark_sharding(t, sharding)


def adopts_host_memory(device: torch.device) -> bool:
    """Whether ``device``'s buffers are host memory that can take over a host tensor's memory,
    with no copy (`adopt_host`): an XLA:CPU device that is its process's only XLA device, outside
    SPMD (where a buffer is one of several devices'). Every other device is filled by a transfer."""
    if device.type != "xla" or device.index not in (None, 0):
        return False
    xla()
    import torch_xla.runtime as xr

    return bool(xr.device_type() == "CPU" and not xr.is_spmd() and xr.addressable_device_count() == 1)  # type: ignore[no-untyped-call]


def adopt_host(host: torch.Tensor) -> torch.Tensor | None:
    """``host``'s memory as the device buffer of a new tensor on the device `adopts_host_memory`
    named, no copy (torch_xla's DLPack import; the buffer keeps ``host``'s storage alive, and a
    computation may later reuse it for its result: drop every other reference to ``host``).
    None when XLA:CPU cannot take it (not 64-byte aligned, not contiguous, a dtype DLPack lacks)."""
    if not host.is_contiguous() or host.data_ptr() % 64:
        return None
    xla()
    from torch_xla.utils.dlpack import from_dlpack

    try:
        return from_dlpack(host.detach())  # type: ignore[no-any-return]
    except BufferError:  # a dtype DLPack has no code for (float8): transferred instead
        return None


def release_buffers(tensors: list[torch.Tensor]) -> None:
    """Let go of each tensor's device buffer before new values are copied into it, so that they can
    be read into the memory it frees (`tiekit.checkpoint.adoption`), and return once that memory is
    back. Their values become zeros, pending on a lazy device (XLA: nothing is computed or
    allocated unless a `sync` runs before the new values arrive). A buffer another tensor shares
    stays, with that tensor's values; an inference tensor is written in inference mode (`writing`).

    XLA:CPU frees a buffer on its own threads after the call that let go of it (unmapping 70 MiB
    took 5-11 ms here): memory read into before that would hold the tensor twice (a 79 MiB model
    with a 90% embedding grew by 0.01-0.94x beyond it, by the race). So this waits until the
    process's resident memory has fallen by 7/8 of the bytes let go of, for as long as it keeps
    falling (a pause of `_FREEING_PAUSE` ends the wait: a buffer another tensor shares, or a value
    still pending, frees nothing), at most half a second (Linux; elsewhere it does not wait). It
    first waits until each buffer is filled (`wait_until_ready`): one still being filled by a
    transfer (right after a move) is freed only after it."""
    wait_until_ready(tensors)
    before = _resident_bytes()
    with torch.no_grad():
        for tensor in tensors:
            with writing(tensor):
                tensor.copy_(torch.zeros((), dtype=tensor.dtype, device=tensor.device).expand(tensor.shape))
    released = sum(tensor.nbytes for tensor in tensors)
    if before is None or released < _WORTH_WAITING_FOR:
        return
    start = last = time.monotonic()
    lowest = before
    while last - start < 0.5:
        release_freed_memory()  # a smaller buffer goes back to a malloc arena, not to the OS
        now = _resident_bytes()
        if now is None or now <= before - released + released // 8:
            return
        moment = time.monotonic()
        if now < lowest:
            lowest, last = now, moment
        elif moment - last > _FREEING_PAUSE:
            return
        time.sleep(0.0002)


#: How long resident memory may stay put before `release_buffers` stops waiting for it to fall:
#: XLA:CPU's thread starts freeing within a millisecond here, and unmaps without a pause.
_FREEING_PAUSE = 0.003


def writing(tensor: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """Where an in-place write into ``tensor`` may run: inference mode for an inference tensor
    (made under ``torch.inference_mode``, which refuses in-place writes outside it, as a load into
    a CPU model, read straight into its memory, never asks), else no change."""
    return torch.inference_mode() if tensor.is_inference() else contextlib.nullcontext()


def wait_until_ready(tensors: list[torch.Tensor]) -> None:
    """Return once every XLA tensor of ``tensors`` has its device buffer filled: XLA:CPU completes
    a transfer, and a graph's results, on its own threads after the call returns. Other tensors
    are ready already, and so is one whose value is still a pending computation (it has no buffer
    yet). Waits at most a minute, then returns anyway (a buffer that never fills
    would otherwise hang the caller)."""
    pending = [t for t in tensors if t.device.type == "xla"]
    if not pending:
        return
    torch_xla = xla()
    left, ready, lock = [len(pending)], threading.Event(), threading.Lock()

    def one_ready() -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                ready.set()

    for tensor in pending:
        try:
            torch_xla._XLAC._on_ready_callback(tensor, one_ready)
        except RuntimeError:  # no buffer yet (a pending computation): nothing of its own to wait for
            one_ready()
    ready.wait(timeout=60)


#: Bytes let go of below which `release_buffers` does not wait for them to be freed: less than a
#: staging buffer's worth held twice for a moment is within what a load is allowed beyond the model.
_WORTH_WAITING_FOR = 1 << 20


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except OSError:
        return None


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def write_rows(target: torch.Tensor, first: int, rows: torch.Tensor) -> None:
    """``target[first : first + len(rows)] = rows``, in place, both tensors on one device.

    On XLA the write is one dynamic-update-slice whose offset is data, not a constant of the
    graph: every piece of one shape runs one compiled graph (slice assignment compiles one per
    offset), and torch_xla hands the target's buffer to the result, so the target is never held
    twice. Pending until the next `sync`.
    """
    with writing(target):
        if target.device.type != "xla":
            target.narrow(0, first, rows.shape[0]).copy_(rows)
            return
        start = torch.tensor([first], dtype=torch.int32).to(target.device)  # a shape-[1] tensor: 0 and 1
        # as 0-d tensors would become constants of the graph, and the first piece would compile alone
        target.copy_(_xla_row_writer()(target, rows, start, rank=target.dim()))


@functools.cache
def _xla_row_writer() -> Any:
    xla()
    xb: Any = importlib.import_module("torch_xla.core.xla_builder")
    xor: Any = importlib.import_module("torch_xla.core.xla_op_registry")

    def lower(target: Any, rows: Any, start: Any, rank: int) -> Any:
        zero = xb.Op.scalar(target.builder(), 0, dtype=xb.Type.S32)
        return target.dynamic_update_slice(rows, [start.reshape([]), *[zero] * (rank - 1)])

    return xor.register("tiekit_write_rows", lower)


def xla_wanted() -> bool:
    """True when torch_xla is installed and an XLA runtime is configured (``PJRT_DEVICE``, or libtpu
    on a TPU VM); neither imports torch_xla nor starts its runtime."""
    if not xla_available():
        return False
    return bool(os.environ.get("PJRT_DEVICE")) or importlib.util.find_spec("libtpu") is not None


def device_rng_state(device: torch.device) -> dict[str, Any]:
    """The state of ``device``'s own random number generator under its kind (``"cuda"``,
    ``"xla"``); empty for the CPU, whose generator is torch's global one."""
    if device.type == "cuda":
        return {"cuda": torch.cuda.get_rng_state(device)}
    if device.type == "xla":
        from tiekit.backends.xla import xla_rng_state

        return {"xla": xla_rng_state()}
    return {}


def set_device_rng_state(device: torch.device, states: dict[str, Any]) -> None:
    """Restore what `device_rng_state` returned (a state of another kind of device is ignored)."""
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)
    if device.type == "xla" and "xla" in states:
        from tiekit.backends.xla import xla_set_rng_state

        xla_set_rng_state(int(states["xla"]))


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, TypeError, AttributeError):
        return None  # not glibc
    return trim


def release_freed_memory() -> None:
    """Give the host memory freed by a batch back to the OS: glibc keeps freed blocks for reuse,
    fragmented among the device buffers on XLA:CPU, so the process would grow by a fifth of the
    model more however small the batches (GPT-2 small: 1.30x the file instead of 1.10x)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
