"""`find_ties`: walk a module tree once and record every name that aliases another.

Three kinds of alias are found:

* the same tensor object under several names (``layer_3.weight = layer_1.weight``, a submodule
  registered twice, a ModuleList holding one block several times), by identity;
* distinct tensor objects whose memory overlaps (a buffer that is ``w.t()``, ``w[:, :k]`` or
  ``w.view(...)``), by comparing byte ranges of the tensors' data; recorded with their view
  geometry so they can be rebuilt on another device;
* optionally, ties declared by the model (``{target: source}``) and not present in memory yet.

Identity works on every device, meta and XLA included. Memory overlap is only visible where a
tensor has a data pointer (CPU, CUDA); on meta and XLA such views cannot be seen, which is why a
plan is made *before* a move.
"""

from __future__ import annotations

import hashlib
import itertools
import operator
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from tiekit import devices
from tiekit.declared_groups import checked_declared, merge_declared
from tiekit.errors import TieError, TieWarning
from tiekit.plan import (
    MemberKind,
    ReinterpretingView,
    TieGroup,
    TieMember,
    TiePlan,
    ViewGeometry,
    dtype_name,
    strided_extent,
)
from tiekit.slots import Walk, walk_slots

# (name, kind, tensor, registration index) of the first name under which a tensor was met
_Slot = tuple[str, MemberKind, torch.Tensor, int]


def find_ties(
    model: nn.Module,
    *,
    buffers: bool = True,
    trace: bool = False,
    check_values: bool = False,
    declared: Mapping[str, str] | None = None,
    example_inputs: tuple[Any, ...] | None = None,
) -> TiePlan:
    """Return the `TiePlan` of ``model``: every group of names that share a tensor or its memory.

    ``buffers`` includes buffers as well as parameters. ``trace`` records, per group, the graph
    nodes that read it and the tensors read outside their owning module, with ``torch.fx`` (or
    ``torch.export`` when ``example_inputs`` is given). ``check_values`` also reports distinct
    tensors with bit-identical values, the trace a move leaves when it broke a tie.
    ``declared`` adds ties the model declares as ``{target: source}`` names.
    """
    checked_declared(declared)
    walk = walk_slots(model, buffers=buffers)
    distinct, extra = _identities(walk)
    shared = _shared_storages(walk.tensors, distinct)
    first = _slots_at(walk, set(extra).union(*shared))
    groups, reinterpreting = _identity_and_storage_groups(first, extra, shared)
    _warn_of_hidden_views(shared, first)
    unique_params = _unique_parameters(walk, extra)
    if declared:
        groups, unique_params = merge_declared(model, walk, groups, declared, unique_params)
    groups.sort(key=lambda pair: pair[0])
    tie_groups = [g for _, g in groups]
    suspected: tuple[tuple[str, ...], ...] = ()
    if check_values:
        suspected = _suspected_broken_ties(_slots_at(walk, set(distinct)), {n for g in tie_groups for n in g.names[1:]})
    plan = TiePlan(
        groups=tuple(tie_groups),
        unique_count=unique_params,
        total_count=walk.kinds.count("parameter"),
        suspected=suspected,
        reinterpreting=tuple(reinterpreting),
    )
    if trace:
        from tiekit.trace import trace_uses

        plan = trace_uses(model, plan, example_inputs)
    return plan


def reinterpreting_views(model: nn.Module) -> tuple[ReinterpretingView, ...]:
    """The tensors of ``model`` that view another's memory in another dtype (local; the walk
    `find_ties` makes, without its warnings): a plan read from JSON cannot carry them."""
    walk = walk_slots(model, buffers=True)
    distinct, extra = _identities(walk)
    shared = _shared_storages(walk.tensors, distinct)
    if not shared:
        return ()
    _, reinterpreting = _identity_and_storage_groups(_slots_at(walk, set(extra).union(*shared)), extra, shared)
    return tuple(reinterpreting)


def _identities(walk: Walk) -> tuple[list[int], dict[int, list[tuple[str, MemberKind]]]]:
    """Positions of the first name of every distinct tensor, and, keyed by that position,
    the other (name, kind) pairs of each tensor met under several names."""
    ids = list(map(id, walk.tensors))
    repeated = _repeated(ids)
    if not repeated:  # the common case for all but a handful of tensors
        return list(range(len(ids))), {}
    first_at: dict[int, int] = {}
    extra: dict[int, list[tuple[str, MemberKind]]] = {}
    keep = [True] * len(ids)
    for i in itertools.compress(range(len(ids)), map(repeated.__contains__, ids)):
        first = first_at.setdefault(ids[i], i)
        if first != i:
            extra.setdefault(first, []).append((walk.name(i), walk.kinds[i]))
            keep[i] = False
    return list(itertools.compress(range(len(ids)), keep)), extra


