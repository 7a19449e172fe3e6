"""`load_sharded`: validate everything (marker, files, DCP metadata, plan against the model), then
let DCP read into destinations shaped like the live model, then re-tie.

Order: every rank validates on its own and the ranks compare outcomes before the first DCP
collective (an error on one rank is raised on all, none waits); the optimizer state and
``extra`` are read next into new tensors and checked against the optimizer; only then are the
model's weights read (in place for real tensors, into new tensors for meta ones) and re-tied.
Whole tensors larger than a staging buffer (plain ones on the CPU, a meta model's new CPU ones,
those of a model on XLA not SPMD-sharded) are streamed from the shard files in place in pieces
(`tiekit.checkpoint.streaming`), the rest through DCP.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiekit import devices
from tiekit.backends.torch_distributed import is_dtensor
from tiekit.checkpoint.arguments import check_model, check_optimizer, check_path
from tiekit.checkpoint.codec import decode
from tiekit.checkpoint.layout import PathLike, name_list
from tiekit.checkpoint.loading import LoadResult
from tiekit.checkpoint.optimizer import stage_optimizer
from tiekit.checkpoint.reads import READ_ATTEMPTS, TensorReader
from tiekit.checkpoint.source import Source
from tiekit.checkpoint.staging import Staged, give_extra_states, stage
from tiekit.checkpoint.streaming import STAGING_BYTES, RowPart, stream_rows_in_place
from tiekit.collective import collective_gather, ranks
from tiekit.dcp.chunks import Rows, locate_rows, row_chunks
from tiekit.dcp.damage import Region, damaged_structure
from tiekit.dcp.layout import Marker, committed_save_id, read_marker
from tiekit.dcp.ranks import distributed, folder_names, process_group_needed, raise_anywhere, refuse_different_folders
from tiekit.dcp.records import as_source, dcp_load, save_metadata
from tiekit.dcp.state import destination, parameters_by_name, xla_spmd
from tiekit.errors import CheckpointError
from tiekit.plan import TiePlan
from tiekit.retie import retie
from tiekit.slots import assign, resolve, slot_table
from tiekit.wrappers import unwrap


@dataclass(frozen=True)
class ShardedLoadResult(LoadResult):
    """A `LoadResult` plus what `save_sharded` stored beside the model: ``extra`` and the save id."""

    extra: Any = None
    save_id: str = ""


class _Replaced(Exception):
    """The save being read is no longer the folder's (raised alike on every rank); ``found``: the
    save each rank found committed, when they differed."""

    def __init__(self, message: str, found: list[str | None] | None = None) -> None:
        super().__init__(message)
        self.found = found


@dataclass(frozen=True)
class _Read:
    """What a load read, before the model takes it."""

    marker: Marker
    staged: Staged
    fresh: dict[int, torch.Tensor]
    extra: Any
    restore: Callable[[], None] | None
    extra_states: dict[str, torch.Tensor]


def load_sharded(
    model: nn.Module, path: PathLike, *, optimizer: torch.optim.Optimizer | None = None
) -> ShardedLoadResult:
    """Collective: every rank calls it with the same ``path``, and an ``optimizer`` on every rank or
    on none (else `CheckpointError` on every rank, nothing loaded). Load a `save_sharded` checkpoint into
    ``model`` (plain, DDP-wrapped, FSDP2-sharded, XLA SPMD-sharded, or on the meta device) and
    ``optimizer``. An XLA SPMD model is read in place by torch_xla's SPMD planner: each tied
    parameter stays one XLA tensor with its sharding.

    Any number of ranks can load what any number saved (DCP reshards: a DTensor gets this rank's
    rows, a plain tensor the whole value), and a single process needs no process group. Ties are
    restored from the checkpoint's plan; the optimizer gets its state back by parameter name.
    Everything is validated before the model changes: a missing or truncated shard file, a record
    damaged in place (its zip directory, pickle or data header, as far as ``torch.load`` checks
    them), DCP metadata of another save,
    keys, shapes or a plan that does not fit the model raise
    `CheckpointError` naming the file and key, on every rank, with the model untouched (an I/O
    error in the middle of reading into the model's own memory is the one exception).

    Every rank reads the same save. A folder another process commits a new save into while it is
    read (an evaluator beside training) is read again from the new save, on every rank (at most
    ``READ_ATTEMPTS`` times, `tiekit.checkpoint.reads`), rather than failing on the old save's
    removed files.
    """
    check_path(path, "load_sharded(model, path)")
    check_model(model, "load_sharded(model, path)")
    root = Path(os.path.abspath(os.fspath(path)))
    needed = process_group_needed(ranks(), distributed(), "load_sharded", root, "The model is untouched")
    if needed is not None:
        raise needed
    inner = unwrap(model)
    replaced: Exception | None = None
    for _ in range(READ_ATTEMPTS):
        reading: list[str | None] = []  # the save the marker named when this attempt read it
        try:
            read = _read(inner, root, optimizer, reading)
        except _Replaced as exc:
            if exc.found is not None and isinstance(replaced, _Replaced) and replaced.found == exc.found:
                raise CheckpointError(_different_folders(root, exc.found)) from None
            replaced = exc
            continue
        except CheckpointError as exc:  # raised alike on every rank: so is the question below
            if not _collective_replaced(root, reading):
                raise
            replaced = exc
            continue
        devices.sync()  # XLA: the last tensors' copies, before the model is used
        _commit(inner, read.staged, read.fresh)
        if read.restore is not None:
            read.restore()
        give_extra_states(inner, read.extra_states, os.fspath(read.marker.folder))
        staged = read.staged
        return ShardedLoadResult(
            staged.missing, staged.unexpected, staged.groups, "tiekit", read.extra, read.marker.save_id
        )
    raise CheckpointError(
        f"{root}: replaced by a newer save {READ_ATTEMPTS} times while it was being read (saves committed "
        f"faster than this load reads them); the last time: {replaced}"
    )


def _different_folders(root: Path, found: list[str | None]) -> str:
    """The ranks found the same different saves twice: nothing is committing, their folders differ."""
    shown = "; ".join(f"rank {rank}: save {save}" for rank, save in enumerate(found[:8]))
    return (
        f"{root}: the ranks hold different checkpoints at this path ({shown}), the same on a second look, so no "
        "save is replacing it: the path is not one folder for every rank (node-local storage?). Load from "
        "storage every rank shares, or copy one checkpoint to every node (nothing was loaded)"
    )


def _refuse_some_optimizers(root: Path, passed: list[bool]) -> None:
    """`CheckpointError` unless every rank passed an optimizer or none did (as gathered, in rank
    order): the optimizer's state is read collectively, by those ranks only, so the others would
    never join and the readers would wait for them until the process group's timeout. Local."""
    if len(set(passed)) > 1:
        with_optimizer = ", ".join(str(rank) for rank, p in enumerate(passed) if p)
        raise CheckpointError(
            f"{root}: load_sharded was given an optimizer on rank(s) {with_optimizer} only: pass one on every "
            "rank or on none (nothing was loaded)"
        )


def _read(inner: nn.Module, root: Path, optimizer: torch.optim.Optimizer | None, reading: list[str | None]) -> _Read:
    """Collective: one attempt of `load_sharded`, up to the model taking what was read (its
    weights read in place, or into the new tensors of a meta model). Appends to ``reading`` the save
    id the marker names (before it is validated); `_Replaced` on every rank if the ranks found
    different saves committed."""
    error: Exception | None = None
    marker = source = staged = metadata = None
    side: dict[str, torch.Tensor] = {}
    try:
        # What the marker names before it is validated: a marker naming a folder a newer commit has
        # removed fails to validate, and that failure is a replacement only if the marker changed.
        reading.append(committed_save_id(root))
        marker = read_marker(root)
        reading[0] = marker.save_id
        # Here, not first: a failure before the save read is known would be taken for a save replaced under the load.
        check_optimizer(optimizer, "load_sharded(model, path, optimizer=...)")
        metadata = save_metadata(marker)
        source = as_source(marker, metadata)
        try:
            staged = stage(inner, source, strict=True, device=None, dtype="model")
        except CheckpointError as exc:  # load_sharded is always strict: drop the loader's strict=False hint
            raise CheckpointError(str(exc).replace(" (load with strict=False to accept)", "")) from exc
        if optimizer is not None and not marker.record.get("optimizer"):
            raise CheckpointError(f"{marker.where}: key 'optimizer': this checkpoint holds no optimizer state")
        side = _side_destinations(inner, marker, with_optimizer=optimizer is not None)
        # Modules' extra state (get_extra_state) read with extra, into new CPU tensors of the stored dtype.
        side.update((k, torch.empty(source.entries[k][1].shape, dtype=_dtype(marker, k))) for k in staged.extra_states)
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    share = (folder_names(root), reading[0] if reading else None, optimizer is not None)
    shared = raise_anywhere(error, f"{root}: load", share=share, operation="load_sharded")
    refuse_different_folders([p for p, _, _ in shared], "load_sharded")
    _refuse_some_optimizers(root, [o for _, _, o in shared])
    found = [s for _, s, _ in shared]
    if len(set(found)) > 1:  # a commit between two ranks' reads of the marker
        raise _Replaced(f"{root}: the ranks found different saves committed ({', '.join(map(str, found))})", found)
    assert marker is not None and source is not None and staged is not None
    single = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    if side:
        planner = _spmd_planner() if xla_spmd(side.values()) else None
        dcp_load(side, marker.folder, metadata, planner, single)
    restore: Callable[[], None] | None = None
    reader = TensorReader({})  # the streamed shard files, held open from their check to their read
    try:
        extra = decode(marker.record.get("extra"), side, marker.where)
        if optimizer is not None:
            restore = stage_optimizer(optimizer, inner, staged, marker.record["optimizer"], side, marker.where)
        targets, fresh = _model_destinations(inner, staged, source)
        spmd = xla_spmd(targets.values())
        wanted, dtypes = ({}, {}) if spmd else _streamed_rows(targets, metadata)
        # DCP reads record after record into the model's own tensors: a damaged one must be found
        # before the first, or the records before it would stay loaded. A streamed record is read
        # at the offset its data header gives, trusted unchecked (a damaged one would load other
        # bytes), and into a new tensor too: checked as well.
        new = {id(tensor) for tensor in fresh.values()}
        checked = {key: _read_regions(t) for key, t in targets.items() if key in wanted or id(t) not in new}
        damaged = damaged_structure(marker.folder, metadata, checked)
        if damaged is not None:
            raise damaged
        streamed, identities = locate_rows(marker.folder, wanted, dtypes) if wanted else ({}, {})
        # The offsets hold for the files located only: each is opened and checked now, before DCP
        # writes into the model, and read through that descriptor, whatever replaces it after.
        reader = TensorReader(identities)
        reader.open({path for rows in streamed.values() for path, _, _ in rows})
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    with reader:
        raise_anywhere(error, f"{root}: load")
        planner = _spmd_planner() if spmd else _weights_planner(targets.values())
        rest = {key: tensor for key, tensor in targets.items() if key not in streamed}
        dcp_load(rest, marker.folder, metadata, planner, single)  # every rank calls it, whatever it streams itself
        try:
            if streamed:
                parts = [
                    RowPart(targets[key], path, entry, first)
                    for key, rows in streamed.items()
                    for path, entry, first in rows
                ]
                stream_rows_in_place(parts, identities, reader)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
    raise_anywhere(error, f"{root}: load")  # what one rank streams, others may not: all learn of a failure
    extra_states = {k: side[k] for k in staged.extra_states}
    return _Read(marker, staged, fresh, extra, restore, extra_states)


def _read_regions(tensor: torch.Tensor) -> list[Region] | None:
    """The regions of ``tensor`` this rank reads: a DTensor's local shard (DCP's chunk protocol,
    ``__create_chunk_list__``), else the whole tensor (None)."""
    if not is_dtensor(tensor):
        return None
    return [(tuple(c.offsets), tuple(c.sizes)) for c in tensor.__create_chunk_list__()]  # type: ignore[attr-defined]


def _collective_replaced(root: Path, reading: list[str | None]) -> bool:
    """Collective: whether every rank now finds one save committed in ``root`` that some rank was
    not reading (so the load may have failed on a save replaced under it: worth another attempt).
    A failure while every rank read the save still committed is the checkpoint's own."""
    seen = collective_gather((reading[0] if reading else None, committed_save_id(root)))
    current = {now for _, now in seen}
    return len(current) == 1 and None not in current and any(was not in current for was, _ in seen)


def _spmd_planner() -> Any:
    """torch_xla's SPMD planner, for a model of XLA SPMD tensors: it reads each device's rows into
    the live sharded tensor in place, so ties (one tensor per group) and shardings stay."""
    from tiekit.backends.xla_spmd import spmd_load_planner, spmd_settle

    spmd_settle()  # the planner reads and replaces device data: pending steps run first
    return spmd_load_planner()


def _weights_planner(targets: Iterable[torch.Tensor]) -> Any:
    """DCP's default planner, for tensors on the CPU; for tensors on a lazy device (XLA), one that
    runs the pending copies every `STAGING_BYTES`. DCP copies each value it reads into its
    destination; on XLA the copy is pending work that holds both the value sent and the buffer it
    replaces until the graph runs, so a load left to run at the end holds the model twice
    (GPT-2 with 8 layers onto XLA:CPU: peak RSS grew 1.26x the checkpoint)."""
    if all(t.device.type == "cpu" for t in targets):
        return None
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Syncing(DefaultLoadPlanner):
        pending = 0

        def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
            super().commit_tensor(read_item, tensor)
            self.pending += tensor.numel() * tensor.element_size()
            if self.pending >= STAGING_BYTES:
                devices.sync()
                devices.release_freed_memory()  # the replaced buffers, back to the OS (see there)
                self.pending = 0

    return Syncing()


def _streamed_rows(targets: Mapping[str, torch.Tensor], metadata: Any) -> tuple[Rows, dict[str, torch.dtype]]:
    """Where the chunks are (`row_chunks`), and the stored dtype, of each whole tensor (not a
    DTensor, nor XLA SPMD-sharded) larger than a staging buffer, for those stored as rows: streamed
    from the shard files into their destination in pieces (`tiekit.checkpoint.streaming`, which
    casts to the destination's dtype) rather than read through DCP.

    DCP's reader ``torch.load``s each record whole before copying it into the destination: on
    the CPU (a model there, or a meta model's new tensors) the load holds the largest tensor twice
    (a 1000 MiB embedding: 1000 MiB more); on a device (XLA) such a tensor would exist whole on
    the host, then in torch_xla's copy and as a new device buffer beside the old one. Streamed,
    it is read straight into a CPU destination of the file's dtype, else through two staging
    buffers. Smaller ones cost DCP little, and locating each costs a ``torch.load`` of its
    record's metadata."""
    wanted = {
        key: tensor
        for key, tensor in targets.items()
        if tensor.device.type != "meta"
        and type(tensor) is torch.Tensor
        and tensor.numel() * tensor.element_size() > _streamed_from(tensor.device)
    }
    if not wanted:
        return {}, {}
    stored = metadata.state_dict_metadata
    places = {
        key: rows
        for key, rows in row_chunks(metadata).items()
        if key in wanted and tuple(stored[key].size) == tuple(wanted[key].shape)
    }
    return places, {key: stored[key].properties.dtype for key in places}


def _streamed_from(device: torch.device) -> int:
    """The size above which a tensor bound for ``device`` (the CPU included) is streamed rather than
    read through DCP: a staging buffer (smaller ones cost DCP little); every tensor on a device
    that takes over host memory (XLA:CPU), which then holds it where it was read, with no transfer."""
    return 0 if devices.adopts_host_memory(device) else STAGING_BYTES


def _side_destinations(model: nn.Module, marker: Marker, *, with_optimizer: bool) -> dict[str, torch.Tensor]:
    """New tensors for ``extra`` (always) and optimizer state (when loading it): an optimizer
    state tensor shaped like its DTensor parameter is sharded like it, so it reshards too."""
    parameters = parameters_by_name(model)
    out: dict[str, torch.Tensor] = {}
    for key, (shape, _) in marker.tensors.items():
        if key.startswith("extra/") or (with_optimizer and key.startswith("optimizer/")):
            like = None
            if key.startswith("optimizer/state/"):
                owner = key.removeprefix("optimizer/state/").rsplit("/", 1)[0]
                like = parameters.get(owner)
            dtype = _dtype(marker, key)
            out[key] = destination(like, shape, dtype)
    return out


def _dtype(marker: Marker, key: str) -> torch.dtype:
    value = getattr(torch, marker.tensors[key][1], None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"{marker.where}: key {key!r} has dtype {marker.tensors[key][1]!r}, unknown here")
    return value


def _model_destinations(
    model: nn.Module, staged: Staged, source: Source
) -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor]]:
    """{key: tensor DCP reads into} and {id(old meta tensor): its new tensor}. Real tensors are
    read in place (DCP's copy casts to their dtype); meta ones get a new CPU tensor each."""
    targets: dict[str, torch.Tensor] = {}
    fresh: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    for name, key in staged.loads:
        tensor = resolve(model, name)[2]
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if tensor.is_meta:
            if type(tensor).__name__ == "DTensor":
                raise CheckpointError(
                    f"{source.where}: {name!r} is a sharded meta tensor; materialize the model first "
                    "(with tiekit.preserve_ties(model): model.to_empty(device=...)), then load"
                )
            new = torch.empty(source.entries[key][1].shape, dtype=tensor.dtype)
            fresh[id(tensor)] = new
            targets[key] = new
        else:
            targets[key] = tensor.detach()
    unused = sorted(set(source.entries) - set(targets) - set(staged.unexpected))
    if unused and not staged.loads:
        raise CheckpointError(f"{source.where}: nothing of the model matches keys {name_list(unused)}")
    return targets, fresh


def _commit(model: nn.Module, staged: Staged, fresh: Mapping[int, torch.Tensor]) -> None:
    """Put new tensors in their slots (meta models), then point every tied name at its source."""
    if fresh:
        with torch.no_grad():
            for module, attr, tensor, kind in slot_table(model).values():
                new = fresh.get(id(tensor))
                if new is None:
                    continue
                if kind == "parameter" and not isinstance(new, nn.Parameter):
                    new = nn.Parameter(new, requires_grad=tensor.requires_grad)
                    fresh = {**fresh, id(tensor): new}
                assign(module, attr, new, kind)
    retie(model, TiePlan(staged.groups, 0, 0))
