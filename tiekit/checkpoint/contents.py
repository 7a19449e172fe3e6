"""What a tied checkpoint stores: the plan (the model's ties, and the declared ones its tensors
still agree with), one tensor per tie group, host copies safetensors accepts, the header, and a
training checkpoint's tensors and record. Local; `CheckpointError` on what cannot be stored."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from tiekit import devices
from tiekit.analyze import find_ties
from tiekit.checkpoint.codec import Fallback, encode
from tiekit.checkpoint.layout import PLAN_KEY, nbytes
from tiekit.checkpoint.optimizer import optimizer_record
from tiekit.declarations import declared_ties_holding
from tiekit.errors import CheckpointError, TieError, TieWarning, user_stacklevel
from tiekit.header import DTYPE_CODES
from tiekit.mixin import mixin_ties_outside
from tiekit.plan import TiePlan
from tiekit.retie import tie_changes
from tiekit.slots import resolve


def saving_plan(model: nn.Module) -> TiePlan:
    """The model's ties, plus the declared ties that hold in its current tensors.

    A declared tie whose two tensors differ (a tie broken by a move, then trained) is left
    out: dropping one of them would lose data. The file then records two tensors; for a tie a
    `TPUMixin` declares (which a fresh model of its class holds, so the file will not load into
    one), with a `TieWarning` saying so.
    """
    declared = declared_ties_holding(model)
    try:
        plan = find_ties(model, declared=declared or None)
    except TieError as exc:
        raise CheckpointError(f"cannot save {type(model).__name__}: {exc}") from exc
    _warn_of_unheld_mixin_ties(model, plan)
    return stored_only(plan, set(model.state_dict(keep_vars=True)))


def _warn_of_unheld_mixin_ties(model: nn.Module, plan: TiePlan) -> None:
    unheld = [f"{target} -> {source}" for target, source in mixin_ties_outside(model, plan)]
    if unheld:
        warnings.warn(
            f"{type(model).__name__} declares ties (TPUMixin.tied_weights) its tensors do not hold, with different "
            f"values: {'; '.join(unheld)}. They are saved as separate tensors, which a model that holds the tie (a "
            f"new {type(model).__name__}, or this one after tie_weights() or a move) cannot load. Call "
            "model.tie_weights() before saving to store one copy (the source's values)",
            TieWarning,
            stacklevel=user_stacklevel(),
        )


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
                f"{_extra_state_hint(model, name)}"
            )
        if tensor.is_meta:
            raise CheckpointError(f"cannot save {type(model).__name__}: {name!r} is on the meta device (no data)")
        if tensor.layout != torch.strided or tensor.dtype not in DTYPE_CODES:
            raise CheckpointError(
                f"cannot save {type(model).__name__}: {name!r} is a {tensor.layout} {tensor.dtype} tensor, "
                "which safetensors cannot store (tiekit's sharded checkpoints keep to its dtypes too, so that "
                "each converts to a safetensors file)"
            )
        tensors.append(tensor.detach())
    return names, tensors


def _extra_state_hint(model: nn.Module, name: str) -> str:
    """Why a state-dict value is no tensor when it is a module's ``get_extra_state``."""
    path, _, last = name.rpartition(".")
    if last != "_extra_state":
        return ""
    try:
        owner = type(model.get_submodule(path)).__name__
    except AttributeError:
        return ""
    return (
        f": {owner}.get_extra_state returned it, and tiekit's checkpoints store a module's extra state only "
        "as a tensor (safetensors holds tensors); return one, such as a uint8 tensor of its serialised bytes"
    )


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


def header_metadata(metadata: Mapping[str, str] | None, plan: TiePlan, call: str = "") -> dict[str, str]:
    if metadata is not None and not isinstance(metadata, Mapping):
        where = f"{call}: " if call else ""
        raise CheckpointError(f"{where}metadata must map strings to strings (a dict), not a {type(metadata).__name__}")
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
