"""Apply a `TiePlan` after a move (`retie`), check it before (`fitting_plan`) and after
(`verify`), and tell whether a model still holds it (`still_holds`).

`tiekit.moving` wraps these around a conversion for models you cannot subclass;
`tiekit.TPUMixin` does the same inside ``nn.Module._apply`` for models you can.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from tiekit import devices
from tiekit.analyze import count_parameters
from tiekit.errors import TieError, TieWarning
from tiekit.plan import ReinterpretingView, TieGroup, TieMember, TiePlan, checked_plan
from tiekit.slots import assign, resolve

OnError = Literal["raise", "warn"]


def retie(model: nn.Module, plan: TiePlan, *, replacing: Collection[str] = ()) -> tuple[str, ...]:
    """Point every member of every group of ``plan`` at its source's current tensor.

    View members are rebuilt as strided views of the source. Returns the names that were
    re-pointed. Raises `TieError` (before changing anything) when a name no longer resolves or
    its shape or dtype no longer matches. The members named in ``replacing`` take the source's
    dtype whatever theirs is (the tied names a state dict assigned to the model left out: their
    tensors are the model's old ones, the source's is the loaded one).
    """
    changes: list[tuple[nn.Module, str, torch.Tensor, TieMember]] = []
    replaced = frozenset(replacing)
    for group in checked_plan(plan).groups:
        changes.extend(lasting_tie_changes(model, group, replacing=replaced))
    # Names of one tensor that is a view (a weight tied to another, both over a buffer's memory)
    # are members with one geometry: they get one rebuilt tensor, and stay one.
    rebuilt: dict[tuple[object, ...], torch.Tensor] = {}
    with torch.no_grad():
        for module, attr, source, member in changes:
            key = (id(source), member.view, member.kind, member.requires_grad)
            tensor = source if member.view is None else rebuilt.get(key)
            if tensor is None:
                tensor = rebuilt[key] = _rebuild_view(source, member)
            assign(module, attr, tensor, member.kind)
    return tuple(member.name for _, _, _, member in changes)


def fitting_plan(model: nn.Module, plan: TiePlan, *, counted: bool = True) -> TiePlan:
    """``plan``, checked against ``model`` before anything changes: every name resolves, shapes
    and dtypes fit (the checks `retie` makes, without re-pointing anything), no tensor views a
    source's memory in another dtype (a conversion would make it a copy), and (``counted``) the
    model will hold the plan's parameter count once tied; `TieError` if not. ``counted=False``
    leaves the count to `verify` after the move (``on_error="warn"`` warns of it there)."""
    changes = [change for group in checked_plan(plan).groups for change in lasting_tie_changes(model, group)]
    if counted:
        _refuse_another_models_plan(model, plan, changes)
    for view in plan.reinterpreting:
        raise TieError(
            f"{view.name!r} ({view.dtype}) views the memory of {view.source!r} ({view.source_dtype}) in another "
            f"dtype: a view is rebuilt from its source in the source's dtype, so after a conversion {view.name!r} "
            f"would be a tensor of its own, no longer sharing {view.source!r}'s memory. Nothing was converted; "
            f"make {view.name!r} a copy (.clone()) or view {view.source!r} again after the conversion"
        )
    return plan


def _refuse_another_models_plan(
    model: nn.Module, plan: TiePlan, changes: list[tuple[nn.Module, str, torch.Tensor, TieMember]]
) -> None:
    """`TieError` unless ``model`` holds ``plan.unique_count`` parameters once ``changes`` are made.

    Names and shapes can fit a plan of a model with a layer more or less; the parameter count
    after the move then tells, but only after the conversion."""
    if not changes:
        after = count_parameters(model)
    else:
        holders: dict[str, object] = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}
        for _, _, source, member in changes:
            if member.kind == "parameter" and member.name in holders:
                # A view member becomes a Parameter of its own, one per geometry of its source.
                holders[member.name] = id(source) if member.view is None else (id(source), member.view)
        after = len(set(holders.values()))
    if after != plan.unique_count:
        raise TieError(
            f"the plan counts {plan.unique_count} distinct parameters, {type(model).__name__} would hold {after} "
            "once tied as the plan says: a plan of another model, or of this one before parameters were added or "
            "removed. Nothing was converted; plan again with tiekit.find_ties(model)"
        )


def tie_changes(
    model: nn.Module, group: TieGroup, *, replacing: frozenset[str] = frozenset()
) -> list[tuple[nn.Module, str, torch.Tensor, TieMember]]:
    """The re-pointings `retie` makes for ``group`` (module, attribute, source, member), after
    checking that it can make them all; `TieError` if not. ``replacing``: as `retie`'s."""
    _, _, source, source_kind = resolve(model, group.source, f"tie source of group {group.source!r}:")
    if tuple(source.shape) != group.shape:
        raise TieError(f"tie source {group.source!r} has shape {tuple(source.shape)}, the plan expects {group.shape}")
    changes = []
    for member in group.members[1:]:
        module, attr, current, _ = resolve(model, member.name, f"tied name (source {group.source!r}):")
        expected = group.shape if member.view is None else member.view.size
        if tuple(current.shape) != expected:
            raise TieError(
                f"{member.name!r} has shape {tuple(current.shape)}, expected {expected} to tie it to {group.source!r}"
            )
        if current.dtype != source.dtype and member.name not in replacing:
            raise TieError(f"{member.name!r} is {current.dtype} but its tie source {group.source!r} is {source.dtype}")
        if member.view is None:
            if member.kind == "parameter" and not isinstance(source, nn.Parameter):
                raise TieError(f"parameter {member.name!r} is tied to {group.source!r}, which is not a parameter")
            if current is not source:
                changes.append((module, attr, source, member))
        else:
            if not source.is_contiguous():
                raise TieError(f"cannot rebuild view {member.name!r}: its source {group.source!r} is not contiguous")
            view = member.view
            # A plan built in Python skips from_dict's checks; as_strided would refuse a
            # negative stride only in retie's second pass, after earlier members were re-pointed.
            if min((*view.size, *view.stride), default=0) < 0:
                raise TieError(
                    f"cannot rebuild view {member.name!r}: the plan gives it size {view.size} and "
                    f"stride {view.stride}; negative sizes and strides are not supported"
                )
            if view.offset < 0 or view.end > source.numel():
                raise TieError(
                    f"cannot rebuild view {member.name!r}: it reaches outside its source {group.source!r} "
                    "(no named tensor covers the shared memory)"
                )
            if not is_view_of(current, source, member):
                changes.append((module, attr, source, member))
    del source_kind
    return changes


