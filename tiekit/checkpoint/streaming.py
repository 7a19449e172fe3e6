"""Streaming tensors from files onto devices at the memory floor: reused host buffers, one batched
transfer per buffer, and a tensor larger than a buffer cut into pieces of whole rows written in
place on the device (`tiekit.devices.write_rows`). `tiekit.checkpoint.loading` sends the tensors
of safetensors files this way; `tiekit.dcp.loading` the rows of DCP shard files.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tiekit import devices
from tiekit.checkpoint.reads import TensorReader
from tiekit.header import FileIdentity, TensorEntry


@dataclass(frozen=True)
class Job:
    """One tensor to fill: from ``entry`` (file, header entry), ending on ``device`` as ``dtype``;
    ``replace``: a new tensor takes the slot (meta, another device or dtype), else in place."""

    tensor: torch.Tensor
    entry: tuple[str, TensorEntry]
    device: torch.device
    dtype: torch.dtype
    replace: bool


@dataclass(frozen=True)
class RowPart:
    """Rows ``[first, first + entry.shape[0])`` of ``tensor``, whose bytes are ``entry`` in ``path``."""

    tensor: torch.Tensor
    path: str
    entry: TensorEntry
    first: int


#: Bytes of each of the two host buffers a load onto XLA or CUDA streams through: one batch is read
#: into one while the previous batch, in the other, is transferred; never the whole model (a
#: tensor larger than this goes alone, in memory of its own, freed once it is transferred).
STAGING_BYTES = 16 << 20


def stream_to_devices(jobs: list[Job], files: Mapping[str, FileIdentity]) -> list[tuple[Job, torch.Tensor]]:
    """Each replacing job's new value on its device (jobs filled in place are written as their
    batch arrives), read and transferred in batches of at most `STAGING_BYTES` (a larger tensor
    alone): each batch is read into a reused buffer while the one before it is transferred from
    the other, so reading and transferring overlap as in one batched transfer. A device whose
    buffers are host memory (XLA:CPU, `devices.adopts_host_memory`) takes each new tensor's memory
    as it is read instead: nothing is staged or copied."""
    adopted = [job for job in jobs if job.replace and devices.adopts_host_memory(job.device)]
    if adopted:
        taken = {id(job) for job in adopted}
        return _adopt(adopted, files) + stream_to_devices([job for job in jobs if id(job) not in taken], files)
    total = sum(_staged_bytes(job) for job in jobs)
    pieces: dict[int, tuple[Job, int]] = {}  # id(piece) -> (the job it is part of, its first row)
    units: list[Job] = []
    for job in jobs:
        cut = _pieces(job, total)
        pieces.update((id(piece), (job, first)) for first, piece in cut)
        units.extend([piece for _, piece in cut] or [job])
    return _stream(units, pieces, files)


def _adopt(jobs: list[Job], files: Mapping[str, FileIdentity]) -> list[tuple[Job, torch.Tensor]]:
    """Each job's tensor read into memory of its own, which its device then takes over (`_adopted`)."""
    hosts = [torch.empty(job.entry[1].shape, dtype=job.entry[1].dtype) for job in jobs]
    with TensorReader(files) as reader:
        reader.read([(*job.entry, host) for job, host in zip(jobs, hosts, strict=True)])
    return _adopted(jobs, hosts)


