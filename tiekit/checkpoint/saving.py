"""Saving: which tensors a tied checkpoint stores (one per tie group) and its header metadata."""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiekit import devices
from tiekit.analyze import find_ties
from tiekit.checkpoint.codec import Fallback, encode
from tiekit.checkpoint.deferred import DeferredCopies, deferrable_storages
from tiekit.checkpoint.direct import FileImage, LentMemory, image_for
from tiekit.checkpoint.files import write_sharded, write_single
from tiekit.checkpoint.handle import SaveHandle
from tiekit.checkpoint.layout import (
    CHECKPOINT_NAME,
    PLAN_KEY,
    STATE_KEY,
    STATE_VERSION,
    WEIGHTS_NAME,
    PathLike,
    nbytes,
    target_path,
)
from tiekit.checkpoint.optimizer import optimizer_record
from tiekit.errors import CheckpointError, TieError
from tiekit.header import DTYPE_CODES
from tiekit.mixin import TPUMixin
from tiekit.plan import TiePlan
from tiekit.retie import tie_changes
from tiekit.slots import resolve


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
    """
    target = target_path(path, WEIGHTS_NAME)
    limit = None if max_shard_size is None else _parse_size(max_shard_size)
    plan = _saving_plan(model)
    names, tensors = _unique_tensors(model, plan)
    header = _header_metadata(metadata, plan)

    state = _host_tensors(dict(zip(names, tensors, strict=True)))
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
    per 95 MB here), which is written to the file as it is (`tiekit.checkpoint.direct`).

    ``defer`` (with ``blocking=False``): the host copies of the parameters and the optimizer
    state that live in host memory are made by the writing thread, not here; the caller must call
    the returned `DeferredCopies`' ``settle()`` before anything changes them (its next optimizer
    step), and the file is published only after that (`tiekit.checkpoint.deferred`).

    ``adopt`` (with ``defer``): ``settle()`` also moves those parameters and state tensors into
    the image (``.data``), so that from the next save into the same ``staging`` on, they are
    written from where they live, not copied: that save's ``settle()`` waits for the chunk being
    written and copies only the bytes not yet written aside. The model's parameters then live
    in the returned image until moved again. Local."""
    target, state, header = stage_training_checkpoint(path, model=model, optimizer=optimizer, step=step, extra=extra)
    if blocking:
        write_single(target, _host_tensors(state), header, durable)
        return SaveHandle(target, "", None), None, None
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

    return SaveHandle(target, "", _background().submit(write)), image if isinstance(image, FileImage) else None, copies


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
    write_single(target, _host_tensors(state), header, durable)


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
    target = target_path(path, CHECKPOINT_NAME)
    values = {"step": (step, "extra/step"), "extra": (extra, "extra/value")}
    plan, state, encoded = encode_training_state(model, optimizer, values, fallback)
    header = _header_metadata(None, plan)
    header[STATE_KEY] = json.dumps({"version": STATE_VERSION, **encoded}, separators=(",", ":"))
    return target, state, header


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
    hosts = _host_tensors(state)
    private = {k for k, host in hosts.items() if not _shares_memory(host, state[k])}
    if 2 * sum(nbytes(hosts[k]) for k in private) > sum(nbytes(t) for t in hosts.values()):
        return {k: h if k in private else h.clone() for k, h in hosts.items()}, DeferredCopies([])
    image = image_for(hosts, target, header, reuse=staging)
    later: list[tuple[str, torch.Tensor | None, torch.Tensor, torch.Tensor]] = []
    moves: list[tuple[torch.Tensor, torch.Tensor]] = []
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
                moves.append((owner, view))
        else:
            view.copy_(host)
    lent = LentMemory(image) if live or moves else None
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


def encode_training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    values: Mapping[str, tuple[Any, str]],
    fallback: Fallback | None = None,
) -> tuple[TiePlan, dict[str, torch.Tensor], dict[str, Any]]:
    """What a training checkpoint holds, as the single-file and the sharded saves write it: the
    tie plan; the tensors (one per tie group, then the tensors of ``values`` and the optimizer
    state); and the JSON record: each of ``values`` (``key: (value, prefix of its tensors)``)
    encoded under its key, then ``"optimizer"``. Local; `CheckpointError` on what cannot be stored."""
    plan = _saving_plan(model)
    names, tensors = _unique_tensors(model, plan)
    side: dict[str, torch.Tensor] = {}
    record: dict[str, Any] = {
        key: encode(value, prefix, side, fallback=fallback) for key, (value, prefix) in values.items()
    }
    record["optimizer"] = None if optimizer is None else optimizer_record(optimizer, model, plan, side)
    clash = sorted(set(names) & set(side))
    if clash:
        raise CheckpointError(f"cannot save {type(model).__name__}: parameter names {clash} clash with optimizer keys")
    return plan, {**dict(zip(names, tensors, strict=True)), **side}, record


