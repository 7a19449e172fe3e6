"""Loads onto a device whose buffers are host memory (XLA:CPU, `tiekit.devices.adopts_host_memory`):
each tensor is read into memory of its own, which the device then takes over (`devices.adopt_host`).
Nothing is staged, transferred or compiled, so a load costs the file's bytes once.

A new tensor (a load from meta, or onto another device or dtype) is simply read and taken over.
A tensor already on the device (an in-place load) first lets go of its buffer
(`devices.release_buffers`), so the memory its new values are read into is the memory its old ones
freed: the model never exists twice, even for a dominant embedding, with no pieces written in place
(whose graph's first compilation alone cost 0.14x of a 79 MiB model). `tiekit.checkpoint.streaming`
sends everything else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from tiekit import devices
from tiekit.checkpoint.reads import TensorReader
from tiekit.header import FileIdentity

if TYPE_CHECKING:
    from tiekit.checkpoint.streaming import Job, RowPart


def adopt_new(jobs: list[Job], files: Mapping[str, FileIdentity]) -> list[tuple[Job, torch.Tensor]]:
    """Each job's value as a new device tensor on the memory it was read into (the jobs replace
    their tensors; `adopt_hosts`)."""
    hosts = [torch.empty(job.entry[1].shape, dtype=job.entry[1].dtype) for job in jobs]
    with TensorReader(files) as reader:
        reader.read([(*job.entry, host) for job, host in zip(jobs, hosts, strict=True)])
    values = adopt_hosts(hosts, [(job.dtype, job.device) for job in jobs])
    return list(zip(jobs, values, strict=True))


def adopt_in_place(
    parts: list[RowPart], files: Mapping[str, FileIdentity], room: int, reader: TensorReader | None = None
) -> list[RowPart]:
    """Overwrite device tensors with the rows of ``parts`` (`tiekit.checkpoint.streaming.RowPart`),
    each tensor's buffer released before its new values are read, in batches of about ``room``
    bytes (a larger tensor alone). A tensor whose parts do not cover it exactly is not touched:
    its parts are returned, for the caller to stream. Every file is checked before the first byte
    is read; an I/O error mid-read leaves the batch being read zeros. ``reader``: the caller's, its
    files opened already (else one of its own). Local."""
    groups: dict[int, list[RowPart]] = {}
    for part in parts:
        groups.setdefault(id(part.tensor), []).append(part)
    covered = {key: _covers(group) for key, group in groups.items()}
    whole = [group for key, group in groups.items() if covered[key]]
    rest = [part for key, group in groups.items() if not covered[key] for part in group]
    if not whole:
        return rest
    with contextlib.ExitStack() as stack, torch.no_grad():
        if reader is None:
            reader = stack.enter_context(TensorReader(files))
        reader.open({part.path for group in whole for part in group})
        for batch in _batches(whole, room):
            devices.release_buffers([group[0].tensor for group in batch])  # their memory back for the reads
            hosts = [torch.empty(group[0].tensor.shape, dtype=group[0].entry.dtype) for group in batch]
            reads = [(p.path, p.entry, _rows(host, p)) for group, host in zip(batch, hosts, strict=True) for p in group]
            reader.read(reads)
            del reads
            values = adopt_hosts(hosts, [(group[0].tensor.dtype, group[0].tensor.device) for group in batch])
            for group, value in zip(batch, values, strict=True):
                with devices.writing(group[0].tensor):
                    group[0].tensor.copy_(value)  # the tensor now holds the adopted buffer: no copy on XLA
            del values
    devices.sync()
    return rest


def adopt_hosts(hosts: list[torch.Tensor], targets: list[tuple[torch.dtype, torch.device]]) -> list[torch.Tensor]:
    """Each host tensor, cast to its (dtype, device) target's dtype on the host where they differ,
    as a tensor on that device on its memory; by transfer where the device cannot take it over
    (`devices.adopt_host`: float8). Takes the tensors out of ``hosts`` one by one, so a file-dtype
    original goes once it is cast."""
    out = []
    for dtype, device in targets:
        host = hosts.pop(0).to(dtype)  # no copy when the dtype is right
        value = devices.adopt_host(host)  # the device's buffer from now on: no other reference is kept
        out.append(devices.to_device([host], device)[0] if value is None else value)
        del host
    return out


def _rows(host: torch.Tensor, part: RowPart) -> torch.Tensor:
    """The part's rows of ``host`` (a view: contiguous, as rows of a contiguous tensor are)."""
    return host if host.dim() == 0 else host.narrow(0, part.first, part.entry.shape[0])


def _covers(group: list[RowPart]) -> bool:
    """Whether the parts are the tensor's rows exactly once each, in one dtype, on a device that
    takes over host memory (not an SPMD-sharded tensor, whose buffers are several devices')."""
    tensor = group[0].tensor
    if not devices.adopts_host_memory(tensor.device) or devices.spmd_sharding(tensor) is not None:
        return False
    if tensor.dim() == 0:
        return len(group) == 1 and tuple(group[0].entry.shape) == ()
    rows = sorted((part.first, part.entry.shape[0]) for part in group)
    starts = [0] + [first + count for first, count in rows[:-1]]
    return (
        all(first == start for (first, _), start in zip(rows, starts, strict=True))
        and rows[-1][0] + rows[-1][1] == tensor.shape[0]
        and all(tuple(part.entry.shape[1:]) == tuple(tensor.shape[1:]) for part in group)
        and len({part.entry.dtype for part in group}) == 1
    )


def _batches(groups: list[list[RowPart]], room: int) -> Iterator[list[list[RowPart]]]:
    batch: list[list[RowPart]] = []
    size = 0
    for group in groups:
        nbytes = sum(part.entry.end - part.entry.start for part in group)
        if batch and size + nbytes > room:
            yield batch
            batch, size = [], 0
        batch.append(group)
        size += nbytes
    if batch:
        yield batch
