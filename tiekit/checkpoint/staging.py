"""Staging a load: validate everything against the model (names, shapes, dtypes, the file's ties
against the model's detected and declared ones) and change nothing; `tiekit.checkpoint.loading`
commits what this returns."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from tiekit.checkpoint.layout import name_list
from tiekit.checkpoint.reads import read_tensor
from tiekit.checkpoint.source import Source
from tiekit.declarations import declared_ties, model_ties, transformers4_ties
from tiekit.errors import CheckpointError, TieError
from tiekit.header import TensorEntry
from tiekit.plan import TieGroup, TieMember, TiePlan, dtype_name
from tiekit.retie import lasting_tie_changes, tensor_difference
from tiekit.slots import slot_table


@dataclass(frozen=True)
class Staged:
    """Everything validated, nothing changed yet: the plan to apply and what to read where."""

    groups: tuple[TieGroup, ...]
    loads: tuple[tuple[str, str], ...]  # (model name to fill, file key)
    anchor: Mapping[str, str]  # model name -> the name holding its tensor after the load
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    device: torch.device | None
    keep_file_dtype: bool
    extra_states: tuple[str, ...] = ()  # keys ('<module>._extra_state') read for the modules' set_extra_state


DtypePolicy = Literal["model", "file"]


def stage(model: nn.Module, source: Source, *, strict: bool, device: torch.device | None, dtype: DtypePolicy) -> Staged:
    where, entries = source.where, source.entries
    if dtype not in ("model", "file"):
        raise CheckpointError(f"{where}: dtype must be 'model' or 'file', not {dtype!r}")
    slots = slot_table(model)
    expected = [n for n in model.state_dict(keep_vars=True) if n in slots]
    try:
        model_plan = model_ties(model)
    except TieError as exc:
        raise CheckpointError(f"{where}: cannot load into {type(model).__name__}: {exc}") from exc
    if source.plan is None:
        groups = _rekey(_group_table(model_plan), entries)
    else:
        groups = _group_table(source.plan)
        # A conjugate or negative view's geometry leaves its lazy bit out: its stored copy cannot
        # be compared with the view its source rebuilds.
        lazy = {name for name, slot in slots.items() if slot[2].is_conj() or slot[2].is_neg()}
        _reconcile(groups, model_plan, entries, where, type(model).__name__, lazy)
    key_of = {m.name: (source_key, m) for source_key, members in groups.items() for m in members}

    retie_groups: list[TieGroup] = []
    anchor: dict[str, str] = {}
    loads: list[tuple[str, str]] = []
    for source_key, members in groups.items():
        present = [m for m in members if m.name in slots]
        holder = next((m for m in present if m.view is None), None)
        if holder is None or source_key not in entries:
            continue  # nothing to load: its names are reported missing below
        tied = [TieMember(m.name, slots[m.name][3], m.view, m.requires_grad) for m in present if m is not holder]
        entry = entries[source_key][1]
        group = TieGroup(
            holder.name,
            (TieMember(holder.name, slots[holder.name][3]), *tied),
            "view" if any(m.view for m in tied) else slots[holder.name][3],
            entry.shape,
            dtype_name(entry.dtype),
        )
        loads.append((holder.name, source_key))
        anchor.update({m.name: holder.name for m in present})
        if tied:
            retie_groups.append(group)
    loads.extend((n, n) for n in expected if n not in key_of and n in entries)

    missing = [n for n in expected if n not in anchor and (n in key_of or n not in entries)]
    absent = set(missing)
    consumed = {key_of.get(n, (n, None))[0] for n in expected if n not in absent}
    takers = extra_state_modules(model)
    extra_states = [k for k in takers if k in entries and k not in key_of]
    consumed.update(extra_states)
    missing += [k for k in takers if k not in entries]
    consumed |= _equal_duplicates(expected, key_of, source, model_plan)
    unexpected = [k for k in entries if k not in consumed]
    unexpected += _planned_elsewhere(source.plan, slots, entries)
    if strict and (missing or unexpected):
        problems = [f"missing {name_list(missing)}"] if missing else []
        problems += [f"unexpected {name_list(unexpected)}"] if unexpected else []
        raise CheckpointError(
            f"{where}: does not match {type(model).__name__}: {'; '.join(problems)} (load with strict=False to "
            f"accept){_untied_hint(model, missing, entries) or _pretrained_hint(where, model)}"
        )

    for name in expected:
        key, member = key_of.get(name, (name, None))
        if name not in absent:
            _check_fits(name, slots[name][2], entries[key][1], member, where, cast=dtype == "model")
    for group in retie_groups:
        try:
            lasting_tie_changes(model, group)  # the checks retie makes, without changing anything
        except TieError as exc:
            raise CheckpointError(f"{where}: cannot re-tie {type(model).__name__}: {exc}") from exc
    return Staged(
        tuple(retie_groups),
        tuple(loads),
        anchor,
        tuple(missing),
        tuple(unexpected),
        device,
        dtype == "file",
        tuple(extra_states),
    )


def extra_state_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{'<module>._extra_state': module}`` for each module whose class defines ``set_extra_state``:
    the keys ``load_state_dict`` hands to it (missing when absent, with strict); a file's key for a
    module without it is unexpected, as torch counts it."""
    out: dict[str, nn.Module] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if getattr(type(module), "set_extra_state", nn.Module.set_extra_state) is not nn.Module.set_extra_state:
            out[f"{path}.{_EXTRA_STATE}" if path else _EXTRA_STATE] = module
    return out


