"""Host copies of a sharded save's state, for a write in the background.

A background save writes copies, never the live tensors training goes on changing. Each copy
has the layout DCP plans with (a DTensor's copy is a DTensor over a host copy of this rank's
shard, with the same mesh, placements and global shape), and goes into the memory of the
previous save's copy of the same name when it fits: a loop that saves every N steps copies into
the same buffers each time instead of faulting in new memory inside its step.

The copies of the tensors only an optimizer step changes (parameters and optimizer state,
`tiekit.checkpoint.deferred.deferrable_storages`) may be left to the writing thread, made beside
the next step's forward and backward passes, as `tiekit.fit`'s single-file saves do.

The copies of the tensors this rank alone writes are made in a `ShardImage`: laid out as the
shard file's records, which the writer then sends to the file from where they are. The optimizer
state among them may then move into its copies (``adopt``, as `tiekit.fit` does): training goes
on in the image, and the next save writes that state from where it is, without a copy, the image
lent to the writer until the next optimizer step takes it back (`LentMemory`).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from typing import TYPE_CHECKING, Any

import torch

from tiekit.backends.torch_distributed import is_dtensor
from tiekit.checkpoint.deferred import DeferredCopies, into_image, local_part
from tiekit.dcp.shard_image import ShardImage

if TYPE_CHECKING:
    from tiekit.dcp.replay import Recipe


class Staging(dict[str, torch.Tensor]):
    """Host copies by name, the `ShardImage` holding those this rank alone writes (None when there
    is none), and, once their save is written, how to write the next save of the same image
    (`tiekit.dcp.replay`)."""

    image: ShardImage | None = None
    recipe: Recipe | None = None


def host_copies(
    tensors: Mapping[str, torch.Tensor],
    staging: Mapping[str, torch.Tensor] | None = None,
    defer: Container[int] | None = None,
    adopt: Mapping[int, tuple[dict[Any, Any], Any]] | None = None,
) -> tuple[Staging, DeferredCopies | None]:
    """A host copy of every tensor of ``tensors``, made in ``staging``'s copy of the same name
    where its layout matches (a previous call's result whose write is finished), else in new
    memory (those this rank alone writes in a new `ShardImage`, all of them when one of them is
    new); and the copies not made here: those of host tensors whose storage is in ``defer``.
    ``adopt`` (`optimizer_entries`): the deferred optimizer state tensors among them that are to
    move into their copies in the image once those are made and checked (`DeferredCopies.settle`).
    Local."""
    previous = staging or {}
    sources = {name: local_part(value) for name, value in tensors.items()}
    copies = {name: _reusable(previous.get(name), value, sources[name]) for name, value in tensors.items()}
    imaged = [name for name, value in tensors.items() if _written_here_alone(value, sources[name])]
    image = getattr(staging, "image", None)
    # A new image when a copy is new, or when a name left the image (emptied, or no longer this
    # rank's alone): a kept image's stale slot would make every later write record by record.
    if imaged and (image is None or len(image.tensors) != len(imaged) or any(copies[name] is None for name in imaged)):
        image = ShardImage([(sources[name].shape, sources[name].dtype) for name in imaged])
        for name, local in zip(imaged, image.tensors, strict=True):
            copies[name] = None if local is None else _on(tensors[name], sources[name], local)
    hosts = Staging()
    hosts.image = image if imaged else None
    later: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    moves: list[Callable[[], None]] = []
    live = False  # state living in the image: the writer writes it while training may change it
    for name, value in tensors.items():
        source = sources[name]
        copy = copies[name]
        if copy is None:
            copy = _new_copy(value, source)
        target = local_part(copy)
        if defer is not None and source.device.type == "cpu" and source.untyped_storage().data_ptr() in defer:
            later.append((name, value, source, target))
            if hosts.image is not None and hosts.image.holds(target):
                live = live or source.data_ptr() == target.data_ptr()
                held = None if adopt is None or source.data_ptr() == target.data_ptr() else adopt.get(id(value))
                if held is not None:
                    moves.append(_moved_into(held, value, copy))
        else:
            target.copy_(source)
        hosts[name] = copy
    if not later:
        return hosts, None
    lent = hosts.image.lend() if hosts.image is not None and (live or moves) else None
    return hosts, DeferredCopies(later, lent=lent, adopt=moves)


def optimizer_entries(optimizer: torch.optim.Optimizer) -> dict[int, tuple[dict[Any, Any], Any]]:
    """Each tensor of ``optimizer``'s per-parameter state (by ``id``), with the state dict and key
    holding it: where `host_copies` may put its copy instead."""
    return {
        id(value): (per_param, key)
        for per_param in optimizer.state.values()
        for key, value in per_param.items()
        if isinstance(value, torch.Tensor)
    }


def _moved_into(held: tuple[dict[Any, Any], Any], value: torch.Tensor, copy: torch.Tensor) -> Callable[[], None]:
    """The move of optimizer state ``value`` into ``copy``: a plain tensor takes the copy's memory
    (``.data``, as `into_image`); a DTensor, which ``.data`` does not re-point, is replaced by the
    copy in its state dict, unless something replaced it there since."""
    if not is_dtensor(value):
        return into_image(value, copy)
    state, key = held

    def move() -> None:
        if state.get(key) is value:
            state[key] = copy

    return move


def _written_here_alone(value: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether DCP plans ``value`` for this rank whatever the others hold: a shard of a DTensor
    sharded on every mesh dimension, or anything in a single process (DCP gives a replicated
    tensor to one rank of those holding it)."""
    if not source.numel():
        return False
    if source is not value:
        return all(p.is_shard() for p in value.placements)  # type: ignore[attr-defined]
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _new_copy(value: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    return _on(value, source, torch.empty(source.shape, dtype=source.dtype, device="cpu"))


def _on(value: torch.Tensor, source: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as the host copy of ``value`` (whose local part is ``source``): itself, or a
    DTensor of ``value``'s layout over it."""
    if source is value:
        return local
    from torch.distributed.tensor import DTensor

    assert isinstance(value, DTensor)
    return DTensor.from_local(
        local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
    )


def _reusable(copy: torch.Tensor | None, value: torch.Tensor, source: torch.Tensor) -> torch.Tensor | None:
    """``copy`` when it has ``value``'s layout (a DTensor: its mesh, placements and global shape,
    and a local shard of ``source``'s shape and dtype)."""
    if copy is None or type(copy) is not type(value) or copy.shape != value.shape:
        return None
    if source is not value and (
        copy.device_mesh != value.device_mesh  # type: ignore[attr-defined]
        or copy.placements != value.placements  # type: ignore[attr-defined]
    ):
        return None
    local = local_part(copy)
    if local.shape != source.shape or local.dtype != source.dtype or not local.is_contiguous():
        return None
    return copy
