"""Opening a checkpoint: validate a file, an index or a folder without reading any tensor.

Headers, shard paths, save ids and the tie plan are checked, and each file's identity is
recorded, so reading can refuse a file replaced after validation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from tiekit.checkpoint.files import weight_map_files
from tiekit.checkpoint.layout import (
    INDEX_SUFFIX,
    PLAN_KEY,
    SAVE_ID_KEY,
    SIDE_PREFIXES,
    STATE_KEY,
    STATE_VERSION,
    WEIGHTS_NAME,
    PathLike,
    is_shard_name,
    saved_at,
)
from tiekit.errors import CheckpointError, TieError
from tiekit.header import FileIdentity, Header, TensorEntry, read_header, read_json
from tiekit.plan import TieGroup, TieMember, TiePlan, dtype_name


@dataclass(frozen=True)
class Source:
    """A validated checkpoint on disk: where each key's bytes are, its metadata and its ties."""

    where: str
    entries: Mapping[str, tuple[str, TensorEntry]]
    metadata: Mapping[str, Any]
    plan: TiePlan | None
    plan_origin: str
    side: Mapping[str, tuple[str, TensorEntry]] = field(default_factory=dict)
    # Identity of each file when its header was validated; reading checks it, so a save that
    # replaces the file in between is an error before anything is loaded, not a silent mix.
    files: Mapping[str, FileIdentity] = field(default_factory=dict)
    # How a tensor's stored value is read whole, where the entries are not byte ranges of
    # safetensors files (a DCP folder's records: DCP reads them); None: `read_tensor` of the entry.
    reader: Callable[[str], torch.Tensor] | None = None
    # Where ``plan`` is recorded, for messages that blame it (a DCP folder's marker file, not its
    # save folder ``where``).
    plan_where: str = ""


def open_source(path: PathLike, preferred: tuple[str, ...] = (WEIGHTS_NAME, WEIGHTS_NAME + INDEX_SUFFIX)) -> Source:
    """Validate the checkpoint at ``path`` (a file, an index, or a folder holding one) without
    reading any tensor: headers, shard paths, save ids and the tie plan. Within tiekit: the
    loaders and ``tiekit inspect`` start here."""
    target = Path(path)
    if target.is_dir():
        target = _pick_in_folder(target, preferred)
    target = saved_at(target)
    if not target.is_file():
        what = "not a regular file" if target.exists() else "no such checkpoint file"
        raise CheckpointError(f"{target}: {what}")
    if target.name.endswith(".json"):
        return _open_index(target)
    header = read_header(target)
    entries = {k: (header.path, e) for k, e in header.entries.items()}
    return _with_plan(header.path, entries, header.metadata, _identities([header]))


def _pick_in_folder(folder: Path, preferred: tuple[str, ...]) -> Path:
    for name in preferred:
        if (folder / name).is_file():
            return folder / name
    files = sorted(p.name for p in folder.glob("*.safetensors") if not p.name.startswith("."))
    indexes = sorted(p.name for p in folder.glob("*.safetensors" + INDEX_SUFFIX) if not p.name.startswith("."))
    # Shard files are part of the sharded checkpoint their index commits (named as shards, or named
    # by an index): without an index they are the leftovers of a sharded save killed before its
    # index was written, never a checkpoint. Any other file is a checkpoint of its own, as an index is.
    named = {file for index in indexes for file in weight_map_files(folder / index)}
    shards = [name for name in files if is_shard_name(name) or name in named]
    candidates = sorted([*indexes, *(name for name in files if name not in shards)])
    if len(candidates) == 1:
        return folder / candidates[0]
    if not candidates and shards:
        shown = ", ".join(shards[:3]) + (" and more" if len(shards) > 3 else "")
        raise CheckpointError(
            f"{folder}: shard files ({shown}) without the index that commits them (a sharded save killed "
            "before it wrote its .safetensors.index.json, or the index removed): no checkpoint to load here. "
            "Load a shard on its own by naming its file"
        )
    if not candidates:
        raise CheckpointError(f"{folder}: no safetensors file or index in this folder{_sharded_hint(folder)}")
    raise CheckpointError(f"{folder}: several checkpoints in this folder ({', '.join(candidates)}); name one")


