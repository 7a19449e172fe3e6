"""What the ranks of a run must agree on about their models: tensor names, shapes, dtypes and ties.

Replicas and FSDP2 ranks each hold the model, and a rank whose model differs (its ties lost by a
move without tiekit, another configuration) breaks what every rank assumes: a sharded save would
commit rank 0's description over tensors some ranks hold differently (a checkpoint that loads
wrongly or not at all, in place of the previous one), and FSDP2's collectives would pair
tensors of different sizes (gloo aborts the process, nccl may hang). The ranks compare a digest
of their `description` in an exchange they make anyway; the descriptions themselves cross only
when the digests differ, to name what differs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from tiekit.analyze import find_ties
from tiekit.collective import collective_gather
from tiekit.errors import TiekitError
from tiekit.plan import TiePlan, dtype_name

_SHOWN = 3  # differences named per rank and kind; the rest are counted

#: A rank's side of the comparison: its tie groups (names, source first) and ``{name: [shape, dtype]}``.
Description = tuple[list[list[str]], dict[str, list[Any]]]


def description(plan: TiePlan, tensors: Mapping[str, list[Any]]) -> Description:
    """This rank's side: ``plan``'s tie groups and ``tensors`` (``{name: [shape, dtype]}``). Local."""
    return sorted(list(g.names) for g in plan.groups), dict(tensors)  # sorted: digests ignore the order


def model_description(plan: TiePlan, model: torch.nn.Module) -> Description:
    """`description` of ``model``'s state (every name, tied ones too; global shapes). Local."""
    state = model.state_dict(keep_vars=True)
    return description(plan, {k: [_shape(t), dtype_name(t.dtype)] for k, t in state.items()})


def _shape(t: torch.Tensor) -> list[int] | None:
    """``t``'s shape; None for a lazy module's parameter, which has none until its first forward."""
    return None if is_lazy(t) else list(t.shape)


def digest(side: Description) -> str:
    """A short digest of ``side``: equal on ranks that agree. Local."""
    text = json.dumps(side, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def collective_check_same_model(model: torch.nn.Module, plan: TiePlan | None = None) -> None:
    """Collective: every rank calls it. Check that every rank holds the same model: the same
    names, shapes and dtypes in its state and the same ties (``plan``, else `find_ties`). Where a
    rank differs, every rank raises `TiekitError` naming the ranks, tie groups and keys.

    Call it before `tiekit.shard` when each rank builds its own model (under torchrun): FSDP2
    checks nothing, and a rank whose tie a move broke pairs tensors of different sizes in the
    first forward's collectives (over gloo the processes abort; over nccl they may hang). One
    exchange of a short digest; the ranks' descriptions cross only when digests differ. `fit`
    makes this check itself.
    """
    side = model_description(find_ties(model) if plan is None else plan, model)
    digests = collective_gather(digest(side), operation="collective_check_same_model")
    if len(set(digests)) > 1:  # every rank sees it: all take part below
        raise TiekitError(f"the ranks hold different models: {disagreement(collective_gather(side))}")


def disagreement(descriptions: list[Description]) -> str:
    """How each rank's description differs from rank 0's, naming the keys and tie groups (local)."""
    ties0, tensors0 = descriptions[0]
    told: list[str] = []
    for rank, (ties, tensors) in enumerate(descriptions[1:], start=1):
        told += _ties(rank, ties0, ties) + _tensors(rank, tensors0, tensors)
    return "; ".join(told)


def _ties(rank: int, ties0: list[list[str]], ties: list[list[str]]) -> list[str]:
    def shown(groups: list[list[str]]) -> str:
        listed = [" = ".join(g) for g in groups[:_SHOWN]]
        return ", ".join(listed) + _more(len(groups))

    only0 = [g for g in ties0 if g not in ties]
    only = [g for g in ties if g not in ties0]
    told = []
    if only0:
        told.append(f"rank 0 ties {shown(only0)}, rank {rank} does not (moved or loaded without tiekit there?)")
    if only:
        told.append(f"rank {rank} ties {shown(only)}, rank 0 does not")
    return told


def _tensors(rank: int, tensors0: dict[str, list[Any]], tensors: dict[str, list[Any]]) -> list[str]:
    def keys(names: list[str]) -> str:
        return ", ".join(repr(k) for k in names[:_SHOWN]) + _more(len(names))

    def layout(value: list[Any]) -> str:
        return f"{'(not yet initialized)' if value[0] is None else tuple(value[0])} {value[1]}"

    missing = [k for k in tensors0 if k not in tensors]
    added = [k for k in tensors if k not in tensors0]
    changed = [k for k in tensors0 if k in tensors and tensors[k] != tensors0[k]]
    told = []
    if missing:
        told.append(f"rank {rank} holds no {keys(missing)}")
    if added:
        told.append(f"rank {rank} holds {keys(added)}, rank 0 does not")
    for k in changed[:_SHOWN]:
        told.append(f"key {k!r} is {layout(tensors[k])} on rank {rank}, {layout(tensors0[k])} on rank 0")
    if len(changed) > _SHOWN:
        told.append(f"{len(changed) - _SHOWN} more keys differ in shape or dtype on rank {rank}")
    return told


def _more(count: int) -> str:
    return f" and {count - _SHOWN} more" if count > _SHOWN else ""
