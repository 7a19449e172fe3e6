"""Saving tied checkpoints: the weights file, training checkpoints, and background saves that copy
the state beside the next step (what a file stores is `tiekit.checkpoint.contents`)."""

from __future__ import annotations

import functools
import json
import operator
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiekit.backends.torch_distributed import is_dtensor
from tiekit.checkpoint.arguments import check_model, check_optimizer, check_path
from tiekit.checkpoint.codec import Fallback
from tiekit.checkpoint.contents import encode_training_state, header_metadata, host_tensors, saving_plan, unique_tensors
from tiekit.checkpoint.deferred import DeferredCopies, deferrable_storages, into_image
from tiekit.checkpoint.files import write_sharded, write_single
from tiekit.checkpoint.handle import SaveHandle, after_earlier_saves, register_pending, report_failed_saves
from tiekit.checkpoint.image import FileImage, LentMemory, image_for
from tiekit.checkpoint.layout import (
    CHECKPOINT_NAME,
    STATE_KEY,
    STATE_VERSION,
    WEIGHTS_NAME,
    PathLike,
    nbytes,
    parse_size,
    target_path,
)
from tiekit.errors import CheckpointError
from tiekit.wrappers import unwrap


def save_model(
    model: nn.Module,
    path: PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
    max_shard_size: int | str | None = None,
    durable: bool = True,
) -> None:
    """Save ``model``'s weights to a safetensors file, one tensor per tie group, with its `TiePlan`.

    ``path`` is a file (``.../model.safetensors``) or a folder (``model.safetensors`` inside
    it). With ``max_shard_size`` (bytes, or a string like ``"2GB"``/``"500MiB"``) a model
    larger than that is written as Hugging Face style shards plus ``<name>.index.json``.
    XLA tensors cross to the host in one batched transfer. Local: it writes in the calling
    process and never waits for other ranks (with several, call it on one rank, or every rank
    calls `tiekit.collective_save_model`).

    The file appears whole or not at all (written aside, then renamed). ``durable=True`` also
    fsyncs it before the rename, so it survives a power loss; ``durable=False`` skips that wait
    for the disk (safetensors' own guarantee) and stays safe against a killed process.

    A background `save_checkpoint` of the same file still under way in this process is waited
    for first, so this save is the one left in the file (its failure, if nothing waited for it,
    is a ``RuntimeWarning`` here).
    """
    check_path(path, "save_model(model, path)")
    check_model(model, "save_model(model, path)")
    target = target_path(path, WEIGHTS_NAME)
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    model = unwrap(model)  # a DDP or torch.compile wrapper's names would prefix every key
    plan = saving_plan(model)
    names, tensors = unique_tensors(model, plan)
    _refuse_sharded(model, dict(zip(names, tensors, strict=True)))
    header = header_metadata(metadata, plan, "tiekit.save_model(model, path, metadata=...)")

    state = host_tensors(dict(zip(names, tensors, strict=True)))
    after_earlier_saves(target, stacklevel=2)
    if limit is None or sum(nbytes(t) for t in state.values()) <= limit:
        write_single(target, state, header, durable)
    else:
        write_sharded(target, state, header, plan, limit, durable)


def save_checkpoint(
    path: PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    step: int | None = None,
    extra: Any = None,
    durable: bool = True,
    blocking: bool = True,
) -> SaveHandle:
    """Save a training checkpoint: weights (one per tie group), optimizer state, step and ``extra``.

    The optimizer state is stored once per unique (tied) parameter, under the parameter's
    source name. ``extra`` may hold tensors, numbers, strings, None, and lists, tuples and
    string-keyed dicts of these (RNG states, data-loader positions...); nothing is pickled.
    ``durable`` as in `save_model`. Local, as `save_model`.

    ``blocking=False`` copies everything to host memory first, then writes in a background
    thread and returns at once: training may change the model meanwhile. The file appears whole
    when the returned `SaveHandle` is done (the previous one at ``path`` stays until then);
    background saves are written in call order and finished before the interpreter exits.

    The last save of a file wins: a blocking save (or `save_model`) of a file that a background
    save of this process is still writing, or has queued, waits for it first, then writes
    (a relative path or a symbolic link to the file is the same file); a background save is
    written after the earlier ones. The wait is local: this process's writer thread, no other
    rank. An earlier background save of the file that failed does not stop the later one: if
    nothing waited for its handle, the later save warns (``RuntimeWarning``, its error), and its
    handle's ``wait()`` still raises it.
    """
    return save_checkpoint_reusing(
        path, model=model, optimizer=optimizer, step=step, extra=extra, durable=durable, blocking=blocking
    )[0]


