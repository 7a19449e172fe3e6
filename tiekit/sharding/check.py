"""`check_sharding`: read FSDP2's unit assignment from a wrapped model and refuse units that split
a tie group, before the first step.

FSDP2 keeps its assignment in private state (read here on torch 2.9.1 and 2.14.1): every module a
``fully_shard`` call received is an ``FSDPModule`` whose ``_get_fsdp_state()`` holds the unit's
parameter group(s) (``_fsdp_param_group`` in 2.9, a list ``_fsdp_param_groups`` in 2.14), and
each ``FSDPParam`` there records the module slots it was registered under
(``_module_info``: module, name, and the other modules sharing it). Ties are named by module path,
because after wrapping the parameters are new DTensors: a tie split across units is no longer
visible by identity, which is why the plan should be made before wrapping.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiekit.analyze import find_ties
from tiekit.errors import TieError, TiekitError
from tiekit.plan import TieGroup, TiePlan, checked_plan
from tiekit.sharding.units import check_reads, within
from tiekit.slots import checked_module, resolve

NOT_SHARDED = "<not sharded by FSDP>"


@dataclass(frozen=True)
class Managed:
    """A parameter slot managed by FSDP: its unit's label and the FSDPParam (one per tensor)."""

    unit: str
    param: Any
    paths: tuple[str, ...] = ()  # the unit's module paths ("" for the root)


