"""What a tied checkpoint stores: the plan (the model's ties, and the declared ones its tensors
still agree with), one tensor per tie group, host copies safetensors accepts, the header, and a
training checkpoint's tensors and record. Local; `CheckpointError` on what cannot be stored."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from tiekit import devices
from tiekit.analyze import find_ties
from tiekit.checkpoint.codec import Fallback, encode
from tiekit.checkpoint.deferred import local_part
from tiekit.checkpoint.layout import PLAN_KEY, nbytes
from tiekit.checkpoint.optimizer import optimizer_record
from tiekit.errors import CheckpointError, TieError
from tiekit.header import DTYPE_CODES
from tiekit.mixin import TPUMixin
from tiekit.plan import TiePlan
from tiekit.retie import tie_changes
from tiekit.slots import resolve


def saving_plan(model: nn.Module) -> TiePlan:
    """The model's ties, plus the declared ties that hold in its current tensors.

    A declared tie whose two tensors differ (a tie broken by a move, then trained) is left
    out: dropping one of them would lose data. The file then records two tensors.
    """
    declared = declared_ties_holding(model)
    try:
        plan = find_ties(model, declared=declared or None)
    except TieError as exc:
        raise CheckpointError(f"cannot save {type(model).__name__}: {exc}") from exc
    return stored_only(plan, set(model.state_dict(keep_vars=True)))


def stored_only(plan: TiePlan, stored: set[str]) -> TiePlan:
    """``plan`` without the names the file does not store (non-persistent buffers, such as a
    rotary ``inv_freq`` one module shares with every layer): a group records the names that
    read its stored tensor. A group whose source is not stored goes whole (its views are
    relative to it); its stored members are then saved each under its own name."""
    groups = []
    for group in plan.groups:
        if group.source not in stored:
            continue
        members = tuple(m for m in group.members if m.name in stored)
        if len(members) > 1:
            groups.append(group if len(members) == len(group.members) else replace(group, members=members))
    if len(groups) == len(plan.groups):
        return plan
    return replace(plan, groups=tuple(groups))


def declared_ties_holding(model: nn.Module) -> dict[str, str]:
    """The model's declared ties (`declared_ties`) whose two tensors are one, or equal in value:
    a tie a plain move broke, not one trained apart (tying those would lose data). Local."""
    return {t: s for t, s in declared_ties(model).items() if _same_values(model, t, s)}


def _same_values(model: nn.Module, target: str, source: str) -> bool:
    a, b = resolve(model, target)[2], resolve(model, source)[2]
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype or a.is_meta or b.is_meta or a.device != b.device:
        return False
    if getattr(a, "placements", None) != getattr(b, "placements", None):
        return False  # sharded differently (or one not at all): kept apart, nothing lost
    # Local: torch.equal of two DTensors is an all-reduce, which a rank whose tie alone is broken
    # would start by itself (every other rank found the tie whole), and wait in for good. Each
    # rank compares its shards; ranks that conclude differently save different plans, which the
    # sharded save refuses on every rank.
    with torch.no_grad():
        return bool(torch.equal(local_part(a), local_part(b)))


def declared_ties(model: nn.Module) -> dict[str, str]:
    """``{target: source}`` ties the model declares: ``TPUMixin.tied_weights`` and transformers'
    ``_tied_weights_keys`` (expanded, restricted to names that exist in the model). A
    ``tied_weights`` name that does not resolve is a `CheckpointError`, as it is a `TieError`
    when the module moves. Through ``torch.compile``'s wrapper, the wrapped model's, under its
    ``_orig_mod.`` names (the wrapper forwards the attribute, but its names carry the prefix)."""
    inner = model._modules.get("_orig_mod") if isinstance(model, nn.Module) else None
    if inner is not None and len(model._modules) == 1 and not model._parameters and not model._buffers:
        return {f"_orig_mod.{t}": f"_orig_mod.{s}" for t, s in declared_ties(inner).items()}
    declared: dict[str, str] = {}
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    if callable(expand):
        with contextlib.suppress(TypeError, AttributeError, KeyError, ValueError, RuntimeError):
            found = expand(all_submodels=True)
            if isinstance(found, Mapping):
                declared.update({t: s for t, s in found.items() if isinstance(t, str) and isinstance(s, str)})
    if isinstance(model, TPUMixin):
        for target, source in model.tied_weights.items():
            if not isinstance(target, str) or not isinstance(source, str):
                raise CheckpointError(f"{type(model).__name__}.tied_weights maps names to names; got {target!r}")
            try:
                resolve(model, target, "declared tie target (tied_weights)")
                resolve(model, source, "declared tie source (tied_weights)")
            except TieError as exc:
                raise CheckpointError(f"{type(model).__name__}: {exc}") from exc
        declared.update(model.tied_weights)
    out = {}
    for target, source in declared.items():
        try:
            a, b = resolve(model, target)[2], resolve(model, source)[2]
        except TieError:
            continue
        if a.shape == b.shape and a.dtype == b.dtype:
            out[target] = source
    return out


def unique_tensors(model: nn.Module, plan: TiePlan) -> tuple[list[str], list[torch.Tensor]]:
    """The names to store (each group's source once, every untied name) and their tensors."""
    state = model.state_dict(keep_vars=True)
    names: list[str] = []
    seen: set[str] = set()
    for name in state:
        key = plan.source_of(name)
        if key not in seen:
            seen.add(key)
            names.append(key)
    for group in plan.groups:
        if group.source in seen:
            try:
                tie_changes(model, group)  # retie's checks of names, shapes and dtypes: the file can be re-tied
            except TieError as exc:
                raise CheckpointError(f"cannot save {type(model).__name__}: {exc}") from exc
    tensors = []
    for name in names:
        tensor = state[name] if name in state else resolve(model, name)[2]
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"cannot save {type(model).__name__}: state {name!r} is a {type(tensor).__name__}, not a tensor"
            )
        if tensor.is_meta:
            raise CheckpointError(f"cannot save {type(model).__name__}: {name!r} is on the meta device (no data)")
        if tensor.layout != torch.strided or tensor.dtype not in DTYPE_CODES:
            raise CheckpointError(
                f"cannot save {type(model).__name__}: {name!r} is a {tensor.layout} {tensor.dtype} tensor, "
                "which safetensors cannot store"
            )
        tensors.append(tensor.detach())
    return names, tensors


