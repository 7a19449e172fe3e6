"""Which record of a sharded checkpoint is damaged, once DCP's read of it has failed.

A shard file damaged in place (bytes overwritten, same size) passes the size checks of
`tiekit.dcp.layout.check_files`, and DCP's reader then fails with an error naming neither the
file nor the key (``PytorchStreamReader failed reading zip archive: invalid header``). DCP's
metadata says where every record is (``storage_data``: file, offset, length), so each record
can be read on its own, as DCP's reader reads it, until one fails. Only on the failure path: a
good load reads nothing twice.

DCP reads into the model's own tensors, one record after another, so a damaged record found by
DCP's read would leave the records before it loaded. `damaged_structure` runs first, on what a
load will read into the model in place: each record's zip directory, its pickle (the tensor it
describes, checked against the metadata) and the local header of its data (what ``torch.load``
checks before the bytes; a few hundred bytes a record, not the tensor's bytes, which
``torch.load`` never checks either: no checksum is read).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from collections.abc import Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, Any, cast

import torch

from tiekit.dcp.chunks import FileSlice
from tiekit.errors import CheckpointError

#: A region of a tensor: (offsets, sizes) per dimension; None is the whole tensor.
Region = tuple[tuple[int, ...], tuple[int, ...]]


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
        except OSError as exc:
            if exc.errno is None:  # raised by _read_record: the record is cut short, which is damage
                return _damaged(file, key, offset, length, exc)
            return CheckpointError(unreadable_text(file, key, exc))
        except Exception as exc:  # noqa: BLE001 - any failure to read it is the damage reported
            return _damaged(file, key, offset, length, exc)
    return None


def damaged_text(file: Path, key: str, offset: int, length: int, exc: Exception) -> str:
    """How every reader of a sharded checkpoint names the record of ``key`` at ``offset`` (of
    ``length`` bytes) in ``file`` whose read raised ``exc``: the file, the key, its bytes and the
    cause in one line (`_cause`: not torch's advice to unpickle with ``weights_only=False``)."""
    where = f"{file}: key {key!r} (bytes {offset} to {offset + length})"
    return f"{where} is damaged, its record does not read ({_cause(exc)})"


def unreadable_text(file: Path, key: str, exc: OSError) -> str:
    """How every reader names a shard file the system would not read (permissions, EIO): the
    file's failure, not the record's; no byte was seen, so none is called damaged."""
    return f"{file}: cannot read: {exc.strerror or exc} (it holds key {key!r})"


def _damaged(file: Path, key: str, offset: int, length: int, exc: Exception) -> CheckpointError:
    """The error of `damaged_record` for the record of ``key`` at ``offset`` that raised ``exc``."""
    return CheckpointError(
        f"{damaged_text(file, key, offset, length, exc)}; the file has the size the save wrote, so its bytes were "
        "changed in place"
    )


def damaged_structure(
    folder: Path, metadata: Any, wanted: Mapping[str, Sequence[Region] | None]
) -> CheckpointError | None:
    """A `CheckpointError` naming the shard file, the key and the cause of the first tensor record
    (in file and offset order) among those holding the ``wanted`` regions of their keys (None: the
    whole tensor) that ``torch.load`` would refuse, or that does not hold the chunk the metadata
    describes; None if all read. Reads each record's zip directory, pickle and data header, not its
    tensor's bytes: about 0.2 ms a record. Local."""
    stored = metadata.state_dict_metadata
    # Each chunk's sizes by (key, offsets): one walk, not one per record (a key of N ranks' shards
    # has N chunks and N records).
    sizes = {
        (key, tuple(chunk.offsets)): tuple(chunk.sizes)
        for key, info in stored.items()
        for chunk in getattr(info, "chunks", None) or ()
    }
    records = []
    for index, where in _items(metadata):
        chunk = sizes.get((index.fqn, tuple(index.offset or ())))
        if index.fqn not in wanted or where.transform_descriptors or chunk is None:
            continue  # DCP's own read (transformed records) or no tensor: left to it
        if _overlaps(tuple(index.offset or ()), chunk, wanted[index.fqn]):
            records.append((where.relative_path, where.offset, where.length, index.fqn, chunk))
    records.sort()
    files: dict[str, IO[bytes]] = {}
    try:
        for relative_path, offset, length, key, chunk in records:
            file = folder / relative_path
            try:
                if relative_path not in files:
                    files[relative_path] = open(file, "rb")  # noqa: SIM115 - closed below, one per file
                _check_structure(files[relative_path], offset, length, chunk, stored[key].properties.dtype)
            except FileNotFoundError:
                return CheckpointError(f"{file}: gone before the load read it (it holds key {key!r}); load again")
            except OSError as exc:  # the file's, not the record's: EIO, permissions
                error = CheckpointError(
                    f"{file}: unreadable ({exc.strerror or exc}) at key {key!r}; the model is untouched"
                )
                error.__cause__ = exc
                return error
            except Exception as exc:  # noqa: BLE001 - any other failure to read it is the damage reported
                error = CheckpointError(f"{damaged_text(file, key, offset, length, exc)}; the model is untouched")
                error.__cause__ = exc
                return error
    finally:
        for stream in files.values():
            stream.close()
    return None


def _check_structure(file: IO[bytes], offset: int, length: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Read the record at ``offset`` as ``torch.load`` does, except its tensor's bytes
    (``torch.serialization.skip_data``), check it is a ``shape`` ``dtype`` tensor, then the local
    header of its data, which ``torch.load`` reads before the bytes: signature, name, and the
    bytes inside the record."""
    window = cast(IO[bytes], io.BufferedReader(FileSlice(cast(io.BufferedReader, file), offset, length), 4096))
    with _without_data():
        tensor = torch.load(window, map_location="cpu", weights_only=True)
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape or tensor.dtype != dtype:
        got = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"it holds {got}, the metadata says {shape} {dtype}")
    window.seek(0)
    with zipfile.ZipFile(window) as archive:
        for info in archive.infolist():
            if "/data/" not in info.filename:
                continue
            window.seek(info.header_offset)
            header = window.read(30)
            if len(header) != 30:
                raise zipfile.BadZipFile(f"the local header of {info.filename} is cut off")
            signature, name_length, extra_length = struct.unpack("<I22xHH", header)
            name = window.read(name_length)
            end = info.header_offset + 30 + name_length + extra_length + info.compress_size
            if signature != 0x04034B50 or name != info.filename.encode() or end > length:
                raise zipfile.BadZipFile(f"the local header of {info.filename} is damaged")


def _without_data() -> AbstractContextManager[Any]:
    """``torch.load`` without reading tensors' bytes: ``skip_data`` (torch 2.5 and later), else
    ``FakeTensorMode`` (slower: a fake tensor costs more than an unfilled storage)."""
    skip = getattr(torch.serialization, "skip_data", None)
    if skip is not None:
        return cast(AbstractContextManager[Any], skip())
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def _overlaps(offsets: tuple[int, ...], sizes: tuple[int, ...] | None, regions: Sequence[Region] | None) -> bool:
    """Whether the chunk at ``offsets`` of ``sizes`` (None: unknown) meets any of ``regions``."""
    if regions is None or sizes is None:
        return True
    return any(
        all(o < r_o + r_s and r_o < o + s for o, s, r_o, r_s in zip(offsets, sizes, r_offsets, r_sizes, strict=True))
        for r_offsets, r_sizes in regions
    )


def _cause(exc: Exception) -> str:
    """What failed, in one line: an unpickling error's message is torch's advice about
    ``weights_only``, and a zip error's ends in miniz's about corrupted files, which a damaged
    record does not need."""
    if isinstance(exc, pickle.UnpicklingError):
        return "UnpicklingError: its pickle does not load"
    first = next(iter(str(exc).splitlines()), "").split(" This is an internal miniz error.")[0]
    return f"{type(exc).__name__}: {first}"


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