def _unique_parameters(walk: Walk, extra: dict[int, list[tuple[str, MemberKind]]]) -> int:
    """Distinct tensors registered under at least one parameter name."""
    count = walk.kinds.count("parameter")
    for first, names in extra.items():
        as_parameter = (walk.kinds[first] == "parameter") + sum(k == "parameter" for _, k in names)
        count -= max(as_parameter - 1, 0)
    return count


def _slots_at(walk: Walk, positions: set[int]) -> dict[int, _Slot]:
    """(name, kind, tensor, registration index) of the names at ``positions``, in order."""
    return {i: (walk.name(i), walk.kinds[i], walk.tensors[i], i) for i in sorted(positions)}


def _shared_storages(tensors: list[torch.Tensor], distinct: list[int]) -> list[list[int]]:
    """Positions of distinct tensors that live in one storage, one list per such storage."""
    try:
        storages = [tensors[i].untyped_storage()._cdata for i in distinct]
    except Exception:  # noqa: BLE001 - lazy, sparse or exotic tensors: ask one by one
        known = [(key, i) for i in distinct if (key := devices.storage_key(tensors[i])) is not None]
        storages, distinct = [key for key, _ in known], [i for _, i in known]
    repeated = _repeated(storages)
    by_storage: dict[int, list[int]] = {}
    if repeated:  # the common case is that nothing shares memory
        for storage, i in zip(storages, distinct, strict=True):
            if storage in repeated:
                by_storage.setdefault(storage, []).append(i)
    return list(by_storage.values())


def _repeated(values: list[int]) -> set[int]:
    """The values that occur more than once, found by sorting for the reason given on `tiekit.slots.Walk`
    (ids and storage addresses arrive nearly sorted, so timsort makes one sequential sweep)."""
    ordered = sorted(values)
    return set(itertools.compress(ordered, map(operator.eq, ordered, itertools.islice(ordered, 1, None))))


def count_parameters(model: nn.Module) -> int:
    """``len(list(model.parameters()))`` without building names or a generator chain: the
    count check runs after every move, so it must cost far less than the move."""
    seen: set[int] = set()
    params: set[int] = set()
    add = params.add
    stack: list[nn.Module | None] = [model]
    while stack:
        module = stack.pop()
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        for p in module._parameters.values():
            if p is not None:
                add(id(p))
        stack.extend(module._modules.values())
    return len(params)


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """Byte range [start, end) of the tensor's elements within its storage; None if empty."""
    if t.numel() == 0:
        return None
    start = int(t.storage_offset()) * t.element_size()
    extent = strided_extent(tuple(t.shape), tuple(t.stride()))
    return start, start + int(extent) * t.element_size()


def _identity_and_storage_groups(
    first: dict[int, _Slot], extra: dict[int, list[tuple[str, MemberKind]]], shared: list[list[int]]
) -> tuple[list[tuple[int, TieGroup]], list[ReinterpretingView]]:
    """The identity and view groups, and the views in another dtype that no group can hold."""
    clusters = [c for keys in shared for c in _overlapping_clusters(keys, first)]
    in_cluster = {key for cluster in clusters for key in cluster}
    groups = [_identity_group(key, first, extra) for key in extra if key not in in_cluster]
    reinterpreting: list[ReinterpretingView] = []
    for cluster in clusters:
        index, group, others = _view_group(cluster, first, extra)
        if len(group.members) > 1:  # not when every other tensor of the cluster was left out
            groups.append((index, group))
        reinterpreting.extend(view for view, _ in others)
        # A left-out tensor registered under several names is still one tensor under them.
        groups.extend(_identity_group(key, first, extra) for _, key in others if key in extra)
    return groups, reinterpreting


def _identity_group(
    key: int, first: dict[int, _Slot], extra: dict[int, list[tuple[str, MemberKind]]]
) -> tuple[int, TieGroup]:
    """The group of the names under which the tensor first met at ``key`` is registered."""
    name, kind, t, index = first[key]
    names = extra[key]
    if is_lazy(t):
        raise TieError(
            f"{name!r} is tied to {names[0][0]!r} but is an uninitialized lazy parameter: "
            "run one forward pass (or initialize the lazy modules) before planning ties"
        )
    group_kind = "parameter" if isinstance(t, nn.Parameter) else "buffer"
    slots = [(name, kind), *names]
    if group_kind == "parameter":  # a Parameter also registered as a buffer: a parameter slot is the source
        slots.sort(key=lambda slot: slot[1] != "parameter")
    members = tuple(TieMember(n, k) for n, k in slots)
    return index, TieGroup(slots[0][0], members, group_kind, tuple(t.shape), dtype_name(t.dtype))  # type: ignore[arg-type]


def _warn_of_hidden_views(shared: list[list[int]], first: dict[int, _Slot]) -> None:
    """Distinct tensors of one XLA storage are views whose tie the plan cannot record (see
    `_overlapping_clusters`); said aloud, since a move or save planned from it stores them apart."""
    for keys in shared:
        if any(devices.hides_view_geometry(first[k][2]) for k in keys):
            names = ", ".join(first[k][0] for k in sorted(keys))
            warnings.warn(
                f"{names} share one XLA storage (views of one another), but XLA hides view geometry, so "
                "this plan leaves their tie out and a move or save planned from it stores them apart: "
                "make the plan with tiekit.find_ties before the model goes to XLA and pass it as plan=",
                TieWarning,
                stacklevel=3,
            )


