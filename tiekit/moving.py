"""Moves that keep ties: `move` and `preserve_ties`, for models you cannot subclass
(`tiekit.TPUMixin` does the same inside ``nn.Module._apply``), and the pieces both use:
converting each tensor once (`once_per_tensor`) and re-binding an optimizer (`rebind_optimizer`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from tiekit import devices
from tiekit.analyze import find_ties, reinterpreting_views
from tiekit.errors import TieError, TieWarning
from tiekit.mixin_plans import confirm_kept_plan
from tiekit.plan import TiePlan
from tiekit.preserving import keep_what_the_block_gave, tensors_at_entry
from tiekit.retie import OnError, checked_on_error, fitting_plan, retie, verify
from tiekit.sharding.check import refuse_cast_after_first_forward
from tiekit.slots import checked_module


def move(
    model: nn.Module,
    device: torch.device | str | int | torch.dtype | None = None,
    dtype: torch.dtype | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    plan: TiePlan | None = None,
    on_error: OnError = "raise",
) -> nn.Module:
    """Move/cast ``model`` keeping its ties: plan, ``.to``, retie, verify. Returns ``model``.

    Each tensor object is converted once, however many modules register it: a tied weight
    crosses to the device once and never exists twice there.

    ``device="xla"`` means this process's XLA device. A dtype in place of the device casts
    only, as ``model.to(torch.bfloat16)`` does. With ``optimizer``, its param groups and state
    are re-bound, by name, to the moved parameters.
    """
    checked_on_error(on_error, "tiekit.move")
    if isinstance(device, torch.dtype) and dtype is None:
        device, dtype = None, device  # move(model, torch.bfloat16), as nn.Module.to takes it
    if device is None and dtype is None:
        raise TieError("tiekit.move needs a device, a dtype or both")
    try:
        if isinstance(device, torch.dtype):
            raise TypeError("a dtype, and dtype= is given too")
        target = devices.resolve_device(device)
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        raise TieError(f"tiekit.move: {device!r} is not a device ({exc}); a dtype goes in dtype=") from exc
    if dtype is not None and not (isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex)):
        raise TieError(
            f"tiekit.move: dtype must be a floating point or complex torch.dtype (as for .to()), not {dtype!r}"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TieError(f"tiekit.move: optimizer must be a torch.optim.Optimizer, not a {type(optimizer).__name__}")
    # A plan made here is checked too: one retie could not apply must refuse before anything moves.
    planned = moving_plan(model, None) if plan is None else _given_plan(model, plan, "tiekit.move")
    plan = fitting_plan(model, planned, counted=on_error == "raise")
    names = {id(p): n for n, p in model.named_parameters()} if optimizer is not None else {}
    kwargs: dict[str, object] = {}
    if target is not None:
        kwargs["device"] = target
    if dtype is not None:
        kwargs["dtype"] = dtype
        refuse_cast_after_first_forward(model, dtype)
    try:
        with retied_if_interrupted(model, plan), converting_once(model):
            model.to(**kwargs)  # type: ignore[call-overload]
    except Exception as exc:
        raise TieError(
            f"tiekit.move: converting the model failed ({type(exc).__name__}: {exc}); its ties hold, and the "
            "tensors converted before the failure, if any, stay converted"
        ) from exc
    retie(model, plan)
    verify(model, plan, on_error=on_error)
    if optimizer is not None:
        rebind_optimizer(optimizer, model, names)
    return model


def moving_plan(model: nn.Module, declared: Mapping[str, str] | None) -> TiePlan:
    """The ties ``model`` holds, every ``TPUMixin.tied_weights`` in it (the mixin applies them at
    each conversion, equal in value or not: a moving plan without them would call the tie the
    mixin made a lost parameter), the other ties it and its submodules declare (transformers'
    ``_tied_weights_keys``: `tiekit.declarations.declared_ties`) where their tensors are equal in
    value (a tie a plain ``.to`` broke before: the move restores it; two tensors trained apart
    are not merged), and ``declared``. What every move plans with: `move`, `preserve_ties`,
    ``prepare_tied``, ``KeepTies``."""
    from tiekit.declarations import declared_ties_holding  # it imports tiekit.mixin, which imports this module
    from tiekit.errors import CheckpointError
    from tiekit.mixin import declared_in_mixins

    try:
        holding = declared_ties_holding(model)
    except CheckpointError as exc:  # a tied_weights name that does not resolve
        raise TieError(str(exc)) from exc
    mixins = declared_in_mixins(model) if isinstance(model, nn.Module) else {}  # else find_ties names it
    for target, source in (declared or {}).items() if isinstance(declared, Mapping) else ():
        if mixins.get(target, source) != source:
            raise TieError(
                f"declared ties {target!r} to {source!r}, but a TPUMixin's tied_weights in the model ties it to "
                f"{mixins[target]!r} (applied at every conversion of the model); nothing was changed"
            )
    merged = {**holding, **mixins, **(declared or {})}
    return find_ties(model, declared=merged or None)


def refuse_plan_without_mixin_ties(model: nn.Module, plan: TiePlan, where: str) -> None:
    """`TieError` naming the tie when ``plan`` (given, not made by `moving_plan`) leaves out a tie
    a `TPUMixin`'s ``tied_weights`` in ``model`` declares: the mixin applies it at the conversion,
    and the plan's count check then refused a model already converted. Raised before anything moves."""
    from tiekit.mixin import mixin_ties_outside

    if not isinstance(model, nn.Module) or not isinstance(plan, TiePlan):
        return  # not a model or plan: the caller's check names the mistake
    missing = mixin_ties_outside(model, plan)
    if missing:
        target, source = missing[0]
        raise TieError(
            f"{where}: the plan given does not tie {target!r} to {source!r}, which a TPUMixin's tied_weights in "
            f"{type(model).__name__} declares (the mixin ties them at every conversion, against the plan); "
            "nothing was converted. Make the plan once the tie holds (after model.tie_weights()), or with "
            f"tiekit.find_ties(model, declared={{{target!r}: {source!r}}})"
        )


