"""`save_sharded`: torch.distributed.checkpoint with one copy per tie group, committed by a marker.

Protocol (every rank calls it, in the same order):

1. the ranks agree on the folder (the same absolute path everywhere) and on a save id made by
   rank 0, and check that every rank could build its state (a failure anywhere is raised on
   every rank before DCP starts, so no rank is left waiting in a DCP collective) and that the
   ranks' states agree on names, shapes, dtypes and ties (`tiekit.agreement`);
2. DCP writes ``<folder>/save-<id>/`` (each rank its shards, rank 0 DCP's ``.metadata``);
3. rank 0 writes ``tiekit-dcp.json`` (file sizes, the metadata's SHA-256, the plan) to a work
   file and renames it over the previous marker: the commit. Older save folders go afterwards.

A process killed before step 3 leaves the previous marker, hence the previous checkpoint; its
half-written ``save-<id>/`` is never named by a marker, and the next commit removes it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiekit.agreement import description, digest, disagreement
from tiekit.checkpoint.arguments import check_model, check_optimizer, check_path
from tiekit.checkpoint.deferred import DeferredCopies, deferrable_storages
from tiekit.checkpoint.handle import SaveHandle, after_earlier_saves, register_pending
from tiekit.checkpoint.layout import PathLike
from tiekit.collective import collective_gather, ranks
from tiekit.dcp.background import background_writer
from tiekit.dcp.layout import SAVE_PREFIX, committed_save_id, new_save_id, remove_stale, write_marker
from tiekit.dcp.ranks import (
    distributed,
    extra_keys,
    folder_names,
    process_group_needed,
    raise_anywhere,
    rank,
    refuse_different_folders,
    refuse_different_options,
    world,
)
from tiekit.dcp.replay import collective_write_copies, recipe_for
from tiekit.dcp.staging import host_copies, optimizer_entries
from tiekit.dcp.state import SaveState, dcp_save, running_dcp, save_state, xla_spmd
from tiekit.errors import CheckpointError, TieError, TiekitError
from tiekit.sharding.check import refuse_split_model_ties
from tiekit.wrappers import unwrap


def save_sharded(
    model: nn.Module,
    path: PathLike,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
    blocking: bool = True,
) -> SaveHandle:
    """Collective: every rank calls it with the same ``path``. Save ``model`` (plain, DDP-wrapped,
    FSDP2-sharded by `tiekit.shard`, or XLA SPMD-sharded: torch_xla's SPMD planner writes each
    device's shard), ``optimizer``'s state and ``extra`` as a torch.distributed.checkpoint folder
    holding one copy per tie group, and commit it.

    Each rank writes its own shards (replicated tensors once in all); rank 0 commits by
    writing ``tiekit-dcp.json`` last, so the previous checkpoint in ``path`` stays the one
    loaded until the new one is complete. Optimizer state is stored under each tie group's source
    name; ``extra`` may hold tensors, numbers, strings, None and lists/dicts of them (no pickle).
    Works in a single process without a process group.

    A model whose tie FSDP2 units split (your own ``fully_shard`` calls putting its owners in
    different units, which torch before 2.13 accepts) is refused with a `CheckpointError` carrying
    `check_sharding`'s message, on every rank, before anything is written, as `load_sharded`
    refuses to load into it: saved, the tied names would be two tensors (trained apart) that no
    model loads.

    ``blocking=False`` copies the state to host memory (XLA SPMD: each device's shard), then
    returns at once: training may continue while one background thread of the process writes the
    copy with DCP, its collectives on a separate gloo group (as DCP's ``async_save`` does). The
    returned `SaveHandle` tells when it is done; a later save into the same folder waits for it.
    With ``blocking=True`` the handle is already done and the checkpoint committed on every rank.
    """
    return save_sharded_staged(model, path, optimizer=optimizer, extra=extra, blocking=blocking)[0]


def save_sharded_staged(
    model: nn.Module,
    path: PathLike,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
    blocking: bool = True,
    staging: Mapping[str, torch.Tensor] | None = None,
    defer: bool = False,
    adopt: bool = False,
) -> tuple[SaveHandle, dict[str, torch.Tensor], DeferredCopies | None]:
    """Collective: `save_sharded`, the host copies a background save writes, and the copies it
    left to its writer.

    With ``blocking=False``, ``staging`` (what an earlier call returned, its write finished) is
    copied into where a name's layout matches instead of new memory. ``defer``: the copies of the
    parameters and the optimizer state are made by the writing thread, beside training; the
    caller must call the returned `DeferredCopies`' ``settle()`` before anything changes them (its
    next optimizer step). A tensor written in between fails the save on every rank before it is
    committed, and its files are removed (`tiekit.checkpoint.deferred`). ``adopt`` (with
    ``defer``): ``settle()`` also moves the optimizer's state into its copies, in this rank's
    `ShardImage` (a plain tensor by ``.data``, a DTensor replaced in ``optimizer.state``), so that
    saves with the returned staging write it from there without a copy."""
    from tiekit.dcp.writer import DurableWriter  # DCP's file system: loaded by the first save, not by import

    check_path(path, "save_sharded(model, path)")
    check_model(model, "save_sharded(model, path)")
    root = Path(os.path.abspath(os.fspath(path)))
    needed = process_group_needed(ranks(), distributed(), "save_sharded", root)
    if needed is not None:
        raise needed
    key = after_earlier_saves(root, stacklevel=3)  # 3: the caller of save_sharded
    inner = unwrap(model)
    writes_marker = rank() == 0
    before = committed_save_id(root) if writes_marker else None  # what the commit may replace
    save_id, state, layout, made = _prepare(inner, root, optimizer, extra, blocking)
    folder = root / f"{SAVE_PREFIX}{save_id}"
    remove_failed = functools.partial(remove_failed_save, folder, made)
    # DCP coordinates through the process group only where there are ranks to coordinate: with
    # one, its gathers and scatters would only pickle the plans and hand them to gloo and back.
    coordinated = distributed() and world() > 1
    spmd = xla_spmd(state.tensors.values())
    planner = _spmd_planner() if spmd else None
    if blocking:
        error = None
        try:
            tensors = _spmd_writable(state.tensors) if spmd else state.tensors
            with running_dcp(folder, reading=False):
                dcp_save(tensors, storage_writer=DurableWriter(folder), planner=planner, no_dist=not coordinated)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            conflict = _writer_conflict(root, save_id, before, exc) if writes_marker else None
            error = conflict or exc
        if writes_marker and error is None:
            try:
                _commit(root, save_id, state, before)
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = exc
        # Rank 0 tells whether its marker names this save despite an error (a commit that failed
        # after its rename); every rank then removes its own part of a save that failed anywhere.
        committed = writes_marker and error is not None and committed_save_id(root) == save_id
        raise_anywhere(
            error,
            f"{root}: save {save_id}",
            share=committed,
            on_failure=lambda shares: None if any(shares) else remove_failed(),
        )
        return SaveHandle(root, save_id, None), {}, None
    group = _async_group() if coordinated else None
    copies: DeferredCopies | None = None
    if spmd:
        from tiekit.backends.xla_spmd import spmd_host_copy

        hosts = spmd_host_copy(state.tensors)  # each device's shard (a copy of the whole would not fit)
    else:
        deferrable = deferrable_storages(inner, optimizer) if defer else None
        entries = optimizer_entries(optimizer) if defer and adopt and optimizer is not None else None
        hosts, copies = host_copies(state.tensors, staging, deferrable, entries)
    # The copies are made in DCP's planning step, written, then checked against the training
    # thread's `settle` before this rank reports its write: a torn copy fails the save on every rank.
    recipe = None if spmd else recipe_for(hosts, getattr(staging, "recipe", None), layout, world())
    writer = DurableWriter(
        folder,
        None if copies is None else copies.copy,
        getattr(hosts, "image", None),
        lent=None if copies is None else copies.lent,
        confirm=None if copies is None else functools.partial(copies.confirmed, folder),
    )

    def write() -> None:
        destroyed = (
            f"{folder}: the process group was destroyed while this background save was under way; wait for "
            "its handle (handle.wait()) before destroy_process_group() (a load takes the last save the "
            "folder's marker names)"
        )
        # DCP over a destroyed group does not fail cleanly (torch 2.14 ran on and had both ranks
        # write the metadata), so a save whose group is gone does not start.
        if coordinated and not torch.distributed.is_initialized():
            raise CheckpointError(destroyed)
        try:
            with running_dcp(folder, reading=False):
                collective_write_copies((save_id, layout), hosts, writer, recipe, planner, group, coordinated)
        except Exception as exc:
            # DCP raised on every rank (it hands each rank every rank's failure), after all of them
            # stopped writing: each removes its own part of the folder.
            remove_failed()
            if coordinated and not torch.distributed.is_initialized():
                raise CheckpointError(f"{destroyed}: {type(exc).__name__}: {exc}") from exc
            if writes_marker and (conflict := _writer_conflict(root, save_id, before, exc)):
                raise conflict from exc
            raise
        finally:
            if copies is not None and copies.lent is not None:
                copies.lent.close()  # written or failed: the training thread takes nothing aside

    future = background_writer().submit(write)
    commit = functools.partial(_commit_or_remove, root, save_id, state, before, made) if writes_marker else None
    handle = SaveHandle(root, save_id, future, commit)
    register_pending(root, handle, key)
    return handle, hosts, copies


def _spmd_writable(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    from tiekit.backends.xla_spmd import spmd_writable

    return spmd_writable(tensors)


def _spmd_planner() -> Any:
    from tiekit.backends.xla_spmd import spmd_save_planner

    return spmd_save_planner()


def _prepare(
    model: nn.Module, root: Path, optimizer: Any, extra: Any, blocking: bool
) -> tuple[str, SaveState, str, bool]:
    """Collective: agree on the folder, the call's options and the save id; build this rank's
    state; fail everywhere if any rank failed. The save id, the state, the digest of its
    description (every name's shape and dtype, the plan: the same on every rank), and whether
    this rank made the folder."""
    # One gather for all (each costs a round trip of every rank): the folders, what must be alike,
    # and rank 0's id.
    options = {"blocking": blocking, "extra's keys": extra_keys(extra)}
    found = collective_gather(
        (folder_names(root), options, new_save_id() if rank() == 0 else None), operation="save_sharded"
    )
    refuse_different_folders([p for p, _, _ in found], "save_sharded")
    refuse_different_options(root, [o for _, o, _ in found])
    save_id = str(found[0][2])
    state: SaveState | None = None
    error: Exception | None = None
    made = False
    try:
        check_optimizer(optimizer, "save_sharded(model, path, optimizer=...)")
        _refuse_split_ties(model, root)
        state = save_state(model, optimizer, extra)  # first: what cannot be stored leaves no folder behind
        if rank() == 0:
            made = not root.exists()
            root.mkdir(parents=True, exist_ok=True)
        if xla_spmd(state.tensors.values()):
            from tiekit.backends.xla_spmd import spmd_settle

            spmd_settle()  # torch_xla's planner reads device data: pending steps run first
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        error = exc
    side = None if state is None else description(state.plan, state.record["tensors"])
    digests = raise_anywhere(error, f"{root}: save {save_id}", share=None if side is None else digest(side))
    assert state is not None
    if len(set(digests)) > 1:  # every rank sees it: all take part in the gather below
        differences = disagreement(collective_gather(side))
        if made:
            with contextlib.suppress(OSError):
                root.rmdir()  # only if still empty: the folder this save made, nothing else
        raise CheckpointError(
            f"{root}: save {save_id}: the ranks hold different models (or optimizer states, or extra tensors), "
            "so no checkpoint describes them all: "
            f"{differences}. Nothing was written; the previous checkpoint stays the one loaded."
        )
    return save_id, state, digests[0], made


def _refuse_split_ties(model: nn.Module, root: Path) -> None:
    """`CheckpointError` with `check_sharding`'s message, as `load_sharded` gives it for the same
    model, when FSDP2 units split one of the model's ties (`refuse_split_model_ties`; fully_shard
    accepts such units before torch 2.13). Saved, the tied names would be two tensors (trained
    apart) that no model loads, not even the one that saved them. Local and alike on every rank:
    it reads module paths."""
    try:
        refuse_split_model_ties(model)
    except TieError as exc:
        raise CheckpointError(f"{root}: cannot save {type(model).__name__}: {exc}") from exc


def _commit(root: Path, save_id: str, state: SaveState | None, before: str | None) -> None:
    """Publish the save (rank 0), unless another writer committed into the folder since it began
    (``before``: the save committed then): replacing theirs would remove their save's files, and
    they may remove this one's; two writers in one folder lose each other's saves."""
    assert state is not None
    folder = root / f"{SAVE_PREFIX}{save_id}"
    conflict = _writer_conflict(root, save_id, before)
    if conflict is not None:
        raise conflict
    record = dict(state.record)
    record["world_size"] = world()
    record["torch"] = torch.__version__
    write_marker(root, folder, save_id, state.plan, record)
    remove_stale(root, keep=folder.name)


def _commit_or_remove(root: Path, save_id: str, state: SaveState | None, before: str | None, made: bool) -> None:
    """`_commit` of a background save (rank 0, on the writing thread); a commit that fails takes
    the save's folder with it, unless the marker names it already (a failure after the rename).
    The other ranks have finished by then: on a shared filesystem their parts go with it."""
    try:
        _commit(root, save_id, state, before)
    except BaseException:
        if committed_save_id(root) != save_id:
            remove_failed_save(root / f"{SAVE_PREFIX}{save_id}", made)
        raise


def remove_failed_save(folder: Path, made_parent: bool = False) -> None:
    """Local, best effort: remove the folder of a save that failed, this process's view of it (on
    hosts without a shared filesystem, each rank's own part). Left behind, it would hold the
    space a retry needs (a full disk stays full) until the next commit. Only this save's own
    folder: its id is new, no marker names it. ``made_parent``: the save made the checkpoint
    folder too, which goes if nothing else is in it (a failed first save leaves no empty folder)."""
    shutil.rmtree(folder, ignore_errors=True)
    if made_parent:
        with contextlib.suppress(OSError):
            folder.parent.rmdir()  # only if empty: another rank's part may still be going


def _writer_conflict(
    root: Path, save_id: str, before: str | None, failure: BaseException | None = None
) -> CheckpointError | None:
    """On the rank writing the marker: the error to give when another writer committed into
    ``root`` since this save began (``before``: the save committed then; a failure of the save's
    own writing is then theirs too: their commit removed this save's folder), else None. A marker
    gone (or made unreadable) meanwhile is no one's commit: a commit replaces the marker whole, it
    never removes it; the save is then committed, the folder's checkpoint again."""
    now = committed_save_id(root)
    if now == before or now is None:
        return None
    told = "" if failure is None else f" (this save's writing failed: {type(failure).__name__}: {failure})"
    return CheckpointError(
        f"{root}: save {now} was committed into this folder by another writer while save {save_id} was written"
        f"{told}; not committed (save {now} stays the checkpoint). Give each run its own folder."
    )


# The background saves' group of each live default group, held no longer than that group: a
# destroyed group kept alive here would be destroyed only at interpreter exit, where gloo can
# abort the process (its threads outliving the interpreter, pytorch/pytorch#179291), and a new
# default group at a recycled address must not find it (a dict keyed by id() did both).
_groups: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _async_group() -> Any:
    """A gloo group of all ranks for background saves, so their collectives never interleave with
    training's on the default group. Made once per default group (creating it is collective: every
    rank is in save_sharded here)."""
    dist = torch.distributed
    default = dist.group.WORLD
    if default not in _groups:
        try:
            _groups[default] = dist.new_group(backend="gloo")
        except RuntimeError as exc:
            raise TiekitError(f"save_sharded(blocking=False) needs a gloo process group for its writes: {exc}") from exc
    return _groups[default]
