"""`tiekit inspect` for sharded checkpoint folders: the marker and DCP's metadata, read without
loading any tensor (unless values are compared)."""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tiekit.checkpoint.direct import host_bytes
from tiekit.checkpoint.layout import PathLike
from tiekit.dcp.layout import read_marker, reading_committed
from tiekit.inspection import FileReport, StoredTensor
from tiekit.plan import dtype_name

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


def inspect_sharded(path: PathLike, *, check_values: bool = False) -> FileReport:
    """Describe the `save_sharded` folder ``path``: its stored tensors (global shapes; the file
    holding each one's first chunk), plan, optimizer/extra tensors and save. ``check_values`` reads
    the tensors that share a dtype and shape and reports the byte-identical ones. Validates the
    folder as `load_sharded` does; `CheckpointError` naming the file and key otherwise. A folder
    another process saves into meanwhile is read again from its new save. Local."""
    return reading_committed(Path(path), lambda: _inspect_sharded(path, check_values))


def _inspect_sharded(path: PathLike, check_values: bool) -> FileReport:
    from tiekit.dcp.records import save_metadata

    marker = read_marker(path)
    metadata = save_metadata(marker)
    first_file = _first_files(metadata, marker.folder)
    tensors = []
    side_count = side_bytes = 0
    for key, (shape, dtype) in marker.tensors.items():
        size = metadata.state_dict_metadata[key].properties.dtype.itemsize
        for d in shape:
            size *= d
        if key.startswith(("optimizer/", "extra/")):
            side_count += 1
            side_bytes += size
        else:
            tensors.append(StoredTensor(key, dtype, shape, size, first_file.get(key, os.fspath(marker.folder))))
    files = tuple(os.fspath(marker.folder / f) for f in sorted(marker.files))
    shown = {
        "save_id": marker.save_id,
        "world_size": str(marker.record.get("world_size")),
        "torch": str(marker.record.get("torch")),
    }
    raw_version = None if marker.plan is None else marker.plan.to_dict()["version"]
    return FileReport(
        path=os.fspath(Path(path)),
        files=files,
        tensors=tuple(tensors),
        side_tensors=side_count,
        side_bytes=side_bytes,
        plan=marker.plan,
        plan_origin="tiekit" if marker.plan is not None else "none",
        plan_version=None if raw_version is None else int(raw_version),
        checkpoint_version=int(marker.record.get("version", 1)) if side_count else None,
        metadata=shown,
        identical=_identical(marker.folder, tensors) if check_values else None,
        kind="save_sharded",
    )


def inspect_plain_dcp(path: PathLike, *, check_values: bool = False) -> FileReport:
    """Describe a plain torch.distributed.checkpoint folder (``dcp.save``, no tiekit marker)
    from DCP's metadata: its tensors, the file holding each one's first chunk, and no tie plan (it
    records none, and stores each name of a tie: ``check_values`` finds those copies). A shard
    file missing, or shorter than a chunk DCP's metadata places in it, is a `CheckpointError`
    naming it and a key it holds (checked by size, before any read). Local."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from tiekit.dcp.convert_source import plain_dcp_metadata

    folder = Path(path)
    metadata = plain_dcp_metadata(folder)
    first_file = _first_files(metadata, folder)
    tensors = []
    others = 0
    for key, info in metadata.state_dict_metadata.items():
        if not isinstance(info, TensorStorageMetadata):
            others += 1  # bytes DCP pickled: a step, a config
            continue
        size = info.properties.dtype.itemsize * math.prod(info.size)
        dtype = dtype_name(info.properties.dtype)
        tensors.append(StoredTensor(key, dtype, tuple(info.size), size, first_file.get(key, os.fspath(folder))))
    shown = {"non-tensor entries": str(others)} if others else {}
    return FileReport(
        path=os.fspath(folder),
        files=tuple(sorted(set(first_file.values()) | _all_files(metadata, folder))),
        tensors=tuple(tensors),
        side_tensors=0,
        side_bytes=0,
        plan=None,
        plan_origin="none",
        plan_version=None,
        checkpoint_version=None,
        metadata=shown,
        identical=_identical(folder, tensors) if check_values else None,
        kind="dcp",
    )


def _first_files(metadata: Metadata, folder: Path) -> dict[str, str]:
    """{name: the file holding its first chunk} from DCP's metadata."""
    first: dict[str, str] = {}
    for index, where in (metadata.storage_data or {}).items():
        first.setdefault(index.fqn, os.fspath(folder / where.relative_path))
    return first


def _all_files(metadata: Metadata, folder: Path) -> set[str]:
    return {os.fspath(folder / where.relative_path) for where in (metadata.storage_data or {}).values()}


def _identical(folder: Path, tensors: list[StoredTensor]) -> tuple[tuple[str, ...], ...]:
    """Groups of stored tensors with the same bytes (constant tensors left out): ties stored twice."""
    from tiekit.dcp.convert_source import dcp_read

    by_kind: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.shape), []).append(t.name)
    read = dcp_read(folder)
    groups: list[tuple[str, ...]] = []
    for names in by_kind.values():
        if len(names) < 2:
            continue
        digests: dict[bytes, list[str]] = {}
        for name in names:
            value = read([name])[name]  # a tensor saved by several ranks: its row chunks, in order
            digest = _digest(value if isinstance(value, list) else [value])
            if digest is not None:
                digests.setdefault(digest, []).append(name)
            del value
        groups.extend(tuple(g) for g in digests.values() if len(g) > 1)
    return tuple(groups)


#: `_digest` hashes and checks this many bytes at a time.
_PIECE_BYTES = 1 << 22


def _digest(chunks: list[torch.Tensor]) -> bytes | None:
    """SHA-256 of the bytes of the tensor whose row chunks are ``chunks`` (one after the other),
    and its dtype; None for a constant tensor (zeros, ones: equal without being ties). Piece by
    piece: joining the chunks, comparing every element at once and copying the bytes out held the
    tensor three times over (3 GiB to check a 1 GiB embedding)."""
    hasher = hashlib.sha256()
    first: torch.Tensor | None = None
    constant = True
    for chunk in chunks:
        flat = chunk.contiguous().reshape(-1)
        step = max(_PIECE_BYTES // max(flat.element_size(), 1), 1)
        for start in range(0, flat.numel(), step):
            piece = flat[start : start + step]
            if first is None:
                first = piece[0].clone()
            if constant and not bool((piece == first).all()):
                constant = False
            hasher.update(memoryview(host_bytes(piece)))  # type: ignore[arg-type]  # its own memory: no copy
    if first is None or constant:
        return None
    hasher.update(dtype_name(chunks[0].dtype).encode())
    return hasher.digest()
