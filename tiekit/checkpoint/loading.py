"""Loading: stage (`tiekit.checkpoint.staging`: validate, change nothing), then commit.

Real tensors are overwritten in place, so parameter identity and optimizers stay valid; meta
tensors (and tensors on another device than the one asked for) are replaced by one new tensor
per unique weight, then re-tied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiekit import devices
from tiekit.backends.torch_distributed import (
    copy_rows_into_dtensor,
    copy_whole_into_dtensor,
    dtensor_from_rows,
    dtensor_local_rows,
    is_dtensor,
)
from tiekit.checkpoint.arguments import check_model, check_optimizer, check_path
from tiekit.checkpoint.codec import Reader, decode
from tiekit.checkpoint.layout import CHECKPOINT_NAME, Device, PathLike
from tiekit.checkpoint.optimizer import sharded_state_rows, stage_optimizer
from tiekit.checkpoint.reads import TensorReader, read_tensors, reading_again
from tiekit.checkpoint.source import Source, open_source, training_record
from tiekit.checkpoint.staging import DtypePolicy, Staged, give_extra_states, stage
from tiekit.checkpoint.streaming import Job, stream_to_devices
from tiekit.errors import CheckpointError
from tiekit.header import FileIdentity, TensorEntry
from tiekit.plan import TieGroup, TiePlan
from tiekit.retie import retie
from tiekit.slots import assign, resolve, slot_table
from tiekit.wrappers import unwrap


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
    error in the middle of reading bytes into the model's own memory. A file another process
    saves over after it was validated and before it is read is loaded again from the start.
    """

    check_path(path, "load_model(model, path)")
    check_model(model, "load_model(model, path)")
    model = unwrap(model)  # the names a DDP or torch.compile wrapper prefixes are its module's

    def load() -> LoadResult:
        source = open_source(path)
        staged = stage(model, source, strict=strict, device=usable_device(device, source.where), dtype=dtype)
        _commit(model, source, staged)
        return LoadResult(staged.missing, staged.unexpected, staged.groups, source.plan_origin)

    return reading_again(load)


def usable_device(device: Device, where: str) -> torch.device | None:
    """``device`` resolved, and checked usable here: "cuda" (or an int) names a device without
    one, which failed only at the first tensor read onto it, as torch's own error."""
    try:
        resolved = devices.resolve_device(device)
        if resolved is not None:
            torch.empty(0, device=resolved)  # no bytes: initializes the device, or says why it cannot
    except (RuntimeError, ValueError, TypeError, AssertionError, IndexError) as exc:
        # Its first sentence: torch's may go on to list every backend.
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0]
        raise CheckpointError(f"{where}: cannot load onto device {device!r}: {reason}") from exc
    return resolved


def _commit(model: nn.Module, source: Source, staged: Staged) -> None:
    """Read, then change the model: every file is opened and checked before the first byte is
    read, and ties are applied only after every read succeeded, so a failure leaves it as it was."""
    with torch.no_grad():
        # Read first, as the weights are: a failure leaves the model as it was. On the CPU unless a
        # device was asked for (a map_location); in the file's dtype, as load_state_dict passes it.
        extra_states = read_tensors({k: source.entries[k] for k in staged.extra_states}, source.files)
        if staged.device is not None:
            extra_states = {k: v.to(staged.device) for k, v in extra_states.items()}
        jobs: list[Job] = []
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
            if replace and is_dtensor(tensor):
                raise CheckpointError(
                    f"{source.where}: cannot load {name!r} into a sharded (FSDP2) model "
                    f"{'on the meta device' if tensor.is_meta else 'while changing its device or dtype'}: a sharded "
                    "parameter is filled in place, its shard on each rank. Allocate it first (model.to_empty(...)), or "
                    "load before sharding; tiekit.load_sharded reads sharded checkpoints"
                )
            jobs.append(Job(tensor, entry, device, dtype, replace))
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
    give_extra_states(model, extra_states, source.where)