def host_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, non-overlapping copies where needed; XLA tensors in one batched transfer."""
    hosts = devices.to_host(list(tensors.values()))
    out = []
    storages: dict[int, list[tuple[int, int]]] = {}
    for t in hosts:
        if not t.is_contiguous():
            t = t.contiguous()
        if t.numel():
            # Names left out of the plan can still share memory (a reinterpreting view, two
            # slices of one buffer); safetensors refuses overlapping tensors, so store a copy.
            # Disjoint tensors of one storage (fit's state living in its file image) stay.
            start, end = t.data_ptr(), t.data_ptr() + nbytes(t)
            spans = storages.setdefault(t.untyped_storage().data_ptr(), [])
            if any(start < e and s < end for s, e in spans):
                t = t.clone()
            else:
                spans.append((start, end))
        out.append(t)
    return dict(zip(tensors, out, strict=True))


def header_metadata(metadata: Mapping[str, str] | None, plan: TiePlan) -> dict[str, str]:
    user = dict(metadata or {})
    for key, value in user.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise CheckpointError(f"metadata must map strings to strings; {key!r}: {value!r} does not")
        if key.startswith("tiekit.") or (key == "format" and value != "pt"):
            raise CheckpointError(f"metadata key {key!r} is reserved by tiekit")
    return {**user, "format": "pt", PLAN_KEY: plan.to_json()}


def encode_training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    values: Mapping[str, tuple[Any, str]],
    fallback: Fallback | None = None,
) -> tuple[TiePlan, dict[str, torch.Tensor], dict[str, Any]]:
    """What a training checkpoint holds, as the single-file and the sharded saves write it: the
    tie plan; the tensors (one per tie group, then the tensors of ``values`` and the optimizer
    state); and the JSON record: each of ``values`` (``key: (value, prefix of its tensors)``)
    encoded under its key, then ``"optimizer"``. Local; `CheckpointError` on what cannot be stored."""
    plan = saving_plan(model)
    names, tensors = unique_tensors(model, plan)
    side: dict[str, torch.Tensor] = {}
    record: dict[str, Any] = {
        key: encode(value, prefix, side, fallback=fallback) for key, (value, prefix) in values.items()
    }
    record["optimizer"] = None if optimizer is None else optimizer_record(optimizer, model, plan, side)
    clash = sorted(set(names) & set(side))
    if clash:
        raise CheckpointError(f"cannot save {type(model).__name__}: parameter names {clash} clash with optimizer keys")
    return plan, {**dict(zip(names, tensors, strict=True)), **side}, record