@functools.cache
def _background() -> ThreadPoolExecutor:
    """The one thread writing `save_checkpoint(blocking=False)` files: in call order, and joined
    (so finished) when the interpreter exits."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiekit-save")


def _shares_memory(host: torch.Tensor, original: torch.Tensor) -> bool:
    return host.device == original.device and host.untyped_storage().data_ptr() == original.untyped_storage().data_ptr()


def _parse_size(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", size.upper().replace("IB", "iB"))
        if match is None:
            raise CheckpointError(f"max_shard_size {size!r} is not a size like 5GB, 500MiB or 1000000")
        number, unit, binary = match.groups()
        base = 1024 if binary else 1000
        value = int(float(number) * base ** "_KMGT".index(unit or "_"))
    else:
        raise CheckpointError(f"max_shard_size must be an int or a string, not {type(size).__name__}")
    if value <= 0:
        raise CheckpointError(f"max_shard_size must be positive, got {size!r}")
    return value


def _saving_plan(model: nn.Module) -> TiePlan:
    """The model's ties, plus the declared ties that hold in its current tensors.

    A declared tie whose two tensors differ (a tie broken by a move, then trained) is left
    out: dropping one of them would lose data. The file then records two tensors.
    """
    declared = {t: s for t, s in declared_ties(model).items() if _same_values(model, t, s)}
    try:
        return find_ties(model, declared=declared or None)
    except TieError as exc:
        raise CheckpointError(f"cannot save {type(model).__name__}: {exc}") from exc


def _same_values(model: nn.Module, target: str, source: str) -> bool:
    a, b = resolve(model, target)[2], resolve(model, source)[2]
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype or a.is_meta or b.is_meta or a.device != b.device:
        return False
    with torch.no_grad():
        return bool(torch.equal(a, b))


def declared_ties(model: nn.Module) -> dict[str, str]:
    """``{target: source}`` ties the model declares: ``TPUMixin.tied_weights`` and transformers'
    ``_tied_weights_keys`` (expanded, restricted to names that exist in the model). A
    ``tied_weights`` name that does not resolve is a `CheckpointError`, as it is a `TieError`
    when the module moves."""
    declared: dict[str, str] = {}
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    if callable(expand):
        with contextlib.suppress(TypeError, AttributeError, KeyError, ValueError, RuntimeError):
            found = expand(all_submodels=True)
            if isinstance(found, Mapping):
                declared.update({t: s for t, s in found.items() if isinstance(t, str) and isinstance(s, str)})
    if isinstance(model, TPUMixin):
        for target, source in model.tied_weights.items():
            if not isinstance(target, str) or not isinstance(source, str):
                raise CheckpointError(f"{type(model).__name__}.tied_weights maps names to names; got {target!r}")
            try:
                resolve(model, target, "declared tie target (tied_weights)")
                resolve(model, source, "declared tie source (tied_weights)")
            except TieError as exc:
                raise CheckpointError(f"{type(model).__name__}: {exc}") from exc
        declared.update(model.tied_weights)
    out = {}
    for target, source in declared.items():
        try:
            a, b = resolve(model, target)[2], resolve(model, source)[2]
        except TieError:
            continue
        if a.shape == b.shape and a.dtype == b.dtype:
            out[target] = source
    return out


def _unique_tensors(model: nn.Module, plan: TiePlan) -> tuple[list[str], list[torch.Tensor]]:
    """The names to store (each group's source once, every untied name) and their tensors."""
    state = model.state_dict(keep_vars=True)
    names: list[str] = []
    seen: set[str] = set()
    for name in state:
        key = plan.source_of(name)
        if key not in seen:
            seen.add(key)
            names.append(key)
    for group in plan.groups:
        if group.source in seen:
            try:
                tie_changes(model, group)  # the same checks retie makes, so the file can be re-tied
            except TieError as exc:
                raise CheckpointError(f"cannot save {type(model).__name__}: {exc}") from exc
    tensors = []
    for name in names:
        tensor = state[name] if name in state else resolve(model, name)[2]
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"cannot save {type(model).__name__}: state {name!r} is a {type(tensor).__name__}, not a tensor"
            )
        if tensor.is_meta:
            raise CheckpointError(f"cannot save {type(model).__name__}: {name!r} is on the meta device (no data)")
        if tensor.layout != torch.strided or tensor.dtype not in DTYPE_CODES:
            raise CheckpointError(
                f"cannot save {type(model).__name__}: {name!r} is a {tensor.layout} {tensor.dtype} tensor, "
                "which safetensors cannot store"
            )
        tensors.append(tensor.detach())
    return names, tensors


def _host_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, non-overlapping copies where needed; XLA tensors in one batched transfer."""
    hosts = devices.to_host(list(tensors.values()))
    out = []
    storages: dict[int, list[tuple[int, int]]] = {}
    for t in hosts:
        if not t.is_contiguous():
            t = t.contiguous()
        if t.numel():
            # Names left out of the plan can still share memory (a reinterpreting view, two
            # slices of one buffer); safetensors refuses overlapping tensors, so store a copy.
            # Disjoint tensors of one storage (fit's state living in its file image) stay.
            start, end = t.data_ptr(), t.data_ptr() + nbytes(t)
            spans = storages.setdefault(t.untyped_storage().data_ptr(), [])
            if any(start < e and s < end for s, e in spans):
                t = t.clone()
            else:
                spans.append((start, end))
        out.append(t)
    return dict(zip(tensors, out, strict=True))


def _header_metadata(metadata: Mapping[str, str] | None, plan: TiePlan) -> dict[str, str]:
    user = dict(metadata or {})
    for key, value in user.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise CheckpointError(f"metadata must map strings to strings; {key!r}: {value!r} does not")
        if key.startswith("tiekit.") or (key == "format" and value != "pt"):
            raise CheckpointError(f"metadata key {key!r} is reserved by tiekit")
    return {**user, "format": "pt", PLAN_KEY: plan.to_json()}
