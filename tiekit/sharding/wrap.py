"""`shard`: FSDP2 ``fully_shard`` over a model's units and its root, the owners of every tie group in
one unit."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiekit.analyze import find_ties
from tiekit.errors import TiekitError
from tiekit.plan import TiePlan, checked_plan
from tiekit.retie import retie
from tiekit.sharding.check import check_sharding
from tiekit.sharding.forward_writes import refuse_forward_writes
from tiekit.sharding.units import UnitSpec, shard_units
from tiekit.slots import checked_module


def shard(
    model: nn.Module,
    *,
    mesh: Any = None,
    units: Sequence[UnitSpec] | None = None,
    plan: TiePlan | None = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Apply FSDP2 (``torch.distributed.fsdp.fully_shard``) to ``model``'s units, then to the
    root, keeping every tie: the modules that own one tied parameter always share a unit.
    Returns ``model``, wrapped in place.

    ``units``: the modules to shard one by one, as dotted name patterns (``"transformer.h.*"``,
    ``*`` within one part), module classes or modules; None (the default) takes the model's
    repeated blocks (children of a ``ModuleList``/``Sequential`` whose class repeats). A tie whose
    owners fall in different units joins them into one ``fully_shard([a, b])`` unit; an owner no
    unit holds joins it with its own module; a tie held by the root module itself keeps its units
    with the root. `tiekit.sharding.shard_units` shows the result without a process group.

    ``plan``: the tie plan to keep (default ``tiekit.find_ties(model)``); its ties are applied
    before wrapping, so a plan made before ``to_empty`` or with ``declared=`` ties restores ties
    the model lost. A traced plan (``find_ties(model, trace=True)``) also keeps a weight read
    outside its module (``F.linear(h, self.embed.weight)`` in the root) inside the reader's unit.
    ``mesh`` and ``fully_shard_kwargs`` (``mp_policy=MixedPrecisionPolicy(...)``,
    ``reshard_after_forward``, ``offload_policy``...) go to every ``fully_shard`` call. Works on a
    model on the meta device (FSDP keeps meta parameters there; see docs/sharding.md for
    ``to_empty`` and initialization).

    A second call on a model this function wrapped, with the same ``mesh``, ``units`` and
    options, returns it as it is after checking its ties (Lightning calls ``configure_model``
    once per stage); other arguments raise `TiekitError`.

    Raises `TiekitError` without a process group (and no ``mesh``), for a model already wrapped
    by something else (`check_sharding` checks those), and for a unit entry that matches nothing
    or names a ``ModuleList``; `TieError` when tied units cannot be ordered bottom-up or a buffer
    is a view of a parameter. An error from a ``fully_shard`` call (leaving the model partly
    wrapped) carries a note naming the unit. The first forward pass raises `TiekitError` if it
    writes a parameter in place: FSDP2 would write the gathered copy and drop it
    (`tiekit.sharding.forward_writes`).

    Does not communicate: ``fully_shard`` shards each rank's own copy of the weights locally, so
    every rank must hold the same weights (same seed, or load a checkpoint after wrapping); the
    first forward communicates. With ``mesh=None`` it builds one 1-D mesh over the default group
    on the accelerator (CPU when there is none), as ``fully_shard`` does; where torch creates a
    new process group for that (CUDA present with a gloo default group), that step is collective:
    pass ``mesh=`` to avoid it.
    """
    import torch.distributed as dist

    checked_module(model, "tiekit.shard")
    if plan is not None:
        checked_plan(plan, "tiekit.shard")
    from torch.distributed.device_mesh import DeviceMesh

    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TiekitError(f"tiekit.shard: mesh must be a DeviceMesh (init_device_mesh(...)), not {mesh!r}")
    FSDPModule, fully_shard = fsdp2()
    _refuse_pinning_without_an_accelerator(fully_shard_kwargs.get("offload_policy"))
    if mesh is None and not (dist.is_available() and dist.is_initialized()):
        raise TiekitError(
            "tiekit.shard needs a process group: call torch.distributed.init_process_group(...) first "
            "(torchrun, mp.spawn...), or pass mesh=init_device_mesh(...)"
        )
    wrapped = [path or "<root>" for path, m in model.named_modules() if isinstance(m, FSDPModule)]
    if wrapped and _SHARDED not in model.__dict__:
        raise TiekitError(
            f"tiekit.shard wraps an unwrapped model, but FSDP is already applied to {', '.join(wrapped[:4])}; "
            "to check a model you wrapped yourself, call tiekit.check_sharding(model, plan)"
        )
    if mesh is None:
        mesh = _default_mesh()
    plan = find_ties(model) if plan is None else plan
    plan_units = shard_units(model, units, plan=plan)  # validates before anything changes
    sharding = _Sharding(mesh, tuple(u.label for u in plan_units), _with_defaults(fully_shard, fully_shard_kwargs))
    if wrapped:
        return _sharded_before(model, sharding, plan)
    retie(model, plan)
    for unit in plan_units:
        target: Any = unit.modules[0] if len(unit.modules) == 1 else list(unit.modules)
        try:
            fully_shard(target, mesh=mesh, **fully_shard_kwargs)
        except Exception as exc:
            exc.add_note(f"tiekit.shard: while sharding the unit {unit.label!r}")
            raise
    check_sharding(model, plan)
    refuse_forward_writes(model)  # FSDP2 drops them: the first forward pass says so
    model.__dict__[_SHARDED] = sharding
    return model


