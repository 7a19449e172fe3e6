"""Reading a DCP tensor stored as one whole chunk straight from its shard file, without DCP's copy.

DCP's ``FileSystemWriter`` stores each chunk as one ``torch.save`` record at an offset of a shard
file (``.metadata`` says which file, where, how long). Its reader loads each record into a new
tensor, then copies it into the destination the caller allocated: for a conversion that only
passes the tensor on, that copy and allocation cost about as much as the reading (GPT-2 small:
0.3 s of 1.0 s). A tensor saved whole (one process, or replicated) is read here directly, with
the same ``torch.load(weights_only=True)``; tensors split into several chunks (saved sharded) go
through DCP's reader, which assembles them.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, cast

import torch

from tiekit.errors import CheckpointError

#: key -> (file name in the folder, offset, length) of a tensor stored as one whole chunk.
Whole = dict[str, tuple[str, int, int]]


def whole_chunks(metadata: Any) -> Whole:
    """The keys of DCP ``metadata`` stored as one chunk covering the whole tensor, untransformed
    (no compression or other storage transform), with where that chunk is."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    found: dict[str, list[Any]] = {}
    for index, where in (metadata.storage_data or {}).items():
        found.setdefault(index.fqn, []).append(where)
    out: Whole = {}
    for key, info in metadata.state_dict_metadata.items():
        places = found.get(key, [])
        if not isinstance(info, TensorStorageMetadata) or len(info.chunks) != 1 or len(places) != 1:
            continue
        chunk, where = info.chunks[0], places[0]
        transformed = getattr(where, "transform_descriptors", None)
        if any(chunk.offsets) or tuple(chunk.sizes) != tuple(info.size) or transformed:
            continue
        out[key] = (where.relative_path, int(where.offset), int(where.length))
    return out


class _Slice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, as a seekable file of its own."""

    def __init__(self, file: io.BufferedReader, offset: int, length: int) -> None:
        super().__init__()
        self._file, self._offset, self._length, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = min(max(base + pos, 0), self._length)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self._length - self._pos)
        if count <= 0:
            return 0
        self._file.seek(self._offset + self._pos)
        got = self._file.readinto(memoryview(buffer)[:count])
        self._pos += got
        return got


def read_whole(
    folder: Path, places: Mapping[str, tuple[str, int, int]], specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
) -> dict[str, torch.Tensor]:
    """The tensors at ``places`` (from `whole_chunks`), each checked against its ``specs`` entry
    (shape, dtype): `CheckpointError` naming the file and key otherwise. Local."""
    out: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for key, (name, _, _) in places.items():
        by_file.setdefault(name, []).append(key)
    for name, keys in by_file.items():
        path = folder / name
        with open(path, "rb") as f:
            for key in sorted(keys, key=lambda k: places[k][1]):  # in file order
                _, offset, length = places[key]
                try:
                    record = cast(IO[bytes], _Slice(f, offset, length))
                    tensor = torch.load(record, map_location="cpu", weights_only=True)
                except Exception as exc:
                    raise CheckpointError(f"{path}: key {key!r} at byte {offset}: unreadable ({exc})") from exc
                shape, dtype = specs[key]
                if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                    got = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else "no tensor"
                    raise CheckpointError(f"{path}: key {key!r} holds {got}, the metadata says {shape} {dtype}")
                out[key] = tensor
    return out
