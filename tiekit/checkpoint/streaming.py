"""Streaming tensors from files onto devices at the memory floor: reused host buffers, one batched
transfer per buffer, and a tensor larger than a buffer cut into pieces of whole rows written in
place on the device (`tiekit.devices.write_rows`). `tiekit.checkpoint.loading` sends the tensors
of safetensors files this way; `tiekit.dcp.loading` the rows of DCP shard files, into CPU tensors
too (read straight into the tensor's memory when it has the file's dtype, else in pieces cast
from a staging buffer, so a large tensor is never read whole beside it).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tiekit import devices
from tiekit.checkpoint.adoption import adopt_in_place, adopt_new
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


#: The most bytes of each of the two host buffers a load onto XLA or CUDA streams through: one
#: batch is read into one while the previous batch, in the other, is transferred; never the whole
#: model (a tensor larger than a buffer goes alone, in memory of its own, freed once it is
#: transferred, or in pieces that fit one). A load's own buffers are `staging_bytes` of its size.
STAGING_BYTES = 16 << 20

#: The fewest bytes of a staging buffer (unless `STAGING_BYTES` is fewer): below it, per-batch costs
#: (a transfer call, a graph run per piece) outweigh the memory saved.
_SMALLEST_STAGING = 1 << 20


def staging_bytes(total: int) -> int:
    """Bytes of each staging buffer of a load of ``total`` bytes: a 64th of it, at least 1 MiB and
    at most `STAGING_BYTES`. A batch briefly exists about three times on XLA (its buffer, torch_xla's
    copy, the device buffer), so two buffers and a batch in flight stay near 5/64 (8%) of the load,
    within issue 13's 15%; a fixed 16 MiB was 0.4-0.8x of a 79 MiB model with a dominant embedding."""
    return min(STAGING_BYTES, max(_SMALLEST_STAGING, total // 64))


def stream_to_devices(jobs: list[Job], files: Mapping[str, FileIdentity]) -> list[tuple[Job, torch.Tensor]]:
    """Each replacing job's new value on its device (jobs filled in place are written as their
    batch arrives), read and transferred in batches of at most `staging_bytes` (a larger tensor
    alone): each batch is read into a reused buffer while the one before it is transferred from
    the other, so reading and transferring overlap as in one batched transfer. A device whose
    buffers are host memory (XLA:CPU, `devices.adopts_host_memory`) takes each tensor's memory as
    it is read instead (`tiekit.checkpoint.adoption`): nothing is staged or copied."""
    total = sum(_staged_bytes(job) for job in jobs)
    room = staging_bytes(total)
    new = [job for job in jobs if job.replace and devices.adopts_host_memory(job.device)]
    adopted = adopt_new(new, files) if new else []
    in_place = [RowPart(job.tensor, *job.entry, 0) for job in jobs if not job.replace]
    left = {id(part.tensor) for part in adopt_in_place(in_place, files, room)} if in_place else set()
    taken = {id(job) for job in new}
    jobs = [job for job in jobs if id(job) not in taken and (job.replace or id(job.tensor) in left)]
    pieces: dict[int, tuple[Job, int]] = {}  # id(piece) -> (the job it is part of, its first row)
    units: list[Job] = []
    for job in jobs:
        cut = _pieces(job, total, room)
        pieces.update((id(piece), (job, first)) for first, piece in cut)
        units.extend([piece for _, piece in cut] or [job])
    with TensorReader(files) as reader:  # waits for every read begun, even when a transfer fails
        return adopted + _stream(units, pieces, reader, room)


def stream_rows_in_place(
    parts: list[RowPart], files: Mapping[str, FileIdentity], reader: TensorReader | None = None
) -> None:
    """Overwrite tensors (on a device or the CPU) in place with rows read from files: each `RowPart`
    is the bytes of rows ``[first, first + entry.shape[0])`` of its tensor, cast to the tensor's
    dtype if the file's differs. A part that is the whole tensor goes as
    `stream_to_devices` sends a tensor filled in place; a part of one is written as pieces of rows
    (`tiekit.devices.write_rows`); on a device that takes over host memory, the parts of each
    tensor are read into memory it then takes (`adoption.adopt_in_place`); rows in CPU memory of
    the file's dtype are read straight into it (`_read_straight`). Every file is checked to be
    the one located before the first byte is written anywhere (``reader``: the caller's, which
    opened them earlier; else one of its own). The writes have run when this returns. Local."""
    total = sum(part.entry.end - part.entry.start for part in parts)
    room = staging_bytes(total)
    with contextlib.ExitStack() as stack:
        if reader is None:
            reader = stack.enter_context(TensorReader(files))
        reader.open({part.path for part in parts})  # a file replaced since it was located: nothing written
        parts = _read_straight(parts, reader)
        parts = adopt_in_place(parts, files, room, reader)
        pieces: dict[int, tuple[Job, int]] = {}
        units: list[Job] = []
        for part in parts:
            job = Job(part.tensor, (part.path, part.entry), part.tensor.device, part.tensor.dtype, False)
            if part.first == 0 and tuple(part.entry.shape) == tuple(part.tensor.shape):
                cut = _pieces(job, total, room)
            else:
                row = (part.entry.end - part.entry.start) // max(part.entry.shape[0], 1)
                count = min(part.entry.shape[0], max((room - 63) // max(row, 1), 1))
                cut = _cut(job, count, part.first)
            pieces.update((id(piece), (job, first)) for first, piece in cut)
            units.extend([piece for _, piece in cut] or [job])
        _stream(units, pieces, reader, room)
    devices.sync()


def _read_straight(parts: list[RowPart], reader: TensorReader) -> list[RowPart]:
    """Read each part whose rows are contiguous CPU memory of the file's dtype straight into them
    (`TensorReader.read`: the file's bytes copied once, from the page cache into the tensor; no
    staging buffer, no second copy, no memory beyond the tensor); returns the other parts.
    Through a staging buffer (`_stream`) the load of a 1000 MiB embedding took 2x ``dcp.load``'s
    time, its pieces each read, then copied, by the 2 cores DCP's reader also used."""
    straight = [(part, rows) for part in parts if (rows := _cpu_rows(part)) is not None]
    if not straight:
        return parts
    reader.read([(part.path, part.entry, rows) for part, rows in straight])
    written = {id(part.tensor): part.tensor for part, _ in straight}
    for tensor in written.values():
        if not tensor.is_inference():  # written behind autograd's back: a graph that saved it must know
            torch.autograd.graph.increment_version(tensor)
    taken = {id(part) for part, _ in straight}
    return [part for part in parts if id(part) not in taken]


def _cpu_rows(part: RowPart) -> torch.Tensor | None:
    """The part's rows of its tensor, when the file's bytes can be read into them as they are:
    CPU memory, contiguous, of the file's dtype and row shape; else None."""
    tensor, entry = part.tensor, part.entry
    if tensor.device.type != "cpu" or tensor.dtype != entry.dtype or not tensor.is_contiguous():
        return None
    if tensor.is_conj() or tensor.is_neg() or type(tensor) is not torch.Tensor:
        return None
    if part.first == 0 and tuple(entry.shape) == tuple(tensor.shape):
        return tensor
    if tensor.dim() == 0 or len(entry.shape) != tensor.dim() or tuple(entry.shape[1:]) != tuple(tensor.shape[1:]):
        return None
    if part.first + entry.shape[0] > tensor.shape[0]:
        return None
    return tensor.narrow(0, part.first, entry.shape[0])  # whole rows of a contiguous tensor: contiguous


def _stream(
    units: list[Job], pieces: dict[int, tuple[Job, int]], reader: TensorReader, room: int
) -> list[tuple[Job, torch.Tensor]]:
    """The units read into two reused buffers of ``room`` bytes (`staging_bytes`) and sent on."""
    total = sum(_staged_bytes(unit) for unit in units)
    # Larger tensors first: such a batch briefly exists three times (its own memory, torch_xla's
    # copy of it, the device buffer: all host memory on XLA:CPU), cheapest while little is on the
    # device. The rest keep the file's order, which reads the file front to back.
    units.sort(key=lambda job: -_staged_bytes(job) if _staged_bytes(job) > room else 0)
    batches = list(_batches(units, room))
    made = min(room, total)  # the size of a new buffer: no larger than the whole load
    targets: dict[int, torch.Tensor] = {}  # id(job) -> the device tensor its pieces are written into
    free: list[torch.Tensor] = []  # staging buffers not in use; two at most are ever made
    out: list[tuple[Job, torch.Tensor]] = []
    reader.open({unit.entry[0] for unit in units})  # every file checked before the first byte is read

    def start(batch: list[Job]) -> tuple[torch.Tensor, list[torch.Tensor], list[Future[None]]]:
        size = sum(_staged_bytes(job) for job in batch)
        if size > room:
            block = torch.empty(size, dtype=torch.uint8)  # one tensor larger than a buffer
        else:
            block = free.pop() if free else torch.empty(made, dtype=torch.uint8)
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
        ahead = following is not None and _fits(following, room)
        pending = start(following) if following is not None and ahead else None  # read as this crosses
        out.extend(_place(_transfer(batch, hosts), pieces, targets))
        del hosts
        if _fits(batch, room):
            free.append(block)
        del block  # a larger tensor's own memory goes now
        if any(job.device.type != "cpu" for job in batch):  # a CPU load reuses its two buffers
            devices.release_freed_memory()
        if following is not None and not ahead:
            pending = start(following)  # a larger tensor: not while this batch's copies exist
    return out


#: What cutting a tensor into pieces may cost beyond the pieces' own copies: the first XLA
#: compilation of a process takes about 40 MB of host memory on XLA:CPU.
_PIECES_COST = 64 << 20


def _pieces(job: Job, total: int, room: int) -> list[tuple[int, Job]]:
    """The job cut into pieces of whole rows that each fit a staging buffer of ``room`` bytes, as
    (first row, piece), when that takes less memory than the tensor whole; else nothing.

    On the CPU (a load of DCP shard files into a CPU model, `tiekit.dcp.loading`) a piece costs
    one copy and nothing else: every tensor larger than a buffer goes in pieces.

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
    if size <= room or len(entry.shape) == 0 or entry.shape[0] < 2:
        return []
    # Written in place, the tensor's three copies come on top of the whole model already there.
    whole = (total if job.replace else 0) + 3 * room + _PIECES_COST
    if job.device.type != "cpu" and 3 * size <= whole:  # a piece into CPU memory is one copy, nothing compiled
        return []
    row = size // entry.shape[0]
    count = (room - 63) // row  # rows per piece; its room is rounded up to 64 bytes
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
                with devices.writing(unit.tensor):
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


def _fits(batch: list[Job], room: int) -> bool:
    return sum(_staged_bytes(job) for job in batch) <= room


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
    cpu = by_device.pop(torch.device("cpu"), [])
    # Written into a CPU tensor at once (`_place`), whose copy_ casts: no cast copy first; a new
    # tensor must not be the staging buffer, reused for the next batch.
    moved.update((id(job), host if not job.replace else host.to(job.dtype, copy=True)) for job, host in cpu)
    for device, items in by_device.items():
        values = devices.to_device([host.to(job.dtype) for job, host in items], device)
        moved.update((id(job), value) for (job, _), value in zip(items, values, strict=True))
    return [(job, sharded[id(job)] if id(job) in sharded else moved[id(job)]) for job in batch]


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


def _batches(jobs: list[Job], room: int) -> Iterator[list[Job]]:
    batch: list[Job] = []
    size = 0
    for job in jobs:
        if batch and size + _staged_bytes(job) > room:
            yield batch
            batch, size = [], 0
        batch.append(job)
        size += _staged_bytes(job)
    if batch:
        yield batch