def save_checkpoint_reusing(
    path: PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    step: int | None = None,
    extra: Any = None,
    durable: bool = True,
    blocking: bool = True,
    staging: FileImage | None = None,
    defer: bool = False,
    adopt: bool = False,
) -> tuple[SaveHandle, FileImage | None, DeferredCopies | None]:
    """`save_checkpoint`, the `FileImage` a background save copied the state into (None when it
    did not need one), and the copies it left to its writer. With ``blocking=False``, ``staging``
    (what an earlier call returned, its write finished) is refilled where its layout matches
    instead of new memory: a training loop that saves in the background then stages every
    checkpoint into the same memory (fresh memory costs page faults in the step; measured 28 ms
    per 95 MB here), which is written to the file as it is (`tiekit.checkpoint.image`).

    ``defer`` (with ``blocking=False``): the host copies of the parameters and the optimizer
    state that live in host memory are made by the writing thread, not here; the caller must call
    the returned `DeferredCopies`' ``settle()`` before anything changes them (its next optimizer
    step), and the file is published only after that (`tiekit.checkpoint.deferred`).

    ``adopt`` (with ``defer``): ``settle()`` also moves those parameters and state tensors into
    the image (``.data``), so that from the next save into the same ``staging`` on, they are
    written from where they live, not copied: that save's ``settle()`` waits for the chunk being
    written and copies only the bytes not yet written aside. The model's parameters then live
    in the returned image until moved again. A later blocking save of the same file waits for
    this one, whose writer waits for ``settle()``: settle before it. Local."""
    target, state, header = stage_training_checkpoint(path, model=model, optimizer=optimizer, step=step, extra=extra)
    if blocking:
        after_earlier_saves(target, stacklevel=3)  # 3: the caller of save_checkpoint
        write_single(target, host_tensors(state), header, durable)
        return SaveHandle(target, "", None), None, None
    key = report_failed_saves(target, stacklevel=3)  # the unfinished ones are written before this one
    deferred = deferrable_storages(model, optimizer) if defer else {}
    image, copies = _background_copies(target, state, header, staging, deferred, adopt and defer)
    lent = copies.lent

    def write() -> None:
        try:
            copies.copy()
            write_single(target, image, header, durable, functools.partial(copies.confirmed, target), lent)
        finally:
            if lent is not None:
                lent.close()

    future = _background().submit(write)
    handle = SaveHandle(target, "", future)
    register_pending(target, handle, key)
    return handle, image if isinstance(image, FileImage) else None, copies


def write_training_checkpoint(
    path: PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int | None,
    extra: Any,
    durable: bool,
    fallback: Fallback | None = None,
) -> None:
    """`save_checkpoint`, with the codec's ``fallback`` for values it cannot store (the Lightning
    integration's opt-in pickling)."""
    target, state, header = stage_training_checkpoint(
        path, model=model, optimizer=optimizer, step=step, extra=extra, fallback=fallback
    )
    after_earlier_saves(target, stacklevel=2)
    write_single(target, host_tensors(state), header, durable)


def stage_training_checkpoint(
    path: PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int | None,
    extra: Any,
    fallback: Fallback | None = None,
) -> tuple[Path, dict[str, torch.Tensor], dict[str, str]]:
    """Where a training checkpoint goes, its tensors (the model's and optimizer's own, wherever
    they live) and its header."""
    check_path(path, "save_checkpoint(path, model=...)")
    check_model(model, "save_checkpoint(path, model=...)")
    check_optimizer(optimizer, "save_checkpoint(path, model=..., optimizer=...)")
    target = target_path(path, CHECKPOINT_NAME)
    values = {"step": (_step_number(step, target), "extra/step"), "extra": (extra, "extra/value")}
    model = unwrap(model)
    plan, state, encoded = encode_training_state(model, optimizer, values, fallback)
    _refuse_sharded(model, state)
    header = header_metadata(None, plan)
    header[STATE_KEY] = json.dumps({"version": STATE_VERSION, **encoded}, separators=(",", ":"))
    return target, state, header