def _fill(jobs: list[Job], files: Mapping[str, FileIdentity]) -> dict[int, torch.Tensor]:
    """Read each job's bytes into its tensor (in place) or into a new tensor; {id(old): new}.

    Values are cast to the job's dtype as ``load_state_dict`` casts them. Tensors bound for a
    device other than the CPU stream through the host in batches of `staging_bytes` (one batched
    transfer each), first; then the CPU reads. Tensors filled in place are written as their
    bytes arrive (same-dtype CPU tensors are read straight into their memory, tensors already on
    their device are overwritten batch by batch): holding their new values aside would hold the
    model twice. A tensor that changes dtype is cast as its bytes arrive, through one small buffer
    (`_read_cast`): a new tensor is held in its new dtype only, a value held aside for a tensor
    filled in place in the smaller of the file's dtype and the model's. Whatever else changes the model
    happens after every read succeeded.
    """
    # A sharded (DTensor) parameter: each rank reads only its rows when its shard is whole rows
    # (FSDP2), else the whole tensor, keeping its shard of it. Never the whole model per rank.
    sharded = {id(job.tensor): dtensor_local_rows(job.tensor) for job in jobs if is_dtensor(job.tensor)}
    streamed = [job for job in jobs if job.device.type != "cpu" and id(job.tensor) not in sharded]
    on_device = stream_to_devices(streamed, files)
    reads: list[tuple[str, TensorEntry, torch.Tensor]] = []
    held: list[tuple[str, TensorEntry, torch.dtype]] = []  # read, cast at once, kept: one per owner
    owners: list[tuple[Job, bool]] = []  # (job, replaced) of each held value
    for job in jobs:
        if job.device.type != "cpu" and id(job.tensor) not in sharded:
            continue
        path, entry = job.entry
        in_place = not job.replace and id(job.tensor) not in sharded
        if in_place and job.tensor.dtype == entry.dtype and _holds_its_values(job.tensor):
            reads.append((path, entry, job.tensor.detach()))  # straight into the parameter's memory
            continue
        rows = sharded.get(id(job.tensor))
        if rows is not None:
            entry = entry.rows(*rows)
            local = job.tensor.to_local()  # type: ignore[attr-defined]
            if local.device.type == "cpu" and local.dtype == entry.dtype and _holds_its_values(local):
                reads.append((path, entry, local.detach()))  # straight into this rank's shard
                continue
        if job.replace:
            held.append((path, entry, job.dtype))
        else:
            # copy_ casts, so a value held aside until every read succeeded can be held in the
            # model's dtype when that is the smaller: a bfloat16 model never holds a float32 file.
            smaller = job.dtype if job.dtype.itemsize < entry.dtype.itemsize else entry.dtype
            held.append((path, entry, smaller))
        owners.append((job, job.replace))
    with TensorReader(files) as reader:
        reader.open({path for path, _, _ in reads} | {path for path, _, _ in held})
        values = _read_cast(reader, held)  # first: a failure here leaves the model as it was
        reader.read(reads)
    fresh = {id(job.tensor): value for (job, replace), value in zip(owners, values, strict=True) if replace}
    copies = [(job.tensor, value) for (job, replace), value in zip(owners, values, strict=True) if not replace]
    # Everything is read and on its device: only now does the rest of the model change.
    for tensor, host in copies:
        if sharded.get(id(tensor)) is not None:
            copy_rows_into_dtensor(tensor, host)
        elif id(tensor) in sharded:
            copy_whole_into_dtensor(tensor, host)
        else:
            tensor.copy_(host)  # casts
    fresh.update((id(job.tensor), value) for job, value in on_device)
    return fresh


#: `_read_cast` reads the bytes of tensors that change dtype through one buffer of this size (a
#: larger tensor in pieces): beyond the values it returns, a load holds no more of the file.
CAST_BATCH_BYTES = 1 << 24
_ALIGN = 64


