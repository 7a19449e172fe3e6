"""Apply a `TiePlan` after a move (`retie`), check it (`verify`), and the two wrappers users call.

`move` and `preserve_ties` are for models you cannot subclass; `tiekit.TPUMixin` does the
same inside ``nn.Module._apply`` for models you can.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from tiekit import devices
from tiekit.analyze import count_parameters, find_ties
from tiekit.errors import TieError, TieWarning
from tiekit.plan import ReinterpretingView, TieGroup, TieMember, TiePlan
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
    for group in _a_plan(plan).groups:
        changes.extend(tie_changes(model, group, replacing=replaced))
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


def _a_plan(plan: object) -> TiePlan:
    if not isinstance(plan, TiePlan):
        raise TieError(
            f"plan must be a TiePlan (tiekit.find_ties(model), or TiePlan.from_json), not a {type(plan).__name__}"
        )
    return plan


def fitting_plan(model: nn.Module, plan: TiePlan) -> TiePlan:
    """``plan``, checked against ``model`` before anything changes: every name resolves, shapes
    and dtypes fit (the checks `retie` makes, without re-pointing anything), and no tensor views
    a source's memory in another dtype (a conversion would make it a copy); `TieError` if not."""
    for group in _a_plan(plan).groups:
        tie_changes(model, group)
    for view in plan.reinterpreting:
        raise TieError(
            f"{view.name!r} ({view.dtype}) views the memory of {view.source!r} ({view.source_dtype}) in another "
            f"dtype: a view is rebuilt from its source in the source's dtype, so after a conversion {view.name!r} "
            f"would be a tensor of its own, no longer sharing {view.source!r}'s memory. Nothing was converted; "
            f"make {view.name!r} a copy (.clone()) or view {view.source!r} again after the conversion"
        )
    return plan


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
            if not _is_view_of(current, source, member):
                changes.append((module, attr, source, member))
    del source_kind
    return changes


def _rebuild_view(source: torch.Tensor, member: TieMember) -> torch.Tensor:
    assert member.view is not None
    v = member.view
    # Detached, as the user built it (`w.detach().t()`): a view that required grad would
    # drag the source's autograd history into every step that reads the buffer.
    view = source.detach().as_strided(v.size, v.stride, source.storage_offset() + v.offset)
    if member.kind == "parameter":
        return nn.Parameter(view, requires_grad=member.requires_grad)
    return view


def _is_view_of(t: torch.Tensor, source: torch.Tensor, member: TieMember) -> bool:
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
            for member in group.members[1:]:
                _, _, current, _ = resolve(model, member.name)
                if member.view is None:
                    if current is not source:
                        return False
                elif not _is_view_of(current, source, member):
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


def verify(model: nn.Module, plan: TiePlan, *, on_error: OnError = "raise") -> VerifyReport:
    """Check that every group of ``plan`` is one tensor again and the parameter count is the plan's.

    On failure raises `TieError` (``on_error="raise"``) or warns with `TieWarning` ("warn").
    """
    if on_error not in ("raise", "warn"):
        raise ValueError(f"on_error must be 'raise' or 'warn', not {on_error!r}")
    broken: list[str] = []
    for group in _a_plan(plan).groups:
        try:
            _, _, source, _ = resolve(model, group.source, "tie source")
        except TieError as exc:
            broken.append(str(exc))
            continue
        for member in group.members[1:]:
            try:
                _, _, current, _ = resolve(model, member.name, "tied name")
            except TieError as exc:
                broken.append(str(exc))
                continue
            if member.view is None and current is not source:
                broken.append(f"{member.name} is not {group.source}")
            elif member.view is not None and not _is_view_of(current, source, member):
                broken.append(f"{member.name} is not a view of {group.source}")
    after = count_parameters(model)
    report = VerifyReport(plan.unique_count, after, tuple(broken))
    if not report.ok:
        if on_error == "raise":
            raise TieError(report.message)
        warnings.warn(report.message, TieWarning, stacklevel=2)
    return report


def move(
    model: nn.Module,
    device: torch.device | str | int | None = None,
    dtype: torch.dtype | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    plan: TiePlan | None = None,
    on_error: OnError = "raise",
) -> nn.Module:
    """Move/cast ``model`` keeping its ties: plan, ``.to``, retie, verify. Returns ``model``.

    Each tensor object is converted once, however many modules register it: a tied weight
    crosses to the device once and never exists twice there.

    ``device="xla"`` means this process's XLA device. With ``optimizer``, its param groups and
    state are re-bound, by name, to the moved parameters.
    """
    if device is None and dtype is None:
        raise ValueError("tiekit.move needs a device, a dtype or both")
    target = devices.resolve_device(device)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TieError(f"tiekit.move: optimizer must be a torch.optim.Optimizer, not a {type(optimizer).__name__}")
    # A plan made here is checked too: one retie could not apply must refuse before anything moves.
    plan = fitting_plan(model, _moving_plan(model, None) if plan is None else plan)
    names = {id(p): n for n, p in model.named_parameters()} if optimizer is not None else {}
    kwargs: dict[str, object] = {}
    if target is not None:
        kwargs["device"] = target
    if dtype is not None:
        kwargs["dtype"] = dtype
    with converting_once(model):
        model.to(**kwargs)  # type: ignore[call-overload]
    retie(model, plan)
    verify(model, plan, on_error=on_error)
    if optimizer is not None:
        rebind_optimizer(optimizer, model, names)
    return model