def give_extra_states(model: nn.Module, values: Mapping[str, torch.Tensor], where: str) -> None:
    """Hand each value of ``values`` (read from the file) to its module's ``set_extra_state``, as
    ``load_state_dict`` does: the stored tensor, uncast. Called after the weights are in; what the
    module's own code raises is a `CheckpointError` naming the key (the weights stay loaded)."""
    modules = extra_state_modules(model)
    for key, value in values.items():
        try:
            modules[key].set_extra_state(value)
        except Exception as exc:
            raise CheckpointError(
                f"{where}: {type(modules[key]).__name__}.set_extra_state refused {key!r} "
                f"({type(exc).__name__}: {exc}); the weights were loaded"
            ) from exc


_EXTRA_STATE = "_extra_state"  # torch's suffix (nn.modules.module._EXTRA_STATE_KEY_SUFFIX)


def _planned_elsewhere(plan: TiePlan | None, slots: Mapping[str, Any], entries: Mapping[str, Any]) -> list[str]:
    """Names the file's plan ties that the model lacks: keys of the saved state dict too, stored
    once under their group's source, so ``load_state_dict`` would call each unexpected. Ignored,
    a strict load would accept a tied checkpoint of another model (a head the model lacks) or
    a plan naming a key that is not there."""
    if plan is None:
        return []
    names = (m.name for g in plan.groups for m in g.members)
    return list(dict.fromkeys(n for n in names if n not in slots and n not in entries))


def _untied_hint(model: nn.Module, missing: list[str], entries: Mapping[str, Any]) -> str:
    """Why a tie target is missing when the model class ties it only by config: transformers'
    ``_tied_weights_keys`` hold for a config with ``tie_word_embeddings`` (the default), whose
    saves leave the target out; a model built untied then finds it missing. transformers 4 lists
    the targets alone, each tied to the input embedding."""
    declared = getattr(type(model), "_tied_weights_keys", None)
    if isinstance(declared, (list, tuple)):
        declared = transformers4_ties(model, by_config=False)
    if not isinstance(declared, Mapping):
        return ""
    untied = [(t, s) for t, s in declared.items() if t in missing and s in entries and t not in declared_ties(model)]
    if not untied:
        return ""
    pairs = ", ".join(f"{t} to {s}" for t, s in untied)
    return (
        f". {type(model).__name__} ties {pairs} when its config says so (tie_word_embeddings, the default), and "
        "this file was saved from such a model, so it stores the source alone; this model was built untied. Build "
        "it with the config the file was saved with (its config.json), or load with strict=False and copy the "
        "source into the target"
    )