def fsdp_assignment(model: nn.Module) -> dict[str, Managed]:
    """``{parameter name: Managed}`` for every parameter slot of ``model`` an FSDP2 unit manages.

    Empty for a model no ``fully_shard`` touched. `TiekitError` for FSDP1 wrappers and for an FSDP2
    whose private state this tiekit cannot read. Local: reads attributes, never communicates.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    from tiekit.sharding.wrap import fsdp2

    FSDPModule = fsdp2()[0]
    paths: dict[int, list[str]] = {}
    fsdp1 = []
    states: dict[int, Any] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(path)
        if isinstance(module, FullyShardedDataParallel):
            fsdp1.append(path or "<root>")
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            states.setdefault(id(state), state)
    if fsdp1:
        raise TiekitError(
            f"check_sharding reads FSDP2 (fully_shard) units; {', '.join(fsdp1[:4])} is wrapped in FSDP1's "
            "FullyShardedDataParallel, whose flat parameters it cannot map to module paths"
        )
    out: dict[str, Managed] = {}
    for state in states.values():
        unit_paths = tuple(_first(paths, m) for m in _state_modules(state))
        label = " + ".join(p or "<root>" for p in unit_paths)
        for group in _param_groups(state):
            for fsdp_param in _fsdp_params(group):
                for module, attr in _slots_of(fsdp_param):
                    for path in paths.get(id(module), ()):
                        out[f"{path}.{attr}" if path else attr] = Managed(label, fsdp_param, unit_paths)
    return out


def _first(paths: dict[int, list[str]], module: nn.Module) -> str:
    found = paths.get(id(module))
    return found[0] if found else f"<{type(module).__name__} outside the model>"


def _internals(what: str) -> TiekitError:
    return TiekitError(
        f"check_sharding cannot read FSDP's unit assignment on torch {torch.__version__} ({what}); "
        "this tiekit was tested with torch 2.9.1 and 2.14.1"
    )


def _state_modules(state: Any) -> tuple[nn.Module, ...]:
    modules = getattr(state, "_modules", None)
    if modules is None:
        raise _internals("an FSDP state without _modules")
    return tuple(modules)


def _param_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)  # a list in torch 2.14
    if groups is not None:
        return list(groups)
    if not hasattr(state, "_fsdp_param_group"):
        raise _internals("an FSDP state without parameter groups")
    group = state._fsdp_param_group
    return [] if group is None else [group]


def _fsdp_params(group: Any) -> list[Any]:
    params = getattr(group, "fsdp_params", None)
    if params is None:
        raise _internals("a parameter group without fsdp_params")
    return list(params)


def _slots_of(fsdp_param: Any) -> Iterator[tuple[nn.Module, str]]:
    info = getattr(fsdp_param, "_module_info", None)
    if info is None:
        raise _internals("an FSDPParam without _module_info")
    yield info.module, info.param_name
    yield from zip(info.shared_modules, info.shared_param_names, strict=True)


def check_sharding(model: nn.Module, plan: TiePlan | None = None) -> None:
    """Raise `TieError` when FSDP2 units split a tie group: the owners of one tied tensor managed
    by different units, each of which would shard and update its own copy.

    For models wrapped by your own ``fully_shard`` calls or by a framework's FSDP2 support; call
    it after wrapping and before the first step. The message names each tied parameter and its
    unit (module paths). ``plan`` is ``tiekit.find_ties(model)`` made *before* wrapping, on the
    module passed here: a tie split across units is no longer one tensor afterwards. Without it,
    ties are read from the wrapped model: those FSDP kept (one sharded tensor), those torch
    records as split (the original parameter's id, kept by torch 2.14), and, on torch that keeps
    no such id (2.9), sharded parameters of different units whose local shards hold identical,
    non-constant values (the state a split tie is in before the first step). Also reported: a
    tie of the plan that is two tensors inside one unit (broken before wrapping), and a buffer
    that is a view of a sharded parameter (it no longer follows it), and, with a plan from
    ``find_ties(model, trace=True)``, a parameter read in the forward of a module outside its
    unit (``F.linear(h, self.embed.weight)`` in the root while ``embed`` is a unit). A model
    without FSDP2 units passes. Local: each rank reads its own model and shards, nothing is communicated.
    """
    checked_module(model, "tiekit.check_sharding")
    if plan is not None:
        checked_plan(plan, "tiekit.check_sharding")
    assignment = fsdp_assignment(model)
    if not assignment:
        return
    problems: list[tuple[str, str]] = []
    exact = plan is not None
    if plan is None:
        plan = find_ties(model, buffers=False)
    for group in plan.groups:
        names = [m.name for m in group.members if m.kind == "parameter"]
        for name in names:
            resolve(model, name, "tie plan name")  # a plan of another module: TieError naming it
        if group.kind == "view":
            problems.extend(("view", p) for p in _stale_views(group, assignment))
        elif len(names) > 1:
            problems.extend(_split(names, assignment, "were tied"))
    if not exact:
        for names, how in _split_without_plan(assignment):
            problems.extend(_split(names, assignment, how))
    check_reads(model, plan)
    for use in plan.cross_module:
        problems.extend(_read_outside(plan, use.name, use.reader, assignment))
    if problems:
        raise TieError(_message(problems))


def _assignment_if_any(model: nn.Module) -> dict[str, Managed]:
    """`fsdp_assignment`, or nothing where no FSDP2 model can exist yet (torch.distributed.fsdp
    never imported: the import is skipped) or where it cannot be read (FSDP1 wrappers, a torch
    without FSDP2): the refusals built on it are not theirs to judge."""
    if "torch.distributed.fsdp" not in sys.modules:
        return {}
    try:
        return fsdp_assignment(model)
    except TiekitError:
        return {}


def refuse_split_by_fsdp(model: nn.Module, *groups: TieGroup, across_units: bool = False) -> None:
    """`TieError` (`check_sharding`'s message) when FSDP2 manages parameters of one of ``groups``
    as separate tensors: re-tying them by pointing a module attribute at the source would not last,
    since FSDP2 puts its own parameter back at the next forward and trains each apart (a load
    into a model wrapped after its tie broke reported the tie restored and trained wrong).
    ``across_units``: only tensors of different units (a tie broken before wrapping, two tensors
    of one unit, passes). Local; nothing for a model no ``fully_shard`` touched."""
    assignment = _assignment_if_any(model)
    if not assignment:
        return
    problems: list[tuple[str, str]] = []
    for group in groups:
        names = [m.name for m in group.members if m.kind == "parameter" and m.view is None]
        problems.extend(p for p in _split(names, assignment, "are tied") if p[0] == "split" or not across_units)
    if problems:
        raise TieError(_message(problems))


def refuse_split_model_ties(model: nn.Module) -> None:
    """`refuse_split_by_fsdp` for every tie of ``model``, those it holds and those it declares
    (`tiekit.declarations.model_ties`, the ties a load re-ties), split across FSDP2 units:
    what `save_sharded` checks. Such units (your own ``fully_shard`` calls; torch before 2.13
    accepts them) train the tied names apart, and a save would write them as two tensors no model
    loads. A tie broken before wrapping is an untied model to FSDP2: saved as any untied model is
    when its two tensors share a unit, refused when a declared tie's (``tie_word_embeddings``)
    two tensors fall in different units, as the checkpoint would not load into the model that
    declares it.
    Local; nothing for a model no ``fully_shard`` touched (its declared ties are not even read)."""
    if _assignment_if_any(model):
        from tiekit.declarations import model_ties  # it imports this module (through tiekit.mixin)

        refuse_split_by_fsdp(model, *model_ties(model).groups, across_units=True)


def refuse_cast_after_first_forward(model: nn.Module, dtype: torch.dtype | None = None) -> None:
    """`TieError` when casting ``model`` to ``dtype`` would change a floating parameter that an
    FSDP2 unit has already run a forward with: FSDP2 fixes each parameter's dtype at its first
    forward (its all-gather buffers keep it), so the next forward after the cast fails deep in
    torch. ``dtype=None``: whether such a cast already happened (`preserve_ties` around your own
    ``.to``), saying how to undo it. Local; nothing for a model no ``fully_shard`` touched."""
    for name, managed in _assignment_if_any(model).items():
        fixed = getattr(managed.param, "orig_dtype", None)  # set by FSDP2 at the unit's first forward
        if fixed is None or not fixed.is_floating_point:
            continue
        now = getattr(getattr(managed.param, "sharded_param", None), "dtype", fixed)
        if dtype is not None and fixed != dtype:
            what = f"cannot cast {type(model).__name__} to {dtype}"
            undo = "Cast before the first forward (or before tiekit.shard)"
        elif dtype is None and now != fixed:
            what = f"{type(model).__name__} was cast to {now}"
            undo = f"Cast it back to {fixed} before the next forward, or cast before the first one"
        else:
            continue
        raise TieError(
            f"{what}: {name!r} is sharded by FSDP2 (unit {managed.unit}), which fixed its dtype ({fixed}) at "
            f"its first forward; after the cast the next forward would fail. {undo}, or compute in another "
            "dtype with fully_shard's mp_policy=MixedPrecisionPolicy(param_dtype=...)"
        )


def refuse_conversion_after_first_forward(model: nn.Module, convert: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """`refuse_cast_after_first_forward` for ``convert``, a conversion ``nn.Module._apply`` runs
    (``TPUMixin``'s ``.to``, ``.half()``...): the dtype it makes of each dtype FSDP2 fixed, found by
    converting an empty tensor of it on the parameter's device. A conversion that cannot run on
    one is left to run. Local; nothing for a model no ``fully_shard`` touched."""
    seen: set[tuple[torch.dtype, torch.device]] = set()
    for managed in _assignment_if_any(model).values():
        fixed = getattr(managed.param, "orig_dtype", None)
        device = getattr(getattr(managed.param, "sharded_param", None), "device", None)
        if fixed is None or not fixed.is_floating_point or device is None or (fixed, device) in seen:
            continue
        seen.add((fixed, device))
        try:
            made = convert(torch.empty(0, dtype=fixed, device=device)).dtype
        except Exception:  # noqa: BLE001 - the conversion itself will say what is wrong with it
            continue
        if made != fixed:
            refuse_cast_after_first_forward(model, made)


_ADVICE = {
    "split": "Put the modules that own one tied tensor in one unit (fully_shard([a, b]) before "
    "fully_shard(model)), or leave them all to the root; tiekit.shard(model) chooses such units. "
    "torch before 2.13 trains split units silently wrong; 2.13 and later refuse them at the first forward.",
    "broken": "Re-tie before wrapping: tiekit.preserve_ties around to_empty / load_state_dict(assign=True), "
    "tiekit.retie(model, plan), or tiekit.shard(model, plan=plan), which re-ties first.",
    "view": "Compute such views in forward (self.w.t()) instead of registering them as buffers.",
    "read": "Put a module that reads another module's weight in that weight's unit, or leave the weight to "
    "the root; tiekit.shard(model, plan=tiekit.find_ties(model, trace=True)) chooses such units.",
}


def _message(problems: list[tuple[str, str]]) -> str:
    kinds = dict.fromkeys(kind for kind, _ in problems)
    return "\n".join(
        [
            "tiekit: FSDP would shard and update tied weights as separate tensors:"
            if set(kinds) != {"read"}
            else "tiekit: FSDP would not gather a weight where it is read:",
            *(f"  {text}" for _, text in problems),
            *(_ADVICE[kind] for kind in kinds),
            "See docs/sharding.md.",
        ]
    )


def _split(names: list[str], assignment: dict[str, Managed], how: str) -> list[tuple[str, str]]:
    managed = [assignment.get(n) for n in names]
    if all(m is None for m in managed) or len({id(m.param) if m else None for m in managed}) == 1:
        return []
    units = [m.unit if m else NOT_SHARDED for m in managed]
    if len(set(units)) > 1:
        listed = ", ".join(f"{n} (unit {u!r})" for n, u in zip(names, units, strict=True))
        owners = ", ".join(dict.fromkeys(n.rpartition(".")[0] or "<root>" for n in names))
        return [("split", f"{listed} {how} but are managed by different units; one unit for: {owners}")]
    return [
        (
            "broken",
            f"{', '.join(names)} {how} but are separate tensors in unit {units[0]!r}: the tie broke before "
            "wrapping (to_empty, load_state_dict(assign=True) or a move without tiekit)",
        )
    ]


def _read_outside(plan: TiePlan, name: str, reader: str, assignment: dict[str, Managed]) -> list[tuple[str, str]]:
    """A parameter read in the forward of a module outside its unit (``plan.cross_module``, from
    ``find_ties(trace=True)``): FSDP gathers it only around its unit's forward."""
    group = plan.group_of(name)
    names = [m.name for m in group.members if m.kind == "parameter"] if group is not None else [name]
    for managed in (assignment[n] for n in names if n in assignment):
        if any(within(reader, p) for p in managed.paths):
            continue
        return [
            (
                "read",
                f"{name} (unit {managed.unit!r}) is read by the forward of {reader or '<root>'}, outside "
                "that unit: FSDP gathers it only around the unit's own forward",
            )
        ]
    return []


def _stale_views(group: TieGroup, assignment: dict[str, Managed]) -> list[str]:
    sharded = [m.name for m in group.members if m.name in assignment]
    if not sharded:
        return []
    views = [m.name for m in group.members if m.view is not None and m.name not in assignment]
    return [
        f"{v} is a view of {sharded[0]}, which FSDP replaced with a sharded tensor: it no longer follows it"
        for v in views
    ]


def _split_without_plan(assignment: dict[str, Managed]) -> list[tuple[list[str], str]]:
    """Tied tensors split across units, found without a plan: by the original parameter id torch
    records (2.14), else by identical local shards in different units."""
    by_param: dict[int, tuple[Any, list[str], str]] = {}
    for name, managed in assignment.items():
        by_param.setdefault(id(managed.param), (managed.param, [], managed.unit))[1].append(name)
    entries = list(by_param.values())
    if entries and all(hasattr(p, "_orig_param_uid") for p, _, _ in entries):
        by_uid: dict[int, list[str]] = {}
        for param, names, _ in entries:
            by_uid.setdefault(param._orig_param_uid, []).extend(names)
        return [(names, "were one parameter when wrapped") for names in by_uid.values() if len(names) > 1]
    return [(names, "hold identical values") for names in _identical_shards(entries)]


def _identical_shards(entries: list[tuple[Any, list[str], str]]) -> list[list[str]]:
    buckets: dict[tuple[Any, ...], list[tuple[torch.Tensor, list[str], str]]] = {}
    for param, names, unit in entries:
        sharded = param.sharded_param
        local = sharded.to_local() if hasattr(sharded, "to_local") else sharded
        if local.is_meta or local.numel() < 2:
            continue
        flat = local.detach().reshape(-1)
        head = flat[:64].to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        key = (tuple(sharded.shape), sharded.dtype, tuple(local.shape), head)
        buckets.setdefault(key, []).append((flat, names, unit))
    found: list[list[str]] = []
    for candidates in buckets.values():
        if len({unit for _, _, unit in candidates}) < 2:
            continue
        candidates = [c for c in candidates if not bool((c[0] == c[0][0]).all())]  # constants tie nothing
        while candidates:
            first, rest = candidates[0], candidates[1:]
            same = [c for c in rest if c[2] != first[2] and torch.equal(first[0], c[0])]
            if same:
                found.append([n for c in (first, *same) for n in c[1]])
            candidates = [c for c in rest if all(c is not s for s in same)]
    return found