def _moving_plan(model: nn.Module, declared: Mapping[str, str] | None) -> TiePlan:
    """The ties ``model`` holds, the ones it declares (``TPUMixin.tied_weights``, transformers'
    ``_tied_weights_keys``) where their tensors are equal in value (a tie a plain ``.to`` broke
    before: the move restores it), and ``declared``."""
    from tiekit.checkpoint.contents import declared_ties_holding  # the checkpoint package imports this one
    from tiekit.errors import CheckpointError

    try:
        holding = declared_ties_holding(model)
    except CheckpointError as exc:  # a tied_weights name that does not resolve
        raise TieError(str(exc)) from exc
    merged = {**holding, **(declared or {})}
    return find_ties(model, declared=merged or None)


def once_per_tensor(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn`` (a conversion ``nn.Module._apply`` calls per slot), called once per tensor object:
    a tensor met again under another module's name gets the first result. torch calls ``fn``
    once per owning module, so a tied weight would be copied to the device once per owner."""
    if getattr(fn, "_tiekit_once", False):
        return fn
    results: dict[int, torch.Tensor] = {}
    converted: set[int] = set()  # the storages of new outputs, held (in results) until the end

    def convert(t: torch.Tensor) -> torch.Tensor:
        # A tensor over the memory of an output is converted already: the output itself met
        # again (a module registered twice), the Parameter torch made over it, a tensor that
        # swap_tensors gave it to. Returned as it is: a conversion is not always idempotent.
        memory = devices.storage_key(t)
        if memory is not None and memory in converted:
            return t
        # Keyed by id without holding the old tensor (holding every one would keep the whole
        # unconverted model alive until the end; swap_tensors refuses weak references). A freed
        # input's id can go to a new object, but during one _apply the new objects are outputs
        # and Parameters over them, which the check above has answered.
        out = results.get(id(t))
        if out is None:
            out = results[id(t)] = fn(t)
            made = devices.storage_key(out)
            if out is not t and made is not None and made != memory:
                converted.add(made)
        return out

    convert._tiekit_once = True  # type: ignore[attr-defined]
    return convert


@contextmanager
def converting_once(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s conversions (``.to``, ``.to_empty``, ``.bfloat16()``...) go
    through `once_per_tensor`; ``nn.Module._apply`` passes the wrapped function on to every
    submodule. (`tiekit.TPUMixin` does the same in its own ``_apply``.)"""
    original = model._apply

    def apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        return original(once_per_tensor(fn), recurse)  # type: ignore[no-untyped-call,no-any-return]

    model.__dict__["_apply"] = apply  # an instance attribute shadows the method for this block only
    try:
        yield
    finally:
        model.__dict__.pop("_apply", None)


def rebind_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, names: Mapping[int, str]) -> None:
    """Re-point ``optimizer``'s params and state at the model's current parameters.

    ``names`` maps ``id(old_param)`` to its name, taken before the move while the old
    parameters were alive. Names are looked up with their aliases, so two old tensors that
    are now one tied parameter (a declared tie applied by the move) become one entry: the one
    under the parameter's first name keeps its place and state, the duplicate goes (an
    optimizer holding a parameter twice would step it twice, and cannot be saved).
    """
    current = dict(model.named_parameters(remove_duplicate=False))
    first_name = {id(p): name for name, p in model.named_parameters()}
    # Which old tensor keeps each new parameter: the one under its first name, else the first met.
    keeper: dict[int, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names.get(id(p))
            if name is not None and name in current:
                new = current[name]
                if id(new) not in keeper or first_name.get(id(new)) == name:
                    keeper[id(new)] = id(p)
    state = optimizer.state
    unknown = 0
    for group in optimizer.param_groups:
        rebound = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None or name not in current:
                unknown += 1
                rebound.append(p)
                continue
            new = current[name]
            old_state = state.pop(p, None)
            if keeper[id(new)] != id(p):
                continue  # the duplicate of a tied parameter, and its stale state
            if old_state is not None:
                state[new] = {k: _state_to(v, new, k) for k, v in old_state.items()}
            rebound.append(new)
        group["params"] = rebound
    if unknown:
        warnings.warn(
            f"tiekit.move: the optimizer holds {unknown} tensor(s) that are not parameters of the "
            "model; they were left where they are and will not follow the move",
            TieWarning,
            stacklevel=3,
        )


def _state_to(value: object, param: torch.Tensor, key: str) -> object:
    # Same policy as Optimizer.load_state_dict: a CPU scalar `step` stays put; other
    # floating state follows the parameter's device and dtype.
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step" and value.dim() == 0 and value.device.type == "cpu":
        return value
    dtype = param.dtype if value.is_floating_point() else None
    return value.to(device=param.device, dtype=dtype)


@contextmanager
def preserve_ties(
    model: nn.Module,
    *,
    plan: TiePlan | None = None,
    declared: Mapping[str, str] | None = None,
    on_error: OnError = "raise",
) -> Iterator[TiePlan]:
    """Plan on entry; retie and verify on a normal exit. Yields the plan.

    For code that replaces tensors behind the model's back: ``.to(xla)``, ``to_empty``,
    ``load_state_dict(assign=True)``, third-party wrappers.
    """
    plan = fitting_plan(model, _moving_plan(model, declared) if plan is None else plan)
    with converting_once(model):
        yield plan
    retie(model, plan)
    verify(model, plan, on_error=on_error)