def _refuse_sharded(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """A single-file save is local, and no rank holds a sharded (FSDP2) tensor whole: gathering
    it would wait for every rank. Refused before anything is written."""
    for name, tensor in state.items():
        if is_dtensor(tensor):
            raise CheckpointError(
                f"cannot save {type(model).__name__} to one file from one rank: {name!r} is sharded across "
                "ranks (an FSDP2 DTensor), so no rank holds it whole. Every rank calls tiekit.save_sharded "
                "instead (a folder; `tiekit convert` makes one tied safetensors file of it)"
            )


def _step_number(step: Any, target: Path) -> int | None:
    """``step`` as the int a checkpoint records (a NumPy or 0-d tensor integer too), or None."""
    if step is None:
        return None
    try:
        if isinstance(step, bool):
            raise TypeError
        return operator.index(step)
    except TypeError:
        raise CheckpointError(f"{target}: step must be an integer or None, not {type(step).__name__}") from None


def _background_copies(
    target: Path,
    state: dict[str, torch.Tensor],
    header: dict[str, str],
    staging: FileImage | None,
    deferred: Mapping[int, list[torch.Tensor]],
    adopt: bool = False,
) -> tuple[FileImage | dict[str, torch.Tensor], DeferredCopies]:
    """What a background save writes: a `FileImage` (``staging`` refilled where it fits) holding
    every tensor; and the copies left to the writer: the tensors whose storage is in ``deferred``,
    and the private host copies a transfer from a device made. When those private copies are most
    of the bytes (a model on an accelerator), they are written from where they are and only the
    rest is copied, here: an image would hold the state a second time in host memory. Tensors
    already living in the image (adopted by an earlier save) are not copied; ``adopt``: the
    deferred ones move into the image at ``settle()``, where nothing else can view their memory
    (one tensor on all of its storage, or a tensor living in ``staging``, replaced by a new image)."""
    hosts = host_tensors(state)
    private = {k for k, host in hosts.items() if not _shares_memory(host, state[k])}
    if 2 * sum(nbytes(hosts[k]) for k in private) > sum(nbytes(t) for t in hosts.values()):
        return {k: h if k in private else h.clone() for k, h in hosts.items()}, DeferredCopies([])
    image = image_for(hosts, target, header, reuse=staging)
    later: list[tuple[str, torch.Tensor | None, torch.Tensor, torch.Tensor]] = []
    moves: list[Callable[[], None]] = []
    live = False
    for key, host in hosts.items():
        view = image.tensors[key]
        if key in private:
            later.append((key, None, host, view))  # nothing else holds it: no need to watch
        elif host.untyped_storage().data_ptr() in deferred:
            later.append((key, host, host, view))
            live = live or host.data_ptr() == view.data_ptr()
            owner = _sole_owner(host, deferred[host.untyped_storage().data_ptr()], staging) if adopt else None
            if owner is not None and host.data_ptr() != view.data_ptr():
                moves.append(into_image(owner, view))
        else:
            view.copy_(host)
    lent = LentMemory(image.memory.numpy(), image.spare) if live or moves else None
    return image, DeferredCopies(later, lent=lent, adopt=moves)


def _sole_owner(host: torch.Tensor, owners: list[torch.Tensor], staging: FileImage | None) -> torch.Tensor | None:
    """The parameter or state tensor ``host`` is the memory of, where moving it leaves no other
    view behind: alone on all of its storage, or living in the previous file image."""
    mine = [t for t in owners if t.data_ptr() == host.data_ptr() and t.shape == host.shape and t.is_contiguous()]
    storage = host.untyped_storage()
    if len(mine) != 1:
        return None
    if staging is not None and storage.data_ptr() == staging.memory.untyped_storage().data_ptr():
        return mine[0]
    return mine[0] if len(owners) == 1 and storage.nbytes() == nbytes(host) else None


@functools.cache
def _background() -> ThreadPoolExecutor:
    """The one thread writing `save_checkpoint(blocking=False)` files: in call order, and joined
    (so finished) when the interpreter exits."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiekit-save")


# A fork child makes its own: the parent's thread is not in it, and its saves would never run.
os.register_at_fork(after_in_child=_background.cache_clear)


def _shares_memory(host: torch.Tensor, original: torch.Tensor) -> bool:
    return host.device == original.device and host.untyped_storage().data_ptr() == original.untyped_storage().data_ptr()
