"""Loads of `tiekit.TPUMixin` models: the check of an assign-load's entries before torch loads
anything (`before_load`, from the mixin's ``_load_from_state_dict``), and the re-tie after it
(`_after_load`, a load_state_dict post hook), or after a load that raised half way
(`finish_interrupted_load`)."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from tiekit.errors import TieError
from tiekit.mixin_plans import confirm_kept_plan
from tiekit.plan import TieGroup, TiePlan
from tiekit.retie import fitting_plan, member_holds, retie, tensor_difference, verify
from tiekit.slots import assign, resolve

# The load under way in this thread: (torch's missing_keys list of that load_state_dict call, id
# of the mixin module handling it), so that mixin modules nested in it leave the work to it.
_loading = threading.local()


@dataclass(frozen=True)
class _Load:
    """What the check before a load of a mixin module leaves for the work after it."""

    missing_keys: list[str]  # torch's list for one load_state_dict call: tells this call from a failed earlier one
    prefix: str  # of the mixin module in the module being loaded
    plan: TiePlan
    given: frozenset[str]  # the plan's names (relative to the module) the state dict gives a tensor for
    assign: bool


def enclosing_mixin_loads(missing_keys: list[str]) -> bool:
    """Whether a mixin module enclosing this one handles the load that ``missing_keys`` belongs
    to (then it does the work once, for both, as in ``_apply``)."""
    loading = getattr(_loading, "current", None)
    return loading is not None and loading[0] is missing_keys


def before_load(
    model: nn.Module,
    plan: TiePlan,
    state_dict: Mapping[str, Any],
    prefix: str,
    missing_keys: list[str],
    *,
    assign: bool,
) -> None:
    """Check an assign-load of ``model`` (at ``prefix`` in the module being loaded) against its
    ``plan`` before torch loads any of it, and leave the plan for `_after_load`. A load in place
    (not assign) changes no tie; only its missing keys are looked at afterwards."""
    if not (assign or plan.groups):
        return  # nothing to re-tie, no tied name to fill
    if assign:
        plan = fitting_plan(model, plan)
    entries = _entries_for(plan, state_dict, prefix)
    if assign:
        for group in plan.groups:
            _check_entries_of(group, entries)  # before the load changes anything
    _loading.current = (missing_keys, id(model))
    _loads(model)[threading.get_ident()] = _Load(missing_keys, prefix, plan, frozenset(entries), assign)
    hooks = model._load_state_dict_post_hooks
    if _after_load not in hooks.values():
        # Registered on first use (the mixin has no __init__); torch runs a module's post
        # hooks after its whole subtree is loaded, and before load_state_dict raises for strict.
        # First of them: hooks the model's own code registered see it loaded and tied.
        handle = model.register_load_state_dict_post_hook(_after_load)  # type: ignore[no-untyped-call]
        cast("OrderedDict[int, Any]", hooks).move_to_end(handle.id, last=False)


def _loads(model: nn.Module) -> dict[int, _Load]:
    """The loads of ``model`` under way, by thread (one model may be loaded in two threads)."""
    loads: dict[int, _Load] = model.__dict__.setdefault("_tiekit_loads", {})
    return loads


def finish_interrupted_load(model: nn.Module) -> None:
    """Re-tie ``model`` after an assign-load of it that raised before its post hook ran (a
    module's own load step failing half way, a KeyboardInterrupt): torch had assigned some
    entries and not others, so a tie could be split, and a new plan would no longer see it.
    Best effort: a tie that cannot be restored is left to the next load or move's checks."""
    load = _loads(model).pop(threading.get_ident(), None)
    _end_current(model)
    if load is None or not load.assign:
        return
    with contextlib.suppress(TieError):
        _retie_loaded(model, load)
        confirm_kept_plan(model)


def _end_current(model: nn.Module) -> None:
    """This thread's load is no longer ``model``'s to handle."""
    if (getattr(_loading, "current", None) or (None, None))[1] == id(model):
        _loading.current = None


def _retie_loaded(model: nn.Module, load: _Load) -> None:
    """Tie each group of ``load``'s plan to the tensor the state dict gave it; the tied names it
    left out follow that tensor, its dtype included."""
    for group in load.plan.groups:
        _hold_the_given_member(model, group, load.given)
    retie(model, load.plan, replacing=[name for name in load.plan.tied_names if name not in load.given])


def _after_load(model: nn.Module, incompatible_keys: Any) -> None:
    """load_state_dict post hook: restore the ties of ``model`` after an assign-load of its
    subtree, then drop the tied names the load filled from ``incompatible_keys.missing_keys``
    (torch raises for strict=True only after its post hooks, so the ties hold by then).

    Each tie then holds the tensor the state dict gives under its source's name, or else under a
    name tied to the source by identity; the tied names it leaves out follow that tensor."""
    load = _loads(model).get(threading.get_ident())
    if load is None or load.missing_keys is not incompatible_keys.missing_keys:
        return  # not a load this mixin planned (or one that failed before reaching here)
    del _loads(model)[threading.get_ident()]
    _end_current(model)
    if load.assign:
        _retie_loaded(model, load)
        verify(model, load.plan)
        confirm_kept_plan(model)  # new tensors, the same ties: a plan made now could miss XLA's views
    missing = incompatible_keys.missing_keys  # torch's own list: it reports and returns this one
    if missing:
        filled = {load.prefix + name for name in _filled_names(model, load.plan, load.given)}
        missing[:] = [key for key in missing if key not in filled]


def _filled_names(model: nn.Module, plan: TiePlan, given: Collection[str]) -> list[str]:
    """The names of ``plan`` the state dict left out that the load filled all the same: each is,
    after the load, the tensor given under its source's or another identity member's name, or a
    view of it. (A declared tie a load in place does not apply leaves its target unfilled.)"""
    filled: list[str] = []
    for group in plan.groups:
        _, _, source, _ = resolve(model, group.source)
        if not any(m.view is None and m.name in given and member_holds(model, m, source) for m in group.members):
            continue
        filled.extend(m.name for m in group.members if m.name not in given and member_holds(model, m, source))
    return filled


def _entries_for(plan: TiePlan, state_dict: Mapping[str, Any], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors ``state_dict`` gives for the names of ``plan``'s groups (keyed without ``prefix``)."""
    entries = {}
    for group in plan.groups:
        for name in group.names:
            entry = state_dict.get(prefix + name)
            if isinstance(entry, torch.Tensor):  # torch reports a non-tensor itself
                entries[name] = entry
    return entries


def _check_entries_of(group: TieGroup, entries: Mapping[str, torch.Tensor]) -> None:
    """`TieError` unless the ``entries`` given for ``group``'s names can be one tie: the first
    given (the source's, else a name tied to it by identity) is what the tie will hold, so the
    others must be it (or the views of it) in dtype, shape and value."""
    given = [m for m in group.members if m.name in entries]
    if not given:
        return
    first, held = given[0], entries[given[0].name]
    if first.view is not None:
        raise TieError(
            f"the state dict gives {first.name!r}, a view of {group.source!r}, without {group.source!r}: "
            f"views are rebuilt from their source after the load, so its values would be lost. Give "
            f"{group.source!r} too, or leave {first.name!r} out; nothing was loaded"
        )
    if tuple(held.shape) != group.shape:
        return  # torch refuses the entry itself, naming its shape
    # Every view member is rebuilt from the held tensor after the load, given or left out.
    view = next((m for m in group.members if m.view is not None), None)
    if view is not None and not held.is_contiguous():
        raise TieError(
            f"the state dict's {first.name!r} is not contiguous, so {view.name!r} cannot be rebuilt "
            f"as a view of it after the load; give it contiguous (.contiguous()); nothing was loaded"
        )
    for member in given[1:]:
        expected = held if member.view is None else member.view.view_of(held)
        entry = entries[member.name]
        difference = tensor_difference(entry, expected)
        if difference:
            how = "the same tensor" if member.view is None else "a view of it"
            raise TieError(
                f"the state dict's {member.name!r} and {first.name!r} differ ({difference}), but in the model "
                f"{member.name!r} is {how} (tied to {group.source!r}), which can hold only one of them; "
                "nothing was loaded"
            )


def _hold_the_given_member(model: nn.Module, group: TieGroup, given: Collection[str]) -> None:
    """After the load, point the source of ``group`` at the tensor loaded under a name tied to
    it by identity if the state dict left the source itself out (``given``: the names it gave),
    so that `retie` ties the group to the loaded tensor, not to the source's old one."""
    if group.source in given:
        return
    member = next((m for m in group.members[1:] if m.view is None and m.name in given), None)
    if member is None:
        return
    _, _, loaded, _ = resolve(model, member.name)
    module, attr, _, kind = resolve(model, group.source)
    assign(module, attr, loaded, kind)
