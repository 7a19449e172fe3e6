"""What a `tiekit.preserve_ties` block gave the tied names, and which tensor each tie keeps.

A tie that was one tensor when the block began and is split when it ends was split by the
block: ``.to(xla)`` (torch wraps the converted tensor in a new Parameter per owner: the same
memory), ``to_empty``, a ``load_state_dict(state, assign=True)``, a module replaced. `retie`
would point every name at the source's tensor, dropping whatever the block gave the others. So,
per tie, from what the block replaced:

- only the source, or nothing: the others held the old values; retie drops nothing;
- tied names but not the source (a state dict holding ``lm_head.weight`` but not
  ``transformer.wte.weight``): the tie takes the tensor the block gave, as `TPUMixin`'s loads do;
- the source and tied names: one tensor if they share memory or hold equal values; different
  values are a `TieError` (the model left as the block made it), unless the source was on the
  meta device when the block began (new memory initialised name by name: nothing to lose).

Ties split before the block, and views, are tied as asked (the source's values win). Local.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tiekit import devices
from tiekit.errors import TieError
from tiekit.plan import TieGroup, TiePlan
from tiekit.retie import tensor_difference, tie_changes
from tiekit.slots import assign, resolve


@dataclass(frozen=True)
class TensorsAtEntry:
    """The tensor each name of a tie held when the block began. Held, not weakly referenced:
    torch's swap_tensors refuses a tensor with a weak reference, and an id alone may be taken by a
    new tensor once the old one is freed. Holding them raises no peak: they existed at entry."""

    held: dict[str, torch.Tensor]
    on_meta: frozenset[str]  # sources of the ties that were on the meta device


def tensors_at_entry(model: nn.Module, plan: TiePlan) -> TensorsAtEntry:
    """What the names of ``plan``'s whole ties hold now (a tie already split is left out)."""
    held: dict[str, torch.Tensor] = {}
    on_meta: set[str] = set()
    for group in plan.groups:
        if tie_changes(model, group):
            continue
        for member in group.members:
            if member.view is None:
                tensor = resolve(model, member.name)[2]
                held[member.name] = tensor
                if member.name == group.source and tensor.is_meta:
                    on_meta.add(group.source)
    return TensorsAtEntry(held, frozenset(on_meta))


def keep_what_the_block_gave(model: nn.Module, plan: TiePlan, entry: TensorsAtEntry) -> None:
    """Before `retie`: point each tie's source at the tensor the block gave its other names when
    it left the source as it was; `TieError` when the block gave the source and another name
    different values (see the module docstring)."""
    for group in plan.groups:
        if group.source not in entry.held:
            continue
        split = [member for *_, member in tie_changes(model, group) if member.view is None]
        if not split:
            continue
        module, attr, source, kind = resolve(model, group.source)
        given = [(m.name, t) for m in split if entry.held[m.name] is not (t := resolve(model, m.name)[2])]
        if not given:
            continue
        if entry.held[group.source] is not source:
            if group.source not in entry.on_meta:
                _refuse_different(group, [(group.source, source), *given])
            continue
        _refuse_different(group, given)
        taken = given[0][1]
        if kind == "parameter" and not isinstance(taken, nn.Parameter):
            taken = nn.Parameter(taken, requires_grad=source.requires_grad)
        assign(module, attr, taken, kind)


def _refuse_different(group: TieGroup, given: list[tuple[str, torch.Tensor]]) -> None:
    (first, held), *others = given
    for name, tensor in others:
        if _differ(tensor, held):
            raise TieError(
                f"tiekit.preserve_ties: inside the block {first!r} and {name!r}, tied (source {group.source!r}), "
                f"were given different values (a state dict holding the two apart?): one tensor can hold only "
                f"one of them. The model is left as the block made it, the tie split; tiekit.retie(model, plan) "
                f"keeps {group.source!r}'s values"
            )


def _differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold different values, as far as a local look can tell: tensors
    over one storage (on XLA too, without a copy to the host) hold the same; tensors on other
    devices, or sharded apart, are not compared."""
    if a is b:
        return False
    if not devices.memory_visible(a) and (a.shape, a.dtype) == (b.shape, b.dtype):
        key = devices.storage_key(a)  # where memory is visible, tensor_difference compares pointers
        if key is not None and key == devices.storage_key(b):
            return False
    return tensor_difference(a, b) == "values"
