"""Which record of a sharded checkpoint is damaged, once DCP's read of it has failed.

A shard file damaged in place (bytes overwritten, same size) passes the size checks of
`tiekit.dcp.layout.check_files`, and DCP's reader then fails with an error naming neither the
file nor the key (``PytorchStreamReader failed reading zip archive: invalid header``). DCP's
metadata says where every record is (``storage_data``: file, offset, length), so each record
can be read on its own, as DCP's reader reads it, until one fails. Only on the failure path: a
good load reads nothing twice.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from tiekit.errors import CheckpointError


def damaged_record(folder: Path, metadata: Any, keys: Collection[str]) -> CheckpointError | None:
    """A `CheckpointError` naming the shard file, the key and the cause of the first record of
    ``keys`` (in file and offset order: the same on every rank) that DCP's reader cannot read, or
    None when every record reads (the failure was not the files'). Local: reads every record of
    ``keys`` in every shard file (all chunks, not only this rank's), one at a time."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    transforms: Any = FileSystemReader(folder).transforms  # what DCP's reader undoes (compression)
    records = sorted(
        ((where.relative_path, where.offset, where.length, where, index.fqn) for index, where in _items(metadata)),
        key=lambda record: record[:3],
    )
    for relative_path, offset, length, where, key in records:
        if key not in keys:
            continue
        file = folder / relative_path
        is_bytes = isinstance(metadata.state_dict_metadata.get(key), BytesStorageMetadata)
        try:
            _read_record(file, offset, length, where, transforms, is_bytes=is_bytes)
        except FileNotFoundError:
            return CheckpointError(
                f"{file}: gone while the load read the checkpoint (it holds key {key!r}): removed, or its save "
                "replaced and deleted by another writer; load again"
            )
        except Exception as exc:  # noqa: BLE001 - any failure to read it is the damage reported
            cause = _cause(exc)
            return CheckpointError(
                f"{file}: key {key!r} (bytes {offset} to {offset + length}) is damaged, its record does not "
                f"read ({cause}); the file has the size the save wrote, so its bytes were "
                "changed in place"
            )
    return None


def _cause(exc: Exception) -> str:
    """What failed, in one line: an unpickling error's message is torch's advice about
    ``weights_only``, which a damaged record does not need."""
    if isinstance(exc, pickle.UnpicklingError):
        return "UnpicklingError: its pickle does not load"
    return f"{type(exc).__name__}: {next(iter(str(exc).splitlines()), '')}"


def _items(metadata: Any) -> list[tuple[Any, Any]]:
    return list((metadata.storage_data or {}).items())


def _read_record(file: Path, offset: int, length: int, where: Any, transforms: Any, *, is_bytes: bool) -> None:
    """Read one record as DCP's ``FileSystemReader.read_data`` does: a tensor through
    ``torch.load(weights_only=True)``, bytes as they are (after the save's transforms, if any)."""
    with open(os.fspath(file), "rb") as stream:
        stream.seek(offset)
        raw = stream.read(length)
    if len(raw) != length:
        raise OSError(f"{len(raw)} bytes where the metadata says {length}")
    data = transforms.transform_load_stream(None, where.transform_descriptors or (), io.BytesIO(raw))
    if is_bytes:
        data.read(-1)
        return
    seekable = io.BytesIO(data.read(-1))
    torch.load(seekable, map_location="cpu", weights_only=True)