#: Where `shard` leaves its arguments on the model it wrapped, for a second call to compare.
_SHARDED = "_tiekit_sharding"


@dataclass(frozen=True)
class _Sharding:
    """What one `shard` call wrapped a model with: the mesh as built, the units as resolved (their
    labels), ``fully_shard``'s options with its defaults filled in (so that ``units=None`` and
    the same units named, or ``reshard_after_forward=True`` given or not, are the same)."""

    mesh: Any
    units: tuple[str, ...]
    options: dict[str, Any]

    def same_as(self, other: _Sharding) -> bool:
        try:
            return bool(self.mesh == other.mesh and self.units == other.units and self.options == other.options)
        except Exception:  # noqa: BLE001 - arguments that cannot be compared are not the same
            return False


def _sharded_before(model: nn.Module, sharding: _Sharding, plan: TiePlan) -> nn.Module:
    """A second `shard` call on a model it wrapped, with the same arguments, changes nothing:
    Lightning calls ``configure_model`` again for every stage (fit, then validate, test...)."""
    before: _Sharding = model.__dict__[_SHARDED]
    if not before.same_as(sharding):
        differ = {k: v for k, v in sharding.options.items() if before.options.get(k) != v}
        raise TiekitError(
            "tiekit.shard already sharded this model with other arguments (mesh, units or fully_shard options); "
            f"a second call may only repeat the first (before: {_shown(before, differ)}; "
            f"now: {_shown(sharding, differ)})"
        )
    check_sharding(model, plan)
    return model


def _shown(sharding: _Sharding, options: dict[str, Any]) -> str:
    shown = {k: sharding.options.get(k) for k in options}
    return f"mesh={sharding.mesh}, units={list(sharding.units)}, options={shown}"


def _with_defaults(function: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` of ``function`` with the defaults of those not given (not ``mesh``, compared
    on its own); as given when its signature cannot be read or does not take them."""
    try:
        bound = inspect.signature(function).bind_partial(**options)
    except (TypeError, ValueError):
        return dict(options)
    bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items() if k not in ("module", "mesh")}


def _refuse_pinning_without_an_accelerator(offload_policy: Any) -> None:
    """`TiekitError` for ``CPUOffloadPolicy()`` (``pin_memory=True``, its default) where there is no
    accelerator: torch's pinning fails inside the first ``fully_shard`` call ("Found no NVIDIA
    driver"), leaving the model partly wrapped; refused before anything changes."""
    if getattr(offload_policy, "pin_memory", False) and _accelerator_type() == "cpu":
        raise TiekitError(
            "tiekit.shard: offload_policy=CPUOffloadPolicy() pins host memory (pin_memory=True, its default), "
            "which needs an accelerator; this machine has none: pass CPUOffloadPolicy(pin_memory=False)"
        )


def fsdp2() -> tuple[Any, Any]:
    """``(FSDPModule, fully_shard)`` from ``torch.distributed.fsdp``; `TiekitError` before torch 2.6."""
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError as exc:
        raise TiekitError(
            "tiekit's sharding needs FSDP2 in torch.distributed.fsdp (torch 2.6 or later); "
            f"this is torch {torch.__version__}"
        ) from exc
    return FSDPModule, fully_shard


def _default_mesh() -> Any:
    """The mesh ``fully_shard`` would build for itself, built once for every unit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(_accelerator_type(), (dist.get_world_size(),))


def _accelerator_type() -> str:
    """The device type of this machine's accelerator, ``"cpu"`` where there is none."""
    # current_accelerator() without check_available names CUDA in a CUDA build on a machine
    # without a GPU; torch 2.6 lacks the argument, and fully_shard itself asks torch._C.
    try:
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        return accelerator.type if accelerator is not None else "cpu"
    except TypeError:
        return str(torch._C._get_accelerator().type)
