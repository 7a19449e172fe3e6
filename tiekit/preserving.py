"""What a `tiekit.preserve_ties` block gave the tied names, and which tensor each tie keeps.

A tie that was one tensor when the block began and is split when it ends was split by the
block: ``.to(xla)`` (torch wraps the converted tensor in a new Parameter per owner: the same
memory), ``to_empty``, a ``load_state_dict(state, assign=True)``, a module replaced. `retie`
would point every name at the source's tensor, dropping whatever the block gave the others.
A name counts as *given* a tensor when the block put a new one in its slot of the same module
(a load, ``module.weight = nn.Parameter(...)``); a module replaced as a whole (a new
``lm_head``, as transformers' ``resize_token_embeddings`` makes) gives nothing: the tie keeps
its source's values, as transformers' ``tie_weights`` does. Per tie:

- nothing given to the names tied to the source: retie drops nothing of the block's;
- given to such names while the source was left as it was (a state dict holding
  ``lm_head.weight`` but not ``transformer.wte.weight``): the tie takes the given tensor, as
  `TPUMixin`'s loads do (keeping the source's ``requires_grad``);
- given to them while the source was replaced too: one tensor if they share memory or hold equal
  values; different values are a `TieError` (the model left as the block made it), unless the
  source was on the meta device when the block began (new memory initialised name by name).

Ties split before the block, and views, are tied as asked (the source's values win). Local.
"""

from __future__ import annotations

import weakref
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
    """Which tensor each name of a whole tie held when the block began, and in which module.

    The tensors by id, not held: held, a tied embedding moved to XLA stayed in host memory until
    the block ended; weakly referenced, torch's ``swap_tensors`` refuses them. An id is taken
    again only by a tensor made after the old one was freed, which the block would have had to
    take out of its slot first. The modules are weakly referenced (nothing swaps a module)."""

    tensors: dict[str, int]
    owners: dict[str, weakref.ref[nn.Module]]
    on_meta: frozenset[str]  # sources of the ties that were on the meta device


def tensors_at_entry(model: nn.Module, plan: TiePlan) -> TensorsAtEntry:
    """What the names of ``plan``'s whole ties hold now (a tie already split is left out)."""
    tensors: dict[str, int] = {}
    owners: dict[str, weakref.ref[nn.Module]] = {}
    on_meta: set[str] = set()
    for group in plan.groups:
        if tie_changes(model, group):
            continue
        for member in group.members:
            if member.view is None:
                module, _, tensor, _ = resolve(model, member.name)
                tensors[member.name], owners[member.name] = id(tensor), weakref.ref(module)
                if member.name == group.source and tensor.is_meta:
                    on_meta.add(group.source)
    return TensorsAtEntry(tensors, owners, frozenset(on_meta))


def keep_what_the_block_gave(model: nn.Module, plan: TiePlan, entry: TensorsAtEntry) -> None:
    """Before `retie`: point each tie's source at the tensor the block gave its other names when
    it left the source as it was; `TieError` when the block gave the source and another name
    different values (see the module docstring)."""
    for group in plan.groups:
        if group.source not in entry.tensors:
            continue
        given = []
        for *_, member in tie_changes(model, group):
            if member.view is None:
                module, _, tensor, _ = resolve(model, member.name)
                if id(tensor) != entry.tensors[member.name] and entry.owners[member.name]() is module:
                    given.append((member.name, tensor))
        if not given:
            continue
        module, attr, source, kind = resolve(model, group.source)
        if id(source) != entry.tensors[group.source]:
            if group.source not in entry.on_meta:
                _refuse_different(group, [(group.source, source), *given])
            continue
        _refuse_different(group, given)
        taken = given[0][1]
        if kind == "parameter" and not isinstance(taken, nn.Parameter):
            taken = nn.Parameter(taken, requires_grad=source.requires_grad)
        elif taken.requires_grad != source.requires_grad and taken.is_leaf:
            taken.requires_grad_(source.requires_grad)  # a frozen tie stays frozen
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
    on one XLA buffer hold the same (no copy to the host; where memory is visible,
    `tensor_difference` compares pointers first); tensors on other devices, or sharded apart,
    are not compared."""
    if a is b:
        return False
    if (a.shape, a.dtype) == (b.shape, b.dtype) and devices.one_device_buffer(a, b):
        return False
    return tensor_difference(a, b) == "values"