def stream_rows_in_place(parts: list[RowPart], files: Mapping[str, FileIdentity]) -> None:
    """Overwrite device tensors in place with rows read from files: each `RowPart` is the bytes of
    rows ``[first, first + entry.shape[0])`` of its tensor. A part that is the whole tensor goes as
    `stream_to_devices` sends a tensor filled in place; a part of one is written as pieces of rows
    (`tiekit.devices.write_rows`). The writes have run when this returns. Local."""
    total = sum(part.entry.end - part.entry.start for part in parts)
    pieces: dict[int, tuple[Job, int]] = {}
    units: list[Job] = []
    for part in parts:
        job = Job(part.tensor, (part.path, part.entry), part.tensor.device, part.tensor.dtype, False)
        if part.first == 0 and tuple(part.entry.shape) == tuple(part.tensor.shape):
            cut = _pieces(job, total)
        else:
            row = (part.entry.end - part.entry.start) // max(part.entry.shape[0], 1)
            count = min(part.entry.shape[0], max((STAGING_BYTES - 63) // max(row, 1), 1))
            cut = _cut(job, count, part.first)
        pieces.update((id(piece), (job, first)) for first, piece in cut)
        units.extend([piece for _, piece in cut] or [job])
    _stream(units, pieces, files)
    devices.sync()


def _stream(
    units: list[Job], pieces: dict[int, tuple[Job, int]], files: Mapping[str, FileIdentity]
) -> list[tuple[Job, torch.Tensor]]:
    total = sum(_staged_bytes(unit) for unit in units)
    # Larger tensors first: such a batch briefly exists three times (its own memory, torch_xla's
    # copy of it, the device buffer: all host memory on XLA:CPU), cheapest while little is on the
    # device. The rest keep the file's order, which reads the file front to back.
    units.sort(key=lambda job: -_staged_bytes(job) if _staged_bytes(job) > STAGING_BYTES else 0)
    batches = list(_batches(units))
    room = min(STAGING_BYTES, total)
    targets: dict[int, torch.Tensor] = {}  # id(job) -> the device tensor its pieces are written into
    free: list[torch.Tensor] = []  # staging buffers not in use; two at most are ever made
    out: list[tuple[Job, torch.Tensor]] = []
    with TensorReader(files) as reader:  # waits for every read begun, even when a transfer fails
        reader.open({unit.entry[0] for unit in units})  # every file checked before the first byte is read

        def start(batch: list[Job]) -> tuple[torch.Tensor, list[torch.Tensor], list[Future[None]]]:
            size = sum(_staged_bytes(job) for job in batch)
            if size > STAGING_BYTES:
                block = torch.empty(size, dtype=torch.uint8)  # one tensor larger than a buffer
            else:
                block = free.pop() if free else torch.empty(room, dtype=torch.uint8)
            hosts, offset = [], 0
            for job in batch:
                entry = job.entry[1]
                hosts.append(block[offset : offset + entry.end - entry.start].view(entry.dtype).view(entry.shape))
                offset += _staged_bytes(job)
            return block, hosts, reader.start([(*job.entry, host) for job, host in zip(batch, hosts, strict=True)])

        pending = start(batches[0]) if batches else None
        for index, batch in enumerate(batches):
            assert pending is not None  # started before the loop or in the previous round
            block, hosts, reads = pending
            reader.wait(reads)
            following = batches[index + 1] if index + 1 < len(batches) else None
            ahead = following is not None and _fits(following)
            pending = start(following) if following is not None and ahead else None  # read as this crosses
            adopted = _adopting(batch)
            out.extend(_place(_adopted(batch, hosts) if adopted else _transfer(batch, hosts), pieces, targets))
            del hosts
            if _fits(batch) and not adopted:  # an adopted block is the device's now
                free.append(block)
            del block  # a larger tensor's own memory goes now
            release_freed_memory()
            if following is not None and not ahead:
                pending = start(following)  # a larger tensor: not while this batch's copies exist
    return out


#: What cutting a tensor into pieces may cost beyond the pieces' own copies: the first XLA
#: compilation of a process takes about 40 MB of host memory on XLA:CPU.
_PIECES_COST = 64 << 20


def _pieces(job: Job, total: int) -> list[tuple[int, Job]]:
    """The job cut into pieces of whole rows that each fit a staging buffer, as (first row, piece),
    when that takes less memory than the tensor whole; else nothing.

    A tensor larger than a buffer crosses whole, briefly existing three times (`_stream_to_devices`);
    in pieces it exists once, on the device, each piece written in place (`devices.write_rows`),
    but on XLA that costs a compilation (the first of a process: about 40 MB of host memory on
    XLA:CPU, `_PIECES_COST`) and every piece's three copies. A new tensor goes in pieces only when
    its three copies would exceed the whole load plus that: a dominant embedding (GPT-2 with a 128k
    vocabulary), not GPT-2 small's (31% of the model; the load peaks at its end anyway). A tensor
    filled in place (a model already on the device) goes in pieces once its three copies exceed
    that cost alone: they come on top of the whole model (GPT-2 small's embedding does). All
    pieces have one shape, so one graph serves them: the last starts early and overlaps the one
    before it.
    """
    entry = job.entry[1]
    size = entry.end - entry.start
    # Written in place, the tensor's three copies come on top of the whole model already there.
    room = (total if job.replace else 0) + 3 * STAGING_BYTES + _PIECES_COST
    if size <= STAGING_BYTES or len(entry.shape) == 0 or entry.shape[0] < 2 or 3 * size <= room:
        return []
    row = size // entry.shape[0]
    count = (STAGING_BYTES - 63) // row  # rows per piece; its room is rounded up to 64 bytes
    if count == 0:
        return []  # one row is larger than a buffer
    return _cut(job, count, 0)


def _cut(job: Job, count: int, base: int) -> list[tuple[int, Job]]:
    """The job's rows in pieces of ``count`` rows, the last one overlapping the one before it so
    that all have one shape, as (row of the whole tensor: ``base`` + the row in the job, piece)."""
    path, entry = job.entry
    rows = entry.shape[0]
    firsts = [*range(0, rows - count, count), rows - count]
    return [(base + first, dataclasses.replace(job, entry=(path, entry.rows(first, count)))) for first in firsts]


def _place(
    moved: list[tuple[Job, torch.Tensor]], pieces: dict[int, tuple[Job, int]], targets: dict[int, torch.Tensor]
) -> list[tuple[Job, torch.Tensor]]:
    """New tensors as they are (returned); a job filled in place is written now; pieces written
    into their job's tensor, or for a replacing job a device tensor made at its first piece (and
    returned then, once per job). The writes run now, so each batch's device memory goes."""
    out: list[tuple[Job, torch.Tensor]] = []
    written = False
    for unit, value in moved:
        whole = pieces.get(id(unit))
        if whole is None:
            if unit.replace:
                out.append((unit, value))
            else:
                unit.tensor.copy_(value)
                written = True
            continue
        job, first = whole
        target = None if job.replace else job.tensor
        if target is None:
            target = targets.get(id(job))
        if target is None:
            target = targets[id(job)] = torch.zeros(job.entry[1].shape, dtype=job.dtype, device=job.device)
            devices.mark_sharded_as(target, job.tensor)  # sharded as the SPMD tensor it replaces, if any
            devices.sync()  # a graph of its own, so every write runs the same one
            out.append((job, target))
        devices.write_rows(target, first, value)
        written = True
    if written:
        moved.clear()
        del unit, value  # the last piece too: its device memory goes when the writes run
        devices.sync()
    return out


def _fits(batch: list[Job]) -> bool:
    return sum(_staged_bytes(job) for job in batch) <= STAGING_BYTES


def _transfer(batch: list[Job], hosts: list[torch.Tensor]) -> list[tuple[Job, torch.Tensor]]:
    """The batch on its devices, one batched transfer per device; a value that overwrites an XLA
    SPMD-sharded tensor whole goes sharded as it (`_sharded_target`). torch_xla copies each host
    tensor before it returns (its AtenSource, a blocking ``Tensor.to(copy=True)``; the device
    buffer is filled from that copy), as a blocking ``.to()`` does: the buffer is free after."""
    by_device: dict[torch.device, list[tuple[Job, torch.Tensor]]] = {}
    sharded: dict[int, torch.Tensor] = {}  # id(job) -> its value, sharded as the tensor it overwrites
    for job, host in zip(batch, hosts, strict=True):
        if _sharded_target(job):
            sharded[id(job)] = devices.to_device_sharded_as(host.to(job.dtype), job.tensor)
        else:
            by_device.setdefault(job.device, []).append((job, host))
    moved: dict[int, torch.Tensor] = {}
    for device, items in by_device.items():
        values = devices.to_device([host.to(job.dtype) for job, host in items], device)
        moved.update((id(job), value) for (job, _), value in zip(items, values, strict=True))
    return [(job, sharded[id(job)] if id(job) in sharded else moved[id(job)]) for job in batch]


def _adopting(batch: list[Job]) -> bool:
    """Whether every job of the batch goes to a device that takes over host memory (XLA:CPU)."""
    return all(devices.adopts_host_memory(job.device) and not _sharded_target(job) for job in batch)


def _adopted(batch: list[Job], hosts: list[torch.Tensor]) -> list[tuple[Job, torch.Tensor]]:
    """The batch's values as device tensors on the host memory they were read into (memory of
    their own, or 64-byte aligned views of one block: `_staged_bytes`), cast on the host where the
    dtype differs; by transfer where the device cannot take it (`devices.adopt_host`). Takes the
    hosts out of ``hosts`` one by one, so a file-dtype original goes once it is cast."""
    out = []
    for job in batch:
        host = hosts.pop(0).to(job.dtype)  # no copy when the dtype is right
        value = devices.adopt_host(host)  # the device's buffer from now on: no other reference is kept
        out.append((job, devices.to_device([host], job.device)[0] if value is None else value))
    return out


def _sharded_target(job: Job) -> bool:
    """Whether the job's value is a whole tensor sharded under XLA SPMD on its device: it overwrites
    one with ``copy_`` (torch_xla's ``copy_`` between XLA tensors gives the target the source's
    sharding, so a value transferred whole, ``{replicated}``, would leave every device holding all
    of it), or replaces one (``dtype="file"``), whose sharding the new tensor keeps. A piece of rows
    is written by `devices.write_rows`, which keeps the target's sharding."""
    whole = tuple(job.entry[1].shape) == tuple(job.tensor.shape)
    return whole and job.tensor.device == job.device and devices.spmd_sharding(job.tensor) is not None


def _staged_bytes(job: Job) -> int:
    """The job's room in the staging buffer: its bytes rounded up to 64, so every view is aligned."""
    entry = job.entry[1]
    return -(-(entry.end - entry.start) // 64) * 64


def _batches(jobs: list[Job]) -> Iterator[list[Job]]:
    batch: list[Job] = []
    size = 0
    for job in jobs:
        if batch and size + _staged_bytes(job) > STAGING_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(job)
        size += _staged_bytes(job)
    if batch:
        yield batch


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