def _read_cast(reader: TensorReader, entries: list[tuple[str, TensorEntry, torch.dtype]]) -> list[torch.Tensor]:
    """Each entry read into a new CPU tensor of its dtype. An entry of another dtype in the file
    goes through one reused buffer of `CAST_BATCH_BYTES`, piece by piece, cast into its tensor:
    reading every file-dtype tensor before the first cast held the whole file beside the model
    (2.1 GiB for a 0.7 GiB bfloat16 model from a float32 file)."""
    values = [torch.empty(entry.shape, dtype=dtype) for _, entry, dtype in entries]
    reader.read(
        [
            (path, entry, value)
            for (path, entry, dtype), value in zip(entries, values, strict=True)
            if entry.dtype == dtype
        ]
    )
    pieces: list[tuple[str, TensorEntry, torch.Tensor]] = []  # file, range of the file, where it goes
    for (path, entry, dtype), value in zip(entries, values, strict=True):
        if entry.dtype == dtype or value.numel() == 0:
            continue
        size = entry.dtype.itemsize
        step = max(CAST_BATCH_BYTES // size, 1)
        flat = value.view(-1)
        for first in range(0, flat.numel(), step):
            count = min(step, flat.numel() - first)
            start = entry.start + first * size
            part = dataclasses.replace(entry, shape=(count,), start=start, end=start + count * size)
            pieces.append((path, part, flat[first : first + count]))
    if not pieces:
        return values
    staging = torch.empty(
        min(CAST_BATCH_BYTES, sum(part.end - part.start + _ALIGN for _, part, _ in pieces)), dtype=torch.uint8
    )
    batch: list[tuple[str, TensorEntry, torch.Tensor, torch.Tensor]] = []
    used = 0
    for path, part, out in pieces:
        nbytes = part.end - part.start
        if batch and used + nbytes > staging.numel():
            _cast_batch(reader, batch)
            batch, used = [], 0
        batch.append((path, part, out, staging[used : used + nbytes].view(part.dtype)))
        used += -(-nbytes // _ALIGN) * _ALIGN
    _cast_batch(reader, batch)
    return values


def _cast_batch(reader: TensorReader, batch: list[tuple[str, TensorEntry, torch.Tensor, torch.Tensor]]) -> None:
    reader.read([(path, part, buffer) for path, part, _, buffer in batch])
    for _, _, out, buffer in batch:
        out.copy_(buffer)  # casts, rounding as .to() does


def _holds_its_values(t: torch.Tensor) -> bool:
    """``t``'s memory holds its values in order: a file's bytes can be read straight into it (a
    conjugate or negative view's memory holds the values before the lazy conjugation)."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


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
    check_path(path, "load_checkpoint(path, model=...)")
    check_model(model, "load_checkpoint(path, model=...)")
    check_optimizer(optimizer, "load_checkpoint(path, model=..., optimizer=...)")
    model = unwrap(model)  # the names a DDP or torch.compile wrapper prefixes are its module's
    return reading_again(lambda: _read_training_checkpoint(path, model, optimizer, dtype, readers))


def _read_training_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    dtype: DtypePolicy,
    readers: Mapping[str, Reader] | None,
) -> dict[str, Any]:
    source = open_source(path, (CHECKPOINT_NAME,))
    record = training_record(source)
    staged = stage(model, source, strict=True, device=None, dtype=dtype)
    # The optimizer's state (twice the model for Adam) is read only for an optimizer; a sharded
    # parameter's state only as this rank's rows of it.
    wanted = {k: v for k, v in source.side.items() if optimizer is not None or not k.startswith("optimizer/")}
    rows = sharded_state_rows(record.get("optimizer"), model, staged) if optimizer is not None else {}
    rows = {k: r for k, r in rows.items() if k in wanted and wanted[k][1].shape == tuple(r[0].shape)}
    tensors = read_tensors(
        {k: (path, e.rows(*rows[k][1:]) if k in rows else e) for k, (path, e) in wanted.items()}, source.files
    )
    tensors.update((k, dtensor_from_rows(param, tensors[k])) for k, (param, _, _) in rows.items())
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