def _sharded_hint(folder: Path) -> str:
    """What to do with a torch.distributed.checkpoint folder given where a file was expected."""
    from tiekit.dcp.layout import is_plain_dcp_folder, is_sharded_checkpoint

    if is_sharded_checkpoint(folder):
        return "; it is a sharded checkpoint (tiekit.save_sharded): load it with tiekit.load_sharded"
    if is_plain_dcp_folder(folder):
        return f"; {PLAIN_DCP_HINT}"
    held = sorted(p.name for p in folder.iterdir() if p.is_dir() and is_sharded_checkpoint(p))
    if held:  # a checkpoint_dir of fit's sharded strategies: a step-<step>/ folder per checkpoint
        shown = ", ".join([*held[:3], "...", *held[-2:]] if len(held) > 5 else held)
        return (
            f"; it holds {len(held)} sharded checkpoint folder(s) ({shown}): name one of them, "
            f"such as {folder / held[-1]}"
        )
    return ""


#: What a plain torch.distributed.checkpoint folder is and how tiekit reads it.
PLAIN_DCP_HINT = (
    "it is a plain torch.distributed.checkpoint folder (dcp.save), which records no ties and stores each "
    "name of a tie: tiekit.convert(folder, 'model.safetensors', plan=model) (or tiekit convert --model) makes "
    "it a tied checkpoint, checking that the copies are equal"
)


def _open_index(index_path: Path) -> Source:
    where = os.fspath(index_path)
    raw = read_json(index_path, "index")
    if not isinstance(raw, dict) or not isinstance(raw.get("weight_map"), dict):
        raise CheckpointError(f"{where}: not a safetensors index (no 'weight_map' object)")
    metadata = raw.get("metadata", {})
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{where}: the index 'metadata' is not an object")
    folder = index_path.parent.resolve()
    headers: dict[str, Any] = {}
    entries: dict[str, tuple[str, TensorEntry]] = {}
    for key, file in raw["weight_map"].items():
        if not isinstance(file, str) or not file:
            raise CheckpointError(f"{where}: key {key!r} maps to {file!r}, not a shard file name")
        if file not in headers:
            shard = _inside(folder, file, where, key)
            if not shard.is_file():
                raise CheckpointError(f"{where}: shard {file!r} (holding key {key!r}) is missing")
            headers[file] = read_header(shard)
        header = headers[file]
        if key not in header.entries:
            raise CheckpointError(f"{where}: the index puts key {key!r} in {file!r}, which does not contain it")
        entries[key] = (header.path, header.entries[key])
    save_id = metadata.get(SAVE_ID_KEY)
    if save_id is not None:
        for file, header in headers.items():
            if header.metadata.get(SAVE_ID_KEY) != save_id:
                raise CheckpointError(
                    f"{where}: shard {file!r} belongs to another save than this index (interrupted or mixed copy)"
                )
    return _with_plan(where, entries, metadata, _identities(headers.values()))


def _identities(headers: Iterable[Header]) -> dict[str, FileIdentity]:
    return {h.path: h.identity for h in headers if h.identity is not None}


def _inside(folder: Path, file: str, where: str, key: str) -> Path:
    relative = PurePosixPath(file)
    if relative.is_absolute() or ".." in relative.parts or "\\" in file or ":" in file:
        raise CheckpointError(f"{where}: shard path {file!r} (key {key!r}) escapes the index's folder")
    full = (folder / relative).resolve()
    if not full.is_relative_to(folder):
        raise CheckpointError(f"{where}: shard path {file!r} (key {key!r}) escapes the index's folder (symlink)")
    return full