def _given_plan(model: nn.Module, plan: TiePlan, where: str) -> TiePlan:
    """``plan`` with the model's views in another dtype, which a plan from JSON does not carry:
    the move refuses them rather than leave each a copy of its own."""
    if not isinstance(plan, TiePlan):
        return plan  # not a plan: fitting_plan names the mistake
    refuse_plan_without_mixin_ties(model, plan, where)
    if plan.reinterpreting:
        return plan
    views = reinterpreting_views(model)
    return dataclasses.replace(plan, reinterpreting=views) if views else plan


def once_per_tensor(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn`` (a conversion ``nn.Module._apply`` calls per slot), called once per tensor object:
    a tensor met again under another module's name gets the first result. torch calls ``fn``
    once per owning module, so a tied weight would be copied to the device once per owner."""
    if getattr(fn, "_tiekit_once", False):
        return fn
    results: dict[int, torch.Tensor] = {}
    converted: set[int] = set()  # the storages of new outputs, held (in results) until the end

    def convert(t: torch.Tensor) -> torch.Tensor:
        # A tensor over the memory of an output is converted already: the output itself met
        # again (a module registered twice), the Parameter torch made over it, a tensor that
        # swap_tensors gave it to. Returned as it is: a conversion is not always idempotent.
        memory = devices.storage_key(t)
        if memory is not None and memory in converted:
            return t
        # Keyed by id without holding the old tensor (holding every one would keep the whole
        # unconverted model alive until the end; swap_tensors refuses weak references). A freed
        # input's id can go to a new object, but during one _apply the new objects are outputs
        # and Parameters over them, which the check above has answered.
        out = results.get(id(t))
        if out is None:
            out = results[id(t)] = fn(t)
            made = devices.storage_key(out)
            if out is not t and made is not None and made != memory:
                converted.add(made)
        return out

    convert._tiekit_once = True  # type: ignore[attr-defined]
    return convert


@contextmanager
def retied_if_interrupted(model: nn.Module, plan: TiePlan) -> Iterator[None]:
    """Inside: a conversion that raises half way (a tensor it refuses, a KeyboardInterrupt) has
    given new tensors to the members it reached and not to the others, splitting their ties; the
    error goes on once ``model`` is tied again by ``plan``, as far as it can be. Tied again, the
    next move (whose plan would see two tensors) keeps them one."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(TieError):
            retie(model, plan)
            confirm_kept_plan(model)
        raise


@contextmanager
def converting_once(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s conversions (``.to``, ``.to_empty``, ``.bfloat16()``...) go
    through `once_per_tensor`; ``nn.Module._apply`` passes the wrapped function on to every
    submodule. (`tiekit.TPUMixin` does the same in its own ``_apply``.)"""
    original = model._apply

    def apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        return original(once_per_tensor(fn), recurse)  # type: ignore[no-untyped-call,no-any-return]

    model.__dict__["_apply"] = apply  # an instance attribute shadows the method for this block only
    try:
        yield
    finally:
        model.__dict__.pop("_apply", None)


def rebind_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, names: Mapping[int, str]) -> None:
    """Re-point ``optimizer``'s params and state at the model's current parameters.

    ``names`` maps ``id(old_param)`` to its name, taken before the move while the old
    parameters were alive. Names are looked up with their aliases, so two old tensors that
    are now one tied parameter (a declared tie applied by the move) become one entry: the one
    under the parameter's first name keeps its place and state, the duplicate goes (an
    optimizer holding a parameter twice would step it twice, and cannot be saved).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TieError(f"rebind_optimizer: optimizer must be a torch.optim.Optimizer, not a {type(optimizer).__name__}")
    checked_module(model, "rebind_optimizer")
    if not isinstance(names, Mapping):
        raise TieError(
            "rebind_optimizer: names maps id(parameter) to its name (taken before the move), "
            f"not a {type(names).__name__}"
        )
    current = dict(model.named_parameters(remove_duplicate=False))
    first_name = {id(p): name for name, p in model.named_parameters()}
    # Which old tensor keeps each new parameter: the one under its first name, else the first met.
    keeper: dict[int, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names.get(id(p))
            if name is not None and name in current:
                new = current[name]
                if id(new) not in keeper or first_name.get(id(new)) == name:
                    keeper[id(new)] = id(p)
    state = optimizer.state
    unknown = 0
    for group in optimizer.param_groups:
        rebound = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None or name not in current:
                unknown += 1
                rebound.append(p)
                continue
            new = current[name]
            old_state = state.pop(p, None)
            if keeper[id(new)] != id(p):
                continue  # the duplicate of a tied parameter, and its stale state
            if old_state is not None:
                state[new] = {k: _state_to(v, new, k, group) for k, v in old_state.items()}
            rebound.append(new)
        group["params"] = rebound
    if unknown:
        warnings.warn(
            f"tiekit.move: the optimizer holds {unknown} tensor(s) that are not parameters of the "
            "model; they were left where they are and will not follow the move",
            TieWarning,
            stacklevel=3,
        )


def _state_to(value: object, param: torch.Tensor, key: str, group: Mapping[str, object]) -> object:
    # Optimizer.load_state_dict's policy: `step` stays a float32 counter (on the parameter's
    # device for a capturable or fused optimizer, else where it is: a CPU scalar); other floating
    # state follows the parameter's device and dtype. A step cast to bfloat16 stops counting.
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        if group.get("capturable") or group.get("fused"):
            return value.to(device=param.device, dtype=torch.float32)
        return value if value.device.type == "cpu" else value.to(device=param.device)
    dtype = param.dtype if value.is_floating_point() else None
    return value.to(device=param.device, dtype=dtype)


@contextmanager
def preserve_ties(
    model: nn.Module,
    *,
    plan: TiePlan | None = None,
    declared: Mapping[str, str] | None = None,
    on_error: OnError = "raise",
) -> Iterator[TiePlan]:
    """Plan on entry; retie and verify on a normal exit. Yields the plan.

    For code that replaces tensors behind the model's back: ``.to(xla)``, ``to_empty``,
    ``load_state_dict(assign=True)``, third-party wrappers. When the block raises, the ties are
    restored as far as they can be (a conversion stopped half way) and the error goes on. A tie
    the block split keeps what it gave (`tiekit.preserving`): a tensor loaded under one name of
    it becomes the tie's; different values given to two names raise `TieError`.
    """
    checked_on_error(on_error, "tiekit.preserve_ties")
    planned = moving_plan(model, declared) if plan is None else _given_plan(model, plan, "tiekit.preserve_ties")
    plan = fitting_plan(model, planned, counted=on_error == "raise")
    entry = tensors_at_entry(model, plan)
    with retied_if_interrupted(model, plan), converting_once(model):
        yield plan
    refuse_cast_after_first_forward(model)  # your cast happened: what it breaks, and how to undo it
    keep_what_the_block_gave(model, plan, entry)
    retie(model, plan)
    verify(model, plan, on_error=on_error)