def lasting_tie_changes(
    model: nn.Module, group: TieGroup, *, replacing: frozenset[str] = frozenset()
) -> list[tuple[nn.Module, str, torch.Tensor, TieMember]]:
    """`tie_changes`, and `TieError` when a parameter to re-point is one FSDP2 manages apart from
    its source (the tie broke before ``fully_shard``): FSDP2 would put its own parameter back at
    the next forward, so the re-tie would not last (`tiekit.sharding.check.refuse_split_by_fsdp`)."""
    changes = tie_changes(model, group, replacing=replacing)
    if any(member.view is None and member.kind == "parameter" for *_, member in changes):
        from tiekit.sharding.check import refuse_split_by_fsdp  # the sharding package imports this module

        refuse_split_by_fsdp(model, group)
    return changes


def _rebuild_view(source: torch.Tensor, member: TieMember) -> torch.Tensor:
    assert member.view is not None
    # Detached, as the user built it (`w.detach().t()`): a view that required grad would
    # drag the source's autograd history into every step that reads the buffer.
    view = member.view.view_of(source.detach())
    if member.kind == "parameter":
        return nn.Parameter(view, requires_grad=member.requires_grad)
    return view


def is_view_of(t: torch.Tensor, source: torch.Tensor, member: TieMember) -> bool:
    """Whether ``t`` is ``source``'s view at the geometry ``member`` records (on XLA, which hides
    geometry: a tensor of the view's shape over the same storage)."""
    assert member.view is not None
    if devices.memory_visible(t) and devices.memory_visible(source):
        return (
            tuple(t.stride()) == member.view.stride
            and t.data_ptr() == source.data_ptr() + member.view.offset * source.element_size()
        )
    # XLA has no data pointers and reports every tensor as contiguous, but a view still
    # shares its base's (functional) storage object.
    key = devices.storage_key(t)
    return tuple(t.shape) == member.view.size and key is not None and key == devices.storage_key(source)


def member_holds(model: nn.Module, member: TieMember, source: torch.Tensor) -> bool:
    """Whether ``member`` is its group's ``source`` tensor (or the view of it the plan records)."""
    _, _, current, _ = resolve(model, member.name)
    return current is source if member.view is None else is_view_of(current, source, member)


def still_holds(model: nn.Module, plan: TiePlan) -> bool:
    """Whether ``model`` still holds the ties of ``plan`` as they were planned, so that a cached
    plan may be reused: every name resolves, every source has the plan's shape, every identity
    member is its source and every view member is still a view of its source at its geometry.

    One look-up per tied name, no walk of the model. A view is checked by its geometry where
    memory is visible, and on XLA (which hides geometry) by its storage: after ``w.data = new``
    a buffer that was a view of ``w`` no longer shares w's storage there either, and a plan
    reused then would rebuild it from w's new memory on the next move.
    """
    for group in plan.groups:
        try:
            _, _, source, _ = resolve(model, group.source)
            if tuple(source.shape) != group.shape:
                return False
            if not all(member_holds(model, member, source) for member in group.members[1:]):
                return False
        except TieError:  # a module or tensor deleted without a registration (del model.head)
            return False
    return all(_still_shares(model, view) for view in plan.reinterpreting)


