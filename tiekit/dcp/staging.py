"""Host copies of a sharded save's state, for a write in the background.

A background save writes copies, never the live tensors training goes on changing. Each copy
has the layout DCP plans with (a DTensor's copy is a DTensor over a host copy of this rank's
shard, with the same mesh, placements and global shape), and goes into the memory of the
previous save's copy of the same name when it fits: a loop that saves every N steps copies into
the same buffers each time instead of faulting in new memory inside its step.

The copies of the tensors only an optimizer step changes (parameters and optimizer state,
`tiekit.checkpoint.deferred.deferrable_storages`) may be left to the writing thread, made beside
the next step's forward and backward passes, as `tiekit.fit`'s single-file saves do.
"""

from __future__ import annotations

from collections.abc import Container, Mapping

import torch

from tiekit.checkpoint.deferred import DeferredCopies, local_part


def host_copies(
    tensors: Mapping[str, torch.Tensor],
    staging: Mapping[str, torch.Tensor] | None = None,
    defer: Container[int] | None = None,
) -> tuple[dict[str, torch.Tensor], DeferredCopies | None]:
    """A host copy of every tensor of ``tensors``, made in ``staging``'s copy of the same name
    where its layout matches (a previous call's result whose write is finished), else in new
    memory; and the copies not made here: those of host tensors whose storage is in ``defer``.
    Local."""
    hosts: dict[str, torch.Tensor] = {}
    later: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for name, value in tensors.items():
        source = local_part(value)
        copy = _reusable((staging or {}).get(name), value, source)
        if copy is None:
            copy = _new_copy(value, source)
        target = local_part(copy)
        if defer is not None and source.device.type == "cpu" and source.untyped_storage().data_ptr() in defer:
            later.append((name, value, source, target))
        else:
            target.copy_(source)
        hosts[name] = copy
    return hosts, DeferredCopies(later) if later else None


def _new_copy(value: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    local = torch.empty(source.shape, dtype=source.dtype, device="cpu")
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
