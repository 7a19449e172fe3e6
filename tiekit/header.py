"""Read a safetensors header without trusting it.

Layout: 8 bytes little-endian header length N, N bytes of UTF-8 JSON, then the data bytes.
Every check safetensors' own reader makes is made here first, in Python, so that a truncated,
corrupted or lying file is reported as `CheckpointError` naming the file and the key instead
of a Rust error (or, in older safetensors, a panic) half way through a load.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiekit.errors import CheckpointError

# safetensors refuses larger headers (MAX_HEADER_SIZE in its Rust crate); so do we, before
# reading them into memory.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"

_DTYPE_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}
# Only the dtypes this torch build has: an older torch simply cannot load the others.
DTYPES: Mapping[str, torch.dtype] = {
    code: getattr(torch, name) for code, name in _DTYPE_NAMES.items() if hasattr(torch, name)
}
DTYPE_CODES: Mapping[torch.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: ``[start, end)`` are absolute offsets in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    def rows(self, first: int, count: int) -> TensorEntry:
        """The entry of rows ``[first, first + count)`` (along dim 0): a contiguous byte range."""
        row = (self.end - self.start) // max(self.shape[0], 1)
        start = self.start + first * row
        return dataclasses.replace(self, shape=(count, *self.shape[1:]), start=start, end=start + count * row)


@dataclass(frozen=True)
class Header:
    """A validated header: tensors in file order and the string metadata."""

    path: str
    entries: Mapping[str, TensorEntry]
    metadata: Mapping[str, str]
    file_size: int
    identity: FileIdentity | None = None  # of the file read, when read from one


# (device, inode, size, modification time in ns): changes when a save replaces the file.
FileIdentity = tuple[int, int, int, int]


def file_identity(st: os.stat_result) -> FileIdentity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and validate the header of the safetensors file at ``path``."""
    where = os.fspath(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            prefix = f.read(8)
            length = _length(prefix, st.st_size, where)
            header = parse_header(prefix + f.read(length), st.st_size, where)
    except OSError as exc:
        raise CheckpointError(f"{where}: cannot read: {exc.strerror or exc}") from exc
    return dataclasses.replace(header, identity=file_identity(st))


def parse_header(data: bytes, file_size: int | None = None, where: str = "<bytes>") -> Header:
    """Validate a header given the file's first ``8 + N`` bytes (or more) and its total size."""
    size = len(data) if file_size is None else file_size
    length = _length(data[:8], size, where)
    if len(data) < 8 + length:
        raise CheckpointError(f"{where}: truncated inside the header ({len(data)} of {8 + length} bytes)")
    try:
        text = data[8 : 8 + length].decode("utf-8")
        raw = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise CheckpointError(f"{where}: corrupted header: key {exc.args[0]!r} appears twice") from exc
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where}: corrupted header, not UTF-8 JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: corrupted header, JSON {type(raw).__name__} instead of an object")
    metadata = _metadata(raw.pop(METADATA_KEY, None), where)
    data_start = 8 + length
    entries = sorted((_entry(name, info, data_start, where) for name, info in raw.items()), key=_order)
    # safetensors lays tensors out back to back from the first data byte to the last; a gap,
    # an overlap or bytes past the last tensor mean the offsets lie.
    position = data_start
    for e in entries:
        if e.start != position:
            raise CheckpointError(
                f"{where}: header offsets lie at key {e.name!r}: its data starts at byte "
                f"{e.start - data_start} of the data section, expected {position - data_start}"
            )
        position = e.end
    if position > size:
        last = entries[-1].name if entries else "<header>"
        raise CheckpointError(f"{where}: truncated: key {last!r} ends at byte {position} but the file has {size} bytes")
    if position < size:
        raise CheckpointError(
            f"{where}: {size - position} unexpected byte(s) after the last tensor; the header offsets "
            "do not describe this file"
        )
    return Header(where, {e.name: e for e in entries}, metadata, size)


def _length(prefix: bytes, size: int, where: str) -> int:
    if len(prefix) < 8:
        raise CheckpointError(f"{where}: truncated: {len(prefix)} byte(s), a safetensors file has at least 8")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES:
        other = _other_format(prefix)
        if other is not None:
            raise CheckpointError(f"{where}: not a safetensors file: it starts as {other}")
        raise CheckpointError(f"{where}: oversized header ({length} bytes, the limit is {MAX_HEADER_BYTES})")
    if 8 + length > size:
        raise CheckpointError(f"{where}: truncated: the header claims {length} bytes but the file has {size}")
    return int(length)


def _other_format(prefix: bytes) -> str | None:
    """What a file that is not safetensors looks like from its first bytes, when it is a common
    mistake: a ``torch.save`` file (a zip, or a legacy pickle) given to a safetensors loader."""
    if prefix.startswith(b"PK\x03\x04"):
        return "a zip archive, as torch.save writes (a .pt file, a Lightning .ckpt): read it with torch.load"
    if prefix[:1] == b"\x80" and prefix[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a Python pickle (torch.save's legacy format): read it with torch.load"
    return None


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json keeps the last of repeated keys silently; a file that names a tensor twice is corrupt.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _metadata(raw: Any, where: str) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise CheckpointError(f"{where}: corrupted header: {METADATA_KEY!r} must map strings to strings")
    return dict(raw)


def _entry(name: str, info: Any, data_start: int, where: str) -> TensorEntry:
    # Unknown extra fields are ignored, as safetensors does; the three it needs must be there.
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise CheckpointError(f"{where}: corrupted header at key {name!r}: expected dtype, shape and data_offsets")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(code, str) or code not in DTYPES:
        raise CheckpointError(f"{where}: key {name!r} has dtype {code!r}, which this torch cannot load")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where}: key {name!r} has an invalid shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise CheckpointError(f"{where}: key {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    dtype = DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise CheckpointError(
            f"{where}: header offsets lie at key {name!r}: {end - begin} byte(s) for shape {tuple(shape)} "
            f"{code}, which needs {expected}"
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _order(e: TensorEntry) -> tuple[int, int, str]:
    return (e.start, e.end, e.name)


def read_json(path: str | os.PathLike[str], what: str) -> Any:
    """Parse a small JSON file (an index); `CheckpointError` naming the file on any failure."""
    where = os.fspath(path)
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{where}: cannot read the {what}: {exc.strerror or exc}") from exc
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise CheckpointError(f"{where}: corrupted {what}: key {exc.args[0]!r} appears twice") from exc
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where}: corrupted {what}, not JSON ({exc})") from exc
