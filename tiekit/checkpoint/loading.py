"""Loading: stage (`tiekit.checkpoint.staging`: validate, change nothing), then commit.

Real tensors are overwritten in place, so parameter identity and optimizers stay valid; meta
tensors (and tensors on another device than the one asked for) are replaced by one new tensor
per unique weight, then re-tied.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiekit import devices
from tiekit.checkpoint.codec import Reader, decode
from tiekit.checkpoint.layout import CHECKPOINT_NAME, Device, PathLike
from tiekit.checkpoint.optimizer import stage_optimizer
from tiekit.checkpoint.reads import TensorReader, read_into, read_tensor
from tiekit.checkpoint.source import Source, open_source, training_record
from tiekit.checkpoint.staging import DtypePolicy, Staged, stage
from tiekit.errors import CheckpointError
from tiekit.header import FileIdentity, TensorEntry
from tiekit.plan import TieGroup, TiePlan
from tiekit.retie import retie
from tiekit.slots import assign, resolve, slot_table


@dataclass(frozen=True)
class LoadResult:
    """What `load_model` did.

    ``missing``: names of the model's state that the file did not provide (left unchanged).
    ``unexpected``: keys of the file that nothing in the model took. ``retied``: the tie
    groups applied to the model, by the model's names. ``plan_origin``: where the ties came
    from: ``"tiekit"`` (the file's plan), ``"safetensors"`` (safetensors' ``save_model``
    metadata) or ``"model"`` (the model's own ties, for files without tie metadata).
    """

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    retied: tuple[TieGroup, ...]
    plan_origin: str


def load_model(
    model: nn.Module, path: PathLike, *, strict: bool = True, device: Device = None, dtype: DtypePolicy = "model"
) -> LoadResult:
    """Load a safetensors file, an index or a folder into ``model`` and re-tie it.

    Works whatever state the model is in: tied, untied, ties broken by an XLA move, or on
    the meta device (each unique tensor is allocated once, on ``device`` or the CPU). Ties
    come from the file's plan, else safetensors' ``save_model`` metadata, else the model's
    own (detected and declared) ties. ``device`` is where the weights end up; by default
    they stay where the model's tensors are. ``dtype="model"`` casts floating-point values
    to the model's dtypes, as ``load_state_dict`` does; ``dtype="file"`` gives the model the
    file's dtypes (a meta model built in float32 loads a bfloat16 file as bfloat16). With
    ``strict`` missing or unexpected keys raise `CheckpointError`. Every error is raised before
    the model changes (ties included); see docs/checkpoints.md for the one exception, an I/O
    error in the middle of reading bytes into the model's own memory.
    """
    source = open_source(path)
    staged = stage(model, source, strict=strict, device=_device(device, source.where), dtype=dtype)
    _commit(model, source, staged)
    return LoadResult(staged.missing, staged.unexpected, staged.groups, source.plan_origin)


def _device(device: Device, where: str) -> torch.device | None:
    try:
        return devices.resolve_device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{where}: cannot load onto device {device!r}: {exc}") from exc


def _commit(model: nn.Module, source: Source, staged: Staged) -> None:
    """Read, then change the model: every file is opened and checked before the first byte is
    read, and ties are applied only after every read succeeded, so a failure leaves it as it was."""
    with torch.no_grad():
        jobs: list[_Job] = []
        seen: set[int] = set()
        for name, key in staged.loads:
            tensor = resolve(model, name)[2]
            if id(tensor) in seen:
                continue  # one tensor under several names the plan does not know (the model's own ties)
            seen.add(id(tensor))
            entry = source.entries[key]
            device = staged.device or (torch.device("cpu") if tensor.is_meta else tensor.device)
            dtype = entry[1].dtype if staged.keep_file_dtype else tensor.dtype
            replace = tensor.is_meta or not _same_device(tensor.device, device) or tensor.dtype != dtype
            jobs.append(_Job(tensor, entry, device, dtype, replace))
        fresh = _fill(jobs, source.files)
        if staged.device is not None:
            retied = {id(resolve(model, m.name)[2]) for g in staged.groups for m in g.members[1:]}
            for _, _, tensor, _ in slot_table(model).values():
                if id(tensor) in seen or id(tensor) in retied or tensor.is_meta:
                    continue  # loaded above, or about to point at its tie source
                if not _same_device(tensor.device, staged.device):
                    seen.add(id(tensor))
                    fresh[id(tensor)] = tensor.to(staged.device)
        for group in staged.groups:
            # A member about to point at a source that changed dtype (dtype="file") must not fail
            # retie's dtype check: it gets a placeholder of the new dtype, dropped by the retie.
            loaded = resolve(model, group.source)[2]
            new_dtype = fresh.get(id(loaded), loaded).dtype
            for member in group.members[1:]:
                old = resolve(model, member.name)[2]
                if old is not loaded and old.dtype != new_dtype and id(old) not in fresh:
                    fresh[id(old)] = torch.empty(old.shape, dtype=new_dtype, device="meta")
        if fresh:
            for module, attr, tensor, kind in slot_table(model).values():
                new = fresh.get(id(tensor))
                if new is not None:
                    if kind == "parameter" and not isinstance(new, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=tensor.requires_grad)
                        fresh[id(tensor)] = new
                    assign(module, attr, new, kind)
        retie(model, TiePlan(staged.groups, 0, 0))  # members point at their loaded source; views rebuilt


@dataclass(frozen=True)
class _Job:
    """One tensor to fill: from ``entry`` (file, header entry), ending on ``device`` as ``dtype``;
    ``replace``: a new tensor takes the slot (meta, another device or dtype), else in place."""

    tensor: torch.Tensor
    entry: tuple[str, TensorEntry]
    device: torch.device
    dtype: torch.dtype
    replace: bool


#: Bytes of each of the two host buffers a load onto XLA or CUDA streams through: one batch is read
#: into one while the previous batch, in the other, is transferred; never the whole model (a
#: tensor larger than this goes alone, in memory of its own, freed once it is transferred).
STAGING_BYTES = 16 << 20


def _fill(jobs: list[_Job], files: Mapping[str, FileIdentity]) -> dict[int, torch.Tensor]:
    """Read each job's bytes into its tensor (in place) or into a new tensor; {id(old): new}.

    Values are cast to the job's dtype as ``load_state_dict`` casts them. Tensors bound for a
    device other than the CPU stream through the host in `STAGING_BYTES` batches (one batched
    transfer each), first; then the CPU reads. Tensors filled in place are written as their
    bytes arrive (same-dtype CPU tensors are read straight into their memory, tensors already on
    their device are overwritten batch by batch): holding their new values aside would hold the
    model twice. Whatever else changes the model happens after every read succeeded.
    """
    on_device = _stream_to_devices([job for job in jobs if job.device.type != "cpu"], files)
    reads: list[tuple[str, TensorEntry, torch.Tensor]] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    replaced: list[tuple[_Job, torch.Tensor]] = []
    for job in jobs:
        if job.device.type != "cpu":
            continue
        path, entry = job.entry
        if not job.replace and job.tensor.dtype == entry.dtype and job.tensor.is_contiguous():
            reads.append((path, entry, job.tensor.detach()))  # straight into the parameter's memory
            continue
        host = torch.empty(entry.shape, dtype=entry.dtype)
        reads.append((path, entry, host))
        if job.replace:
            replaced.append((job, host))
        else:
            copies.append((job.tensor, host))
    read_into(reads, files)
    fresh = {id(job.tensor): host.to(job.dtype) for job, host in replaced}  # no copy when the dtype is right
    # Everything is read and on its device: only now does the rest of the model change.
    for tensor, host in copies:
        tensor.copy_(host)  # casts
    fresh.update((id(job.tensor), value) for job, value in on_device)
    return fresh


def _stream_to_devices(jobs: list[_Job], files: Mapping[str, FileIdentity]) -> list[tuple[_Job, torch.Tensor]]:
    """Each replacing job's new value on its device (jobs filled in place are written as their
    batch arrives), read and transferred in batches of at most `STAGING_BYTES` (a larger tensor
    alone): each batch is read into a reused buffer while the one before it is transferred from
    the other, so reading and transferring overlap as in one batched transfer."""
    # Larger tensors first: such a batch briefly exists three times (its own memory, torch_xla's
    # copy of it, the device buffer: all host memory on XLA:CPU), cheapest while little is on the
    # device. The rest keep the file's order, which reads the file front to back.
    total = sum(_staged_bytes(job) for job in jobs)
    pieces: dict[int, tuple[_Job, int]] = {}  # id(piece) -> (the job it is part of, its first row)
    units: list[_Job] = []
    for job in jobs:
        cut = _pieces(job, total)
        pieces.update((id(piece), (job, first)) for first, piece in cut)
        units.extend([piece for _, piece in cut] or [job])
    units.sort(key=lambda job: -_staged_bytes(job) if _staged_bytes(job) > STAGING_BYTES else 0)
    batches = list(_batches(units))
    room = min(STAGING_BYTES, total)
    targets: dict[int, torch.Tensor] = {}  # id(job) -> the device tensor its pieces are written into
    free: list[torch.Tensor] = []  # staging buffers not in use; two at most are ever made
    out: list[tuple[_Job, torch.Tensor]] = []
    with TensorReader(files) as reader:  # waits for every read begun, even when a transfer fails
        reader.open({job.entry[0] for job in jobs})  # every file checked before the first byte is read

        def start(batch: list[_Job]) -> tuple[torch.Tensor, list[torch.Tensor], list[Future[None]]]:
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
            out.extend(_place(_transfer(batch, hosts), pieces, targets))
            del hosts
            if _fits(batch):
                free.append(block)
            del block  # a larger tensor's own memory goes now
            release_freed_memory()
            if following is not None and not ahead:
                pending = start(following)  # a larger tensor: not while this batch's copies exist
    return out


#: What cutting a tensor into pieces may cost beyond the pieces' own copies: the first XLA
#: compilation of a process takes about 40 MB of host memory on XLA:CPU.
_PIECES_COST = 64 << 20


def _pieces(job: _Job, total: int) -> list[tuple[int, _Job]]:
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
    path, entry = job.entry
    size = entry.end - entry.start
    # Written in place, the tensor's three copies come on top of the whole model already there.
    room = (total if job.replace else 0) + 3 * STAGING_BYTES + _PIECES_COST
    if size <= STAGING_BYTES or len(entry.shape) == 0 or entry.shape[0] < 2 or 3 * size <= room:
        return []
    row = size // entry.shape[0]
    count = (STAGING_BYTES - 63) // row  # rows per piece; its room is rounded up to 64 bytes
    if count == 0:
        return []  # one row is larger than a buffer
    firsts = [*range(0, entry.shape[0] - count, count), entry.shape[0] - count]
    return [
        (
            first,
            dataclasses.replace(
                job,
                entry=(
                    path,
                    dataclasses.replace(
                        entry,
                        shape=(count, *entry.shape[1:]),
                        start=entry.start + first * row,
                        end=entry.start + (first + count) * row,
                    ),
                ),
            ),
        )
        for first in firsts
    ]


def _place(
    moved: list[tuple[_Job, torch.Tensor]], pieces: dict[int, tuple[_Job, int]], targets: dict[int, torch.Tensor]
) -> list[tuple[_Job, torch.Tensor]]:
    """New tensors as they are (returned); a job filled in place is written now; pieces written
    into their job's tensor, or for a replacing job a device tensor made at its first piece (and
    returned then, once per job). The writes run now, so each batch's device memory goes."""
    out: list[tuple[_Job, torch.Tensor]] = []
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
            devices.sync()  # a graph of its own, so every write runs the same one
            out.append((job, target))
        devices.write_rows(target, first, value)
        written = True
    if written:
        moved.clear()
        del unit, value  # the last piece too: its device memory goes when the writes run
        devices.sync()
    return out