def _pretrained_hint(where: str, model: nn.Module) -> str:
    """Why a transformers ``save_pretrained`` folder may not match its own model class."""
    config = Path(where).parent / "config.json"
    try:
        written_by_transformers = "transformers_version" in config.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""
    if not written_by_transformers:
        return ""
    return (
        f". This folder was written by transformers' save_pretrained, which renames or re-lays some keys on save "
        "for some architectures (ESM's LayerNorm weight/bias as gamma/beta, fused experts such as Jamba's written "
        "per expert, Marian's sinusoidal positions not stored): only from_pretrained undoes that. Load it with "
        f"{type(model).__name__}.from_pretrained(folder) (which re-ties declared ties), then keep the ties through "
        "moves with tiekit.move or tiekit.preserve_ties"
    )


def _group_table(plan: TiePlan) -> dict[str, list[TieMember]]:
    return {g.source: list(g.members) for g in plan.groups}


def _rekey(groups: dict[str, list[TieMember]], entries: Mapping[str, Any]) -> dict[str, list[TieMember]]:
    """For the model's own plan: a group whose source name the file lacks takes its data from
    another member the file has (a file that kept ``lm_head.weight`` instead of the embedding)."""
    out: dict[str, list[TieMember]] = {}
    for key, members in groups.items():
        if key not in entries:
            key = next((m.name for m in members if m.view is None and m.name in entries), key)
        out[key] = members
    return out


def _reconcile(
    groups: dict[str, list[TieMember]],
    model_plan: TiePlan,
    entries: Mapping[str, Any],
    where: str,
    cls: str,
    lazy: Collection[str] = (),
) -> None:
    """Check the file's ties against the model's (detected and declared) and extend them.

    A model tie the file has no data for (``lm_head.weight`` absent) joins the file's group; a
    model tie between two tensors the file stores separately joins them too, and their values
    are compared (`_equal_duplicates`): loading two different tensors into one would silently
    drop one of them. Any other disagreement (a member of another of the file's groups, a view
    of ``lazy``, the model's conjugate or negative views, stored apart) is a `CheckpointError`.
    """
    key_of = {m.name: (key, m) for key, members in groups.items() for m in members}
    for group in model_plan.groups:
        source_key, source_member = key_of.get(group.source, (group.source, None))
        for member in group.members[1:]:
            key, _ = key_of.get(member.name, (member.name, None))
            if key == source_key:
                continue
            if key in entries and source_key not in entries and group.source not in key_of and member.view is None:
                # The file holds this tie's one tensor under the member's name: the source joins it.
                source_member = TieMember(group.source, group.members[0].kind)
                groups.setdefault(key, [TieMember(key, "parameter")]).append(source_member)
                key_of[group.source] = (key, source_member)
                source_key = key
                continue
            if key == member.name and key in entries and key not in groups and member.name not in lazy:
                # Stored apart in the file (saved from a model without this tie, or through a copy
                # of each tensor; a view saved from XLA, where views are not seen): taken as one
                # tensor when both copies are equal, as in a file without a tie plan
                # (`_equal_duplicates` compares them, a view with its source's rebuilt view).
                groups.setdefault(source_key, [TieMember(source_key, "parameter")]).append(member)
                key_of[member.name] = (source_key, member)
                continue
            if key in entries or member.name in key_of:
                raise CheckpointError(
                    f"{where}: the file's tie plan disagrees with {cls}: it stores {key!r} and "
                    f"{source_key!r} as separate tensors, but the model ties {member.name!r} to "
                    f"{group.source!r}. Load into a model built without this tie, or save it tied."
                )
            if source_member is not None and source_member.view is not None and member.view is None:
                member = TieMember(member.name, member.kind, source_member.view, source_member.requires_grad)
            elif source_member is not None and source_member.view is not None:
                raise CheckpointError(
                    f"{where}: cannot reconcile the view {member.name!r} of {group.source!r}, itself a view in the file"
                )
            groups.setdefault(source_key, [TieMember(source_key, "parameter")]).append(member)
            key_of[member.name] = (source_key, member)