def _still_shares(model: nn.Module, view: ReinterpretingView) -> bool:
    """Whether a view in another dtype still shares its source's memory (a move refuses it)."""
    try:
        _, _, tensor, _ = resolve(model, view.name)
        _, _, source, _ = resolve(model, view.source)
    except TieError:
        return False
    return devices.storage_key(tensor) == devices.storage_key(source)


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of `verify`: parameter counts before (the plan's) and after, and broken ties."""

    before: int
    after: int
    broken: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """True when every tie holds and the parameter count is unchanged."""
        return not self.broken and self.before == self.after

    def __bool__(self) -> bool:
        return self.ok

    @property
    def message(self) -> str:
        """The user-facing explanation, empty when ``ok``."""
        if self.ok:
            return ""
        lines = [
            "tiekit: tied weights are no longer shared. The model parameters do not match "
            f"the tie plan. Before: {self.before} After: {self.after}."
        ]
        lines.extend(f"  {b}" for b in self.broken)
        lines.append(
            "Re-tie after moving with tiekit.retie(model, plan), or move with tiekit.move(...) / "
            "TPUMixin; see docs/ties.md#when-the-check-fires."
        )
        return "\n".join(lines)


def checked_on_error(on_error: object, where: str) -> OnError:
    """``on_error`` if it is "raise" or "warn"; a `TieError` naming ``where`` otherwise. Checked
    before anything moves: a misspelling found by the final check would come after the move."""
    if on_error not in ("raise", "warn"):
        raise TieError(f"{where}: on_error must be 'raise' or 'warn', not {on_error!r}")
    return on_error


def verify(model: nn.Module, plan: TiePlan, *, on_error: OnError = "raise") -> VerifyReport:
    """Check that every group of ``plan`` is one tensor again and the parameter count is the plan's.

    On failure raises `TieError` (``on_error="raise"``) or warns with `TieWarning` ("warn").
    """
    checked_on_error(on_error, "tiekit.verify")
    broken: list[str] = []
    for group in checked_plan(plan).groups:
        try:
            _, _, source, _ = resolve(model, group.source, "tie source")
        except TieError as exc:
            broken.append(str(exc))
            continue
        if tuple(source.shape) != group.shape:  # a plan of another model: its ties cannot be these
            broken.append(f"{group.source} has shape {tuple(source.shape)}, the plan expects {group.shape}")
            continue
        for member in group.members[1:]:
            try:
                _, _, current, _ = resolve(model, member.name, "tied name")
            except TieError as exc:
                broken.append(str(exc))
                continue
            if member.view is None and current is not source:
                broken.append(f"{member.name} is not {group.source}")
            elif member.view is not None and not is_view_of(current, source, member):
                broken.append(f"{member.name} is not a view of {group.source}")
    after = count_parameters(model)
    report = VerifyReport(plan.unique_count, after, tuple(broken))
    if not report.ok:
        if on_error == "raise":
            raise TieError(report.message)
        warnings.warn(report.message, TieWarning, stacklevel=2)
    return report


def tensor_difference(entry: torch.Tensor, expected: torch.Tensor) -> str:
    """How ``entry`` differs from ``expected`` ("" if not): dtype, shape, device or value."""
    for what, a, b in (("dtype", entry.dtype, expected.dtype), ("shape", tuple(entry.shape), tuple(expected.shape))):
        if a != b:
            return f"{what} {a} and {b}"
    if entry.device != expected.device:
        return f"device {entry.device} and {expected.device}"
    if entry.is_meta:
        return ""  # a meta entry has no values to differ
    if hasattr(entry, "to_local") or hasattr(expected, "to_local"):
        # DTensors (FSDP2): this rank's shards, compared where both are sharded alike; a
        # comparison of the whole tensors would wait for the other ranks.
        layouts = [(getattr(t, "device_mesh", None), getattr(t, "placements", None)) for t in (entry, expected)]
        if layouts[0] != layouts[1]:
            return "sharding"
        entry, expected = entry.to_local(), expected.to_local()  # type: ignore[attr-defined]
    if _same_elements(entry, expected):
        return ""
    # Compared as bytes: tied weights holding NaN are still equal.
    entry_bytes, expected_bytes = (t.detach().cpu().reshape(-1).view(torch.uint8) for t in (entry, expected))
    return "" if torch.equal(entry_bytes, expected_bytes) else "values"


def _same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (of one dtype and shape) lie on the same memory, as the entries of a
    tied tensor in ``model.state_dict()`` do: equal without reading them. (A wrapper subclass
    reports a data pointer of 0 whatever it wraps: that says nothing.)"""
    return (
        devices.memory_visible(a)
        and devices.memory_visible(b)
        and a.data_ptr() != 0
        and a.data_ptr() == b.data_ptr()
        and a.stride() == b.stride()
    )
