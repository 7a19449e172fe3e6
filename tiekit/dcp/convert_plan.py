"""The tie plan a `tiekit.convert` destination records: the source's, with the ties of a given
plan or model added where they name stored keys (merged with the recorded ones they share a
name with, never undoing one)."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from tiekit.analyze import find_ties
from tiekit.checkpoint.contents import stored_only
from tiekit.declarations import declared_ties
from tiekit.errors import CheckpointError
from tiekit.plan import TieGroup, TiePlan


def recorded_plan(
    given: TiePlan | nn.Module | None, recorded: TiePlan | None, where: str, keys: set[str]
) -> TiePlan | None:
    """The plan the destination records: the source's with ``given``'s ties added (`_with_ties`);
    None when neither says anything (a plain DCP folder or safetensors file): the destination
    records no plan either, so a loader takes the model's ties and accepts their equal copies, as
    for the source. An empty plan would say "no ties", which a tied model's loader refuses.
    ``keys``: the source's stored tensors, which ``given``'s ties must name (`_naming_stored`)."""
    if isinstance(given, nn.Module):
        ties = find_ties(given, declared=declared_ties(given) or None)
        given = stored_only(ties, set(given.state_dict(keep_vars=True)))
    if given is not None:
        given = _naming_stored(given, keys, where)
    if given is None or recorded is None:
        return given if given is not None else recorded
    return _with_ties(recorded, given, where)


def _naming_stored(given: TiePlan, keys: set[str], where: str) -> TiePlan:
    """``given`` without the groups none of whose names the source stores: a recorded group naming
    no stored key makes the destination unreadable ("the plan names a key the file lacks"). If no
    group is left of a plan that had some, its names are not the source's (a ``dcp.save`` of
    ``{"model": state_dict}`` stores ``model.embed.weight``): `CheckpointError` naming both."""
    kept = tuple(g for g in given.groups if any(name in keys for name in g.names))
    if given.groups and not kept:
        names = ", ".join(repr(n) for g in given.groups[:3] for n in g.names[:2])
        sample = ", ".join(repr(k) for k in sorted(keys)[:3])
        raise CheckpointError(
            f"{where}: stores none of the tied names of the given plan or model ({names}); its keys look like "
            f"{sample}. Give a model (or plan) whose names are the checkpoint's keys; nothing was written"
        )
    return replace(given, groups=kept)


def _with_ties(recorded: TiePlan, given: TiePlan, where: str) -> TiePlan:
    """``recorded`` plus the ties of ``given``: a given group that shares a name with recorded
    groups is merged with them (`_merged`: the union of their names, under the recorded source,
    which the source stores); one that shares none is added. So a recorded tie is never undone
    (the source stores its names once: untying one would lose it) and every name ``given`` ties
    is tied. Whether the merged names' stored values are equal is checked when they are read."""
    groups = list(recorded.groups)
    for group in given.groups:
        touched = [g for g in groups if set(g.names) & set(group.names)]
        if not touched:
            groups.append(group)
            continue
        at = groups.index(touched[0])
        groups[at] = _merged(touched, group, where)
        groups = [g for g in groups if g not in touched[1:]]
    return replace(recorded, groups=tuple(groups))


def _merged(touched: list[TieGroup], group: TieGroup, where: str) -> TieGroup:
    """The recorded groups ``touched`` and the given ``group`` as one group under the first's
    source. Every source is one tensor with that source when the groups meet at a name that is
    that very tensor (not a view) in both, so each member keeps its view geometry; a meeting at a
    view only cannot be said in one group: `CheckpointError` naming the source ``where`` and the names."""
    base = touched[0]
    same = _identical_names(group)
    for other in touched:
        if not same & _identical_names(other):
            raise CheckpointError(
                f"{where}: the model ties {', '.join(group.names)} and the source records "
                f"{', '.join(other.names)} tied, meeting only at a view of the tied tensor: convert cannot "
                "merge the two ties; give a plan without the model's"
            )
    # A name in two groups keeps the recorded relation (the base's first): what the file was saved with.
    member = {m.name: m for g in (group, *reversed(touched)) for m in g.members}
    ordered = [member[name] for name in dict.fromkeys(n for g in (*touched, group) for n in g.names)]
    uses = tuple(dict.fromkeys(u for g in (*touched, group) for u in g.uses))
    kind = "view" if any(m.view is not None for m in ordered) else base.kind
    return replace(base, members=tuple(ordered), kind=kind, uses=uses)


def _identical_names(group: TieGroup) -> set[str]:
    """The names of ``group`` that are its tensor itself, not a view of it (its source's included)."""
    return {m.name for m in group.members if m.view is None or m.name == group.source}