def _equal_duplicates(
    expected: list[str], key_of: Mapping[str, tuple[str, TieMember]], source: Source, model_plan: TiePlan
) -> set[str]:
    """Keys of the file that repeat a tensor the model ties (a file without tie metadata, or one
    saved untied): accepted when equal. Each stored source is read once, and held only while its
    own duplicates are compared."""
    entries = source.entries
    by_key: dict[str, list[tuple[str, TieMember]]] = {}
    for name in expected:
        key, member = key_of.get(name, (name, None))
        if key != name and name in entries and key in entries and member is not None:
            by_key.setdefault(key, []).append((name, member))
    duplicates: set[str] = set()
    for key, copies in by_key.items():
        stored = _stored(source, key)
        for name, member in copies:
            value = stored
            if member.view is not None:
                v = member.view
                if v.end > value.numel():
                    continue
                value = value.reshape(-1).as_strided(v.size, v.stride, v.offset)
            if tensor_difference(_stored(source, name), value):  # bytes: copies holding NaN are equal
                raise _different_copies(source, name, key, model_plan)
            duplicates.add(name)
        del stored
    return duplicates


def _different_copies(source: Source, name: str, key: str, model_plan: TiePlan) -> CheckpointError:
    """Two stored copies of one tie differ: the error names who ties them, with advice for that side.
    The checkpoint's recorded plan tying two tensors it stores apart does not describe what was
    saved (a save stores a tie once): edited or damaged, whatever the model. Otherwise the model
    ties them: the file was saved from a model without the tie, or after it broke and trained."""
    said = f"{source.where}: stores {name!r} and {key!r} with different values"
    recorded = source.plan.group_of(name) if source.plan is not None else None
    if recorded is not None and key in recorded.names:
        held = model_plan.group_of(name)
        model = "as the model does" if held is not None and key in held.names else "and the model does not"
        return CheckpointError(
            f"{said}, but the checkpoint's tie plan ({source.plan_where or source.where}) ties them, {model}: "
            "the plan does not describe what was saved (edited or damaged). Restore the plan as the save wrote "
            "it, or save the checkpoint again"
        )
    return CheckpointError(
        f"{said}, but the model ties them: the file was saved from a model that did not hold this tie (broken and "
        "trained apart, or a TPUMixin model saved before tie_weights() applied its tied_weights); load into a model "
        "built without this tie"
    )


def _stored(source: Source, key: str) -> torch.Tensor:
    """The value ``source`` stores under ``key``, read whole (local)."""
    if source.reader is not None:
        return source.reader(key)
    return read_tensor(*source.entries[key], source.files)


def _check_fits(
    name: str, tensor: torch.Tensor, entry: TensorEntry, member: TieMember | None, where: str, *, cast: bool
) -> None:
    shape = entry.shape if member is None or member.view is None else member.view.size
    if tuple(tensor.shape) != shape:
        via = "" if entry.name == name else f" (through key {entry.name!r})"
        raise CheckpointError(
            f"{where}: shape mismatch for {name!r}{via}: the file has {shape}, the model {tuple(tensor.shape)}"
        )
    if cast and tensor.dtype != entry.dtype and not (tensor.is_floating_point() and entry.dtype.is_floating_point):
        raise CheckpointError(
            f"{where}: dtype mismatch for {name!r}: the file has {dtype_name(entry.dtype)}, the model "
            f"{dtype_name(tensor.dtype)}; tiekit casts only between floating-point types (load with "
            "dtype='file' to take the file's dtype)"
        )