def _with_plan(
    where: str,
    entries: dict[str, tuple[str, TensorEntry]],
    metadata: Mapping[str, Any],
    files: Mapping[str, FileIdentity],
) -> Source:
    side: dict[str, tuple[str, TensorEntry]] = {}
    if STATE_KEY in metadata:
        side = {k: v for k, v in entries.items() if k.startswith(SIDE_PREFIXES)}
        entries = {k: v for k, v in entries.items() if k not in side}
    raw_plan = metadata.get(PLAN_KEY)
    if raw_plan is not None:
        if not isinstance(raw_plan, dict | str):
            raise CheckpointError(
                f"{where}: invalid tie plan in {PLAN_KEY!r}: a {type(raw_plan).__name__}, not a JSON object"
            )
        try:
            plan = TiePlan.from_dict(raw_plan) if isinstance(raw_plan, dict) else TiePlan.from_json(raw_plan)
        except TieError as exc:
            raise CheckpointError(f"{where}: invalid tie plan in {PLAN_KEY!r}: {exc}") from exc
        for group in plan.groups:
            if group.source not in entries:
                raise CheckpointError(
                    f"{where}: the tie metadata names key {group.source!r} (source of {', '.join(group.names[1:])}) "
                    "but the file has no such tensor"
                )
            entry = entries[group.source][1]
            if entry.shape != group.shape or dtype_name(entry.dtype) != group.dtype:
                raise CheckpointError(
                    f"{where}: the tie metadata says key {group.source!r} is {group.shape} {group.dtype} "
                    f"but the file stores {entry.shape} {dtype_name(entry.dtype)}"
                )
        refuse_members_stored_otherwise(plan, {k: e for k, (_, e) in entries.items()}, f"{where}: the tie metadata")
        return Source(
            where, entries, metadata, plan, "tiekit", side, files, plan_where=f"{where}, metadata key {PLAN_KEY!r}"
        )
    # safetensors.torch.save_model records each dropped duplicate as {removed: kept}.
    pairs: dict[str, list[str]] = {}
    for removed, kept in metadata.items():
        if isinstance(kept, str) and kept in entries and removed not in entries:
            pairs.setdefault(kept, []).append(removed)
    if not pairs:
        return Source(where, entries, metadata, None, "model", side, files)
    groups = tuple(
        TieGroup(
            kept,
            tuple(TieMember(n, "parameter") for n in [kept, *sorted(removed)]),
            "parameter",
            entries[kept][1].shape,
            dtype_name(entries[kept][1].dtype),
        )
        for kept, removed in pairs.items()
    )
    return Source(where, entries, metadata, TiePlan(groups, len(entries), len(entries)), "safetensors", side, files)


def refuse_members_stored_otherwise(plan: TiePlan, entries: Mapping[str, TensorEntry], said: str) -> None:
    """`CheckpointError` for a tied name the checkpoint also stores under its own key, in another
    shape or dtype than its group's: one tensor cannot be both, so the plan is damaged (left to the
    load, it was reported as the two keys' "different values", as if the model tied them).
    ``said`` opens the message: who says so."""
    for group in plan.groups:
        for member in group.members[1:]:
            entry = entries.get(member.name)
            if entry is None or member.view is not None:
                continue  # not stored apart, or a view (its own shape): the load compares its values
            if (entry.shape, dtype_name(entry.dtype)) != (group.shape, group.dtype):
                raise CheckpointError(
                    f"{said} ties {member.name!r} to {group.source!r} ({group.shape} {group.dtype}), but the "
                    f"checkpoint stores {member.name!r} as {entry.shape} {dtype_name(entry.dtype)}: a tensor "
                    "cannot be both; the plan is damaged"
                )


def training_record(source: Source) -> dict[str, Any]:
    text = source.metadata.get(STATE_KEY)
    if text is None:
        return {}
    try:
        record = json.loads(text)
    # RecursionError: JSON nested deeper than the interpreter's stack (as TiePlan.from_json).
    except (TypeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{source.where}: corrupted {STATE_KEY!r} metadata: {exc}") from exc
    if not isinstance(record, dict) or not isinstance(record.get("version"), int):
        raise CheckpointError(f"{source.where}: corrupted {STATE_KEY!r} metadata (no version)")
    if record["version"] > STATE_VERSION:
        raise CheckpointError(
            f"{source.where}: checkpoint format {record['version']} is newer than this tiekit reads "
            f"({STATE_VERSION}); upgrade tiekit"
        )
    return record