def _overlapping_clusters(keys: list[int], first: dict[int, _Slot]) -> list[list[int]]:
    """Split tensors of one storage into groups whose elements overlap."""
    if any(devices.hides_view_geometry(first[k][2]) for k in keys):
        # Views are found when the plan is made before the move, as it should be.
        return []
    spans: list[tuple[int, int, int]] = []
    for key in keys:
        span = _span(first[key][2])
        if span is not None:
            spans.append((span[0], span[1], key))
    spans.sort()
    clusters: list[list[int]] = []
    current: list[int] = []
    end = -1
    for start, stop, key in spans:
        if start < end:
            current.append(key)
            end = max(end, stop)
        else:
            if len(current) > 1:
                clusters.append(current)
            current, end = [key], stop
    if len(current) > 1:
        clusters.append(current)
    return clusters


def _view_group(
    cluster: list[int], first: dict[int, _Slot], extra: dict[int, list[tuple[str, MemberKind]]]
) -> tuple[int, TieGroup, list[tuple[ReinterpretingView, int]]]:
    """The view group of one cluster of overlapping tensors, and the tensors of the cluster
    left out of it because they view the source's memory in another dtype (with their keys)."""
    cluster = sorted(cluster, key=lambda k: first[k][3])
    spans = {k: _span(first[k][2]) for k in cluster}
    lo = min(s[0] for s in spans.values() if s)
    hi = max(s[1] for s in spans.values() if s)
    # The source must hold every element of the shared memory contiguously, so that the
    # other members can be rebuilt as strided views of it once it lives on another device.
    covering = [k for k in cluster if spans[k] == (lo, hi) and first[k][2].is_contiguous()]
    # A parameter first: the names tied to it by identity are then plain members, and the
    # optimizer's state is stored under a parameter's name.
    covering.sort(key=lambda k: first[k][1] != "parameter")
    source_key = covering[0] if covering else cluster[0]
    src_name, src_kind, src, _ = first[source_key]
    members = [TieMember(n, k) for n, k in [(src_name, src_kind), *extra.get(source_key, ())]]
    reinterpreting: list[tuple[ReinterpretingView, int]] = []
    for key in cluster:
        if key == source_key:
            continue
        name, kind, t, _ = first[key]
        if t.dtype != src.dtype:
            # A reinterpreting view (w.view(torch.int32)) cannot be rebuilt with as_strided, nor
            # recorded in a plan's JSON; recorded on the plan, for a move to refuse it.
            view = ReinterpretingView(name, src_name, dtype_name(t.dtype), dtype_name(src.dtype))
            reinterpreting.append((view, key))
            continue
        geometry = ViewGeometry(
            offset=int(t.storage_offset()) - int(src.storage_offset()),
            size=tuple(t.shape),
            stride=tuple(t.stride()),
        )
        grad = bool(t.requires_grad) and isinstance(t, nn.Parameter)
        for n, k in [(name, kind), *extra.get(key, ())]:
            members.append(TieMember(n, k, geometry, grad))
    index = min(first[k][3] for k in cluster)
    group = TieGroup(src_name, tuple(members), "view", tuple(src.shape), dtype_name(src.dtype))
    return index, group, reinterpreting


def _suspected_broken_ties(first: dict[int, _Slot], tied: set[str]) -> tuple[tuple[str, ...], ...]:
    # Only tensors that share shape and dtype can be broken copies of one another, so hash
    # just those buckets; constant tensors (fresh LayerNorm weights, zero biases) are equal
    # by construction, not by a broken tie, and are left out.
    buckets: dict[tuple[tuple[int, ...], torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for name, _, t, _ in first.values():
        if name in tied or is_lazy(t) or t.is_meta or t.layout != torch.strided or t.numel() < 2:
            continue
        buckets.setdefault((tuple(t.shape), t.dtype), []).append((name, t))
    found: list[tuple[str, ...]] = []
    for candidates in buckets.values():
        if len(candidates) < 2:
            continue
        by_hash: dict[bytes, list[tuple[str, torch.Tensor]]] = {}
        for name, t in candidates:
            host = t.detach().to("cpu").contiguous().reshape(-1)
            if bool((host == host[0]).all()):
                continue
            digest = hashlib.blake2b(host.view(torch.uint8).numpy().tobytes(), digest_size=16).digest()
            by_hash.setdefault(digest, []).append((name, host))
        for same in by_hash.values():
            if len(same) > 1 and all(torch.equal(same[0][1], h) for _, h in same[1:]):
                found.append(tuple(n for n, _ in same))
    return tuple(sorted(found))
