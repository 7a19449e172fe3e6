"""A sharded checkpoint's save folder as the loaders read it: DCP's metadata, checked against the
marker and the files (`save_metadata`); the `Source` that staging checks a model against
(`as_source`), whose tied copies DCP reads to compare them; and DCP's reads of the records, whose
failure names the damaged record where one is (`dcp_load`)."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tiekit.checkpoint.source import Source, refuse_members_stored_otherwise
from tiekit.dcp.damage import damaged_record
from tiekit.dcp.layout import DCP_METADATA, MARKER_NAME, Marker, check_files, file_ends
from tiekit.dcp.metadata_pickle import metadata_reader, read_dcp_metadata
from tiekit.dcp.state import running_dcp
from tiekit.errors import CheckpointError
from tiekit.header import TensorEntry
from tiekit.plan import dtype_name

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


def dcp_load(state: dict[str, torch.Tensor], folder: Path, metadata: Any, planner: Any, single: bool) -> None:
    """Collective (DCP's load): read ``state``'s keys from the save ``folder``. When DCP fails, a
    `CheckpointError` naming the damaged record's shard file and key if one is (found by reading
    each record of those keys, `tiekit.dcp.damage`, the same on every rank: DCP raises its failure
    on every rank), else DCP's failure (`running_dcp`). DCP reads the metadata again, restricted
    as `dcp_metadata` reads it (`metadata_reader`): a file replaced since by one it refuses is
    that refusal."""
    from torch.distributed.checkpoint.state_dict_loader import load

    reader = metadata_reader(folder)
    try:
        with running_dcp(folder, reading=True):
            load(state, storage_reader=reader, planner=planner, no_dist=single)
    except CheckpointError as exc:
        if reader.refusal is not None:
            raise reader.refusal from exc
        damaged = damaged_record(folder, metadata, set(state))
        if damaged is None:
            raise
        raise damaged from exc


def dcp_metadata(folder: Path) -> Metadata:
    """DCP's metadata of ``folder``, unpickled with the globals DCP's records need only
    (`read_dcp_metadata`: a crafted pickle runs nothing; check a `save_sharded` save's against its
    marker first: `read_marker`). `CheckpointError` naming the file when it is gone (a newer save
    removed the folder meanwhile: `reading_committed` then reads the new save), names another
    global, or is unreadable. Local."""
    file = folder / DCP_METADATA
    try:
        return read_dcp_metadata(file)
    except CheckpointError:
        raise
    except FileNotFoundError as exc:
        raise CheckpointError(f"{file}: missing (the DCP metadata of {folder}): {exc.strerror or exc}") from exc
    except Exception as exc:
        raise CheckpointError(f"{file}: unreadable DCP metadata: {exc}{_written_by_another_torch(folder)}") from exc


def _written_by_another_torch(folder: Path) -> str:
    """Which torch wrote the save, when its marker says so and it is not this one (``""``
    otherwise): DCP's metadata is a pickle, and a newer torch's may name what this one lacks (a
    dtype), which reads as damage unless said. Local, best effort."""
    try:
        raw = json.loads((folder.parent / MARKER_NAME).read_text(encoding="utf-8"))
        saved = raw["torch"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    if not isinstance(saved, str) or saved == torch.__version__:
        return ""
    return f" (the save was written by torch {saved}; this is torch {torch.__version__}, which may lack what it names)"


def save_metadata(marker: Marker) -> Any:
    """DCP's metadata (its hash already checked against the marker), checked against the marker's
    key table and the files: every chunk of every key inside a file of the save."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = marker.folder
    metadata = dcp_metadata(folder)
    check_files(marker, file_ends(metadata))
    stored = metadata.state_dict_metadata
    for key, (shape, dtype) in marker.tensors.items():
        info = stored.get(key)
        if not isinstance(info, TensorStorageMetadata):
            raise CheckpointError(f"{folder / '.metadata'}: key {key!r} (listed in {marker.where}) is not stored")
        if tuple(info.size) != shape or dtype_name(info.properties.dtype) != dtype:
            raise CheckpointError(
                f"{folder / '.metadata'}: key {key!r} is {tuple(info.size)} {dtype_name(info.properties.dtype)}, "
                f"the marker says {shape} {dtype}"
            )
    return metadata


def as_source(marker: Marker, metadata: Any) -> Source:
    """The checkpoint as `tiekit.checkpoint.staging.stage` reads one: key -> (first file, entry)."""
    files: dict[str, str] = {}
    for index, where in (metadata.storage_data or {}).items():
        files.setdefault(index.fqn, os.fspath(marker.folder / where.relative_path))
    entries: dict[str, tuple[str, TensorEntry]] = {}
    side: dict[str, tuple[str, TensorEntry]] = {}
    for key, (shape, _) in marker.tensors.items():
        dtype = metadata.state_dict_metadata[key].properties.dtype
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        entry = (files.get(key, os.fspath(marker.folder)), TensorEntry(key, dtype, shape, 0, nbytes))
        (side if key.startswith(("optimizer/", "extra/")) else entries)[key] = entry
    for group in marker.plan.groups if marker.plan is not None else ():
        if group.source not in entries:
            raise CheckpointError(
                f"{marker.where}: key 'plan' names {group.source!r} (source of {', '.join(group.names[1:])}), "
                "which the checkpoint does not store"
            )
        shape, dtype_text = marker.tensors[group.source]
        if shape != group.shape or dtype_text != group.dtype:
            raise CheckpointError(
                f"{marker.where}: key 'plan' says {group.source!r} is {group.shape} {group.dtype}, "
                f"the checkpoint stores {shape} {dtype_text}"
            )
    if marker.plan is not None:
        refuse_members_stored_otherwise(
            marker.plan, {k: e for k, (_, e) in entries.items()}, f"{marker.where}: key 'plan'"
        )
    reader = functools.partial(_read_whole, marker.folder, metadata)
    recorded = f"{marker.where}, key 'plan'"
    return Source(
        os.fspath(marker.folder), entries, {}, marker.plan, "tiekit", side, reader=reader, plan_where=recorded
    )


def _read_whole(folder: Path, metadata: Any, key: str) -> torch.Tensor:
    """Local: the stored value of tensor ``key``, every chunk of it, read by DCP in this process
    alone (``no_dist``: no collective), for the loader to compare two copies of a tie."""
    from torch.distributed.checkpoint.state_dict_loader import load

    info = metadata.state_dict_metadata[key]
    value = torch.empty(tuple(info.size), dtype=info.properties.dtype)
    with running_dcp(folder, reading=True):
        load({key: value}, storage_reader=metadata_reader(folder), no_dist=True)
    return value
