"""The plans `TPUMixin` keeps between conversions, and when one may be reused.

Planning walks the whole model; a mixin model converted often (``.to(xla)``, ``.half()``,
assign-loads) reuses its plan instead, as long as nothing could have changed its ties:

- none of the model's modules registered a parameter, buffer or submodule since (how ties are
  made and unmade: ``a.weight = b.weight``, ``add_module``, ``register_buffer``; torch's global
  registration hooks tell which module did): another model built meanwhile, in this thread or
  another, changes nothing here;
- `forget_plans` was not called since (sharing made by ``.data =``, which no hook sees);
- the model still holds the plan's ties (`tiekit.retie.still_holds`, one look-up per tied name).

Reusing matters beyond speed: on XLA a view's geometry is hidden, so a plan made there cannot
see a view tie (a buffer ``w.t()``) that the plan made before the move knows.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from tiekit.plan import TiePlan
from tiekit.retie import still_holds

_registrations = [0]  # bumped by torch's registration hooks, in every thread
# Each module keeps the count at its latest registration in its __dict__, under this name (by
# identity: a module class may hash and compare by value). A model's modules are asked only after
# a registration somewhere: a conversion registers nothing, it writes torch's slots.
_STAMP = "_tiekit_registered"
_forgotten = [0]  # bumped by forget_plans
_hooks_installed = threading.Lock()
_hook_handles: list[Any] = []

#: Where a model keeps its plan (in its ``__dict__``, so torch never sees it as a submodule).
_SLOT = "_tiekit_plan"


@dataclass(frozen=True)
class _Kept:
    plan: TiePlan
    declared: int  # id of the root's ``tied_weights`` (a nested mixin's come with its registration)
    forgotten: int
    registrations: int  # the count when the plan was last confirmed on the model


def forget_plans() -> None:
    """Invalidate every cached mixin plan: call it after writing into ``_parameters`` or
    ``_modules`` by hand (torch's ``ModuleList.insert`` and ``Sequential.insert`` do), after
    ``.data =`` assignments that make tensors share memory, and after changing the
    ``tied_weights`` (of its class or the instance) of a mixin model held inside another (the
    outer's plan merged them).

    A cached plan is re-checked only for the ties it knows (`tiekit.retie.still_holds`, one
    look-up per tied name). Sharing made without a registration (``m.b.weight.data =
    m.a.weight.data``) is a tie it does not know, and seeing one would take a walk of every
    tensor, the cost the cache saves on each move; so a model whose plan was cached before
    such an assignment would convert a and b into two copies on its next move (a model never
    moved before keeps them sharing: its first plan sees it), unless this is called first.
    """
    _forgotten[0] += 1


def kept_plan(model: nn.Module, declared: Mapping[str, str]) -> TiePlan | None:
    """The plan ``model`` keeps, if it may be reused (see the module docstring); else None."""
    _watch_registrations()
    kept: _Kept | None = model.__dict__.get(_SLOT)
    if kept is None or kept.declared != id(declared) or kept.forgotten != _forgotten[0]:
        return None
    if kept.registrations != _registrations[0]:
        if any(_latest_registration(module) > kept.registrations for module in model.modules()):
            return None
        model.__dict__[_SLOT] = replace(kept, registrations=_registrations[0])  # registered elsewhere
    return kept.plan if still_holds(model, kept.plan) else None


def keep_plan(model: nn.Module, plan: TiePlan, declared: Mapping[str, str]) -> None:
    """Keep ``plan`` as ``model``'s, confirmed on the model as it is now (planned, or re-tied to it)."""
    _watch_registrations()
    model.__dict__[_SLOT] = _Kept(plan, id(declared), _forgotten[0], _registrations[0])


def confirm_kept_plan(model: nn.Module) -> None:
    """After tiekit re-tied ``model`` to its kept plan (a conversion or an assign-load gave it new
    tensors, and the re-tie registered them): the plan holds for the model as it is now."""
    kept: _Kept | None = model.__dict__.get(_SLOT)
    if kept is not None:
        model.__dict__[_SLOT] = replace(kept, registrations=_registrations[0])


def _count_registration(module: nn.Module, *_: Any) -> None:
    _registrations[0] += 1
    module.__dict__[_STAMP] = _registrations[0]


def _latest_registration(module: nn.Module) -> int:
    """The count at ``module``'s latest registration (0: none seen)."""
    stamp: int = module.__dict__.get(_STAMP, 0)
    return stamp


def _watch_registrations() -> None:
    if _hook_handles:
        return
    from torch.nn.modules import module as torch_module

    with _hooks_installed:
        if not _hook_handles:
            _hook_handles.extend(
                register(_count_registration)
                for register in (
                    torch_module.register_module_parameter_registration_hook,
                    torch_module.register_module_buffer_registration_hook,
                    torch_module.register_module_module_registration_hook,
                )
            )