def _fits(batch: list[_Job]) -> bool:
    return sum(_staged_bytes(job) for job in batch) <= STAGING_BYTES


def _transfer(batch: list[_Job], hosts: list[torch.Tensor]) -> list[tuple[_Job, torch.Tensor]]:
    """The batch on its devices, one batched transfer per device. torch_xla copies each host
    tensor before it returns (its AtenSource, a blocking ``Tensor.to(copy=True)``; the device
    buffer is filled from that copy), as a blocking ``.to()`` does: the buffer is free after."""
    by_device: dict[torch.device, list[tuple[_Job, torch.Tensor]]] = {}
    for job, host in zip(batch, hosts, strict=True):
        by_device.setdefault(job.device, []).append((job, host))
    out: list[tuple[_Job, torch.Tensor]] = []
    for device, items in by_device.items():
        moved = devices.to_device([host.to(job.dtype) for job, host in items], device)
        out.extend((job, value) for (job, _), value in zip(items, moved, strict=True))
    return out


def _staged_bytes(job: _Job) -> int:
    """The job's room in the staging buffer: its bytes rounded up to 64, so every view is aligned."""
    entry = job.entry[1]
    return -(-(entry.end - entry.start) // 64) * 64


def _batches(jobs: list[_Job]) -> Iterator[list[_Job]]:
    batch: list[_Job] = []
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


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def load_checkpoint(
    path: PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    dtype: DtypePolicy = "model",
) -> dict[str, Any]:
    """Load a `save_checkpoint` file into ``model`` (and ``optimizer``); returns step and extra.

    The returned dict holds ``"step"``, ``"extra"`` and ``"load_result"`` (a `LoadResult`).
    The optimizer's parameters are re-bound to the model's (re-tied) parameters and get their
    state back, matched by parameter name (cast to the parameters' dtypes by torch's
    ``Optimizer.load_state_dict``). ``dtype`` as in `load_model`. Local; all or nothing.
    """
    return read_training_checkpoint(path, model=model, optimizer=optimizer, dtype=dtype)


def read_training_checkpoint(
    path: PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    dtype: DtypePolicy = "model",
    readers: Mapping[str, Reader] | None = None,
) -> dict[str, Any]:
    """`load_checkpoint`, with ``readers`` for the markers a save's codec fallback wrote."""
    source = open_source(path, (CHECKPOINT_NAME,))
    record = training_record(source)
    staged = stage(model, source, strict=True, device=None, dtype=dtype)
    tensors = {k: read_tensor(*v, source.files) for k, v in source.side.items()}
    step = decode(record.get("step"), tensors, source.where)
    extra = decode(record.get("extra"), tensors, source.where, readers=readers)
    restore: Callable[[], None] | None = None
    if optimizer is not None:
        if not record.get("optimizer"):
            raise CheckpointError(f"{source.where}: holds no optimizer state")
        restore = stage_optimizer(optimizer, model, staged, record["optimizer"], tensors, source.where)
    _commit(model, source, staged)
    if restore is not None:
        restore()
    result = LoadResult(staged.missing, staged.unexpected, staged.groups, source.plan_origin)
    return {"step": step, "extra": extra, "load_result": result}
