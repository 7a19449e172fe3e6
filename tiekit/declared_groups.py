"""Ties a model declares (``{target: source}`` names) joined to the ties `find_ties` found in
memory: a declared target's group follows its source, chains are followed by slot. Local."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from tiekit.errors import TieError
from tiekit.plan import TieGroup, TieMember, dtype_name
from tiekit.slots import Walk, resolve


def checked_declared(declared: object, where: str = "") -> None:
    """`TieError` naming ``where`` (a function) unless ``declared`` is None or a mapping."""
    if declared is not None and not isinstance(declared, Mapping):
        raise TieError(
            f"{where + ': ' if where else ''}declared maps tied names to their sources ({{target: source}}), "
            f"not a {type(declared).__name__}"
        )


def _slot(model: nn.Module, name: str, what: str) -> tuple[int, str]:
    """The slot ``name`` names in ``model``: its owning module (by identity) and attribute."""
    owner, attr, _, _ = resolve(model, name, what)
    return id(owner), attr


def _same_slot(model: nn.Module, member: TieMember, owner: nn.Module, attr: str) -> bool:
    """Whether ``member`` names the slot ``attr`` of ``owner`` (the same module object), not a view."""
    found_owner, found_attr, _, _ = resolve(model, member.name)
    return member.view is None and found_owner is owner and found_attr == attr


def merge_declared(
    model: nn.Module,
    walk: Walk,
    groups: list[tuple[int, TieGroup]],
    declared: Mapping[str, str],
    unique_params: int,
) -> tuple[list[tuple[int, TieGroup]], int]:
    """``groups`` (``(registration index, group)`` pairs `find_ties` detected) with each declared
    ``{target: source}`` tie joined to its source's group, and the unique parameter count less the
    targets that were distinct tensors. `TieError` on a name that does not resolve, a shape or dtype
    that differs, a cycle, or a detected tie the declaration would overwrite."""
    by_name = {n: i for i, (_, g) in enumerate(groups) for n in g.names}
    merged: set[int] = set()  # detected groups whose names joined a declared source's group
    order = {walk.name(i): i for i in range(len(walk.tensors))}  # registration index, as groups use
    for target, source in declared.items():
        if not isinstance(target, str) or not isinstance(source, str):
            raise TieError(f"declared ties map names to names; got {target!r}: {source!r}")
    # Chains a -> b -> c are followed by slot, not by name: a source may name a declared target's
    # slot under another name (its module registered twice), in whatever order they are declared.
    declared_at = {_slot(model, t, "declared tie target"): t for t in declared}
    for target, source in declared.items():
        target_slot = _slot(model, target, "declared tie target")
        seen = {target_slot}
        while (next_target := declared_at.get(slot := _slot(model, source, "declared tie source"))) is not None:
            if slot == target_slot and len(seen) == 1:
                break  # the target's own slot under another name: nothing to follow
            if slot in seen:
                raise TieError(f"declared ties form a cycle through {source!r}")
            seen.add(slot)
            source = declared[next_target]
        target_owner, target_attr, target_t, target_kind = resolve(model, target, "declared tie target")
        _, _, source_t, source_kind = resolve(model, source, "declared tie source")
        for name in (target, source):
            if name not in order:  # found through a wrapper's attribute forwarding, not by its names
                raise TieError(
                    f"declared tie {target!r} -> {source!r}: {type(model).__name__} has no tensor named {name!r} "
                    "(a wrapper forwarded the name to the model it wraps: name the tensors as the wrapper does)"
                )
        if target_t.shape != source_t.shape or target_t.dtype != source_t.dtype:
            raise TieError(
                f"declared tie {target!r} -> {source!r}: {target!r} is {_describe(target_t)} but "
                f"{source!r} is {_describe(source_t)}"
            )
        target_group = by_name.get(target)
        source_group = by_name.get(source)
        if target_group is not None and target_group == source_group:
            continue
        if target_t is not source_t and target_kind == "parameter":
            unique_params -= 1
        members: tuple[TieMember, ...] = (TieMember(target, target_kind),)
        first = order[target]
        if target_group is not None:
            # Names of the target's own slot (its module registered twice: a wrapper's self.head
            # = model.lm_head) follow the declared source, as they do when transformers'
            # tie_weights sets the module's weight. Another module sharing the tensor is a tie of
            # its own, which the declaration would overwrite.
            index, detected = groups[target_group]
            other = next(
                (m.name for m in detected.members if not _same_slot(model, m, target_owner, target_attr)), None
            )
            if other is not None:
                raise TieError(
                    f"declared tie {target!r} -> {source!r} conflicts with the detected tie {target!r} = {other!r}"
                )
            members, first = detected.members, min(first, index)
            merged.add(target_group)
        if source_group is None:
            group = TieGroup(
                source,
                (TieMember(source, source_kind), *members),
                "parameter" if isinstance(source_t, nn.Parameter) else "buffer",
                tuple(source_t.shape),
                dtype_name(source_t.dtype),
            )
            groups.append((min(order[source], first), group))
            source_group = by_name[source] = len(groups) - 1
        else:
            index, group = groups[source_group]
            group = TieGroup(group.source, (*group.members, *members), group.kind, group.shape, group.dtype)
            groups[source_group] = (min(index, first), group)
        by_name.update((m.name, source_group) for m in members)
    return [g for i, g in enumerate(groups) if i not in merged], unique_params


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {dtype_name(t.dtype)}"
