"""`tiekit inspect PATH`: a checkpoint's tensors, ties, sizes and versions, read from its headers
(the index and the shards' headers for a sharded file, DCP's metadata for a `save_sharded` folder)
without loading any tensor unless values are compared."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiekit.checkpoint import PLAN_KEY, SAVE_ID_KEY, STATE_KEY, open_source
from tiekit.checkpoint.arguments import check_path
from tiekit.errors import CheckpointError
from tiekit.inspection.text import group_table, shorten, size_text, tied_bytes
from tiekit.plan import TiePlan, dtype_name

_HIDDEN_METADATA = {PLAN_KEY, STATE_KEY, SAVE_ID_KEY, "format", "total_size"}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor a checkpoint holds, as its header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str


@dataclass(frozen=True)
class FileReport:
    """A checkpoint's contents as far as its headers tell: tensors, ties, sizes, versions.

    ``plan_origin`` is ``"tiekit"`` (a tie plan is recorded), ``"safetensors"`` (only the
    ``removed -> kept`` names ``safetensors.torch.save_model`` writes) or ``"none"``.
    ``identical`` lists groups of stored tensors with byte-identical data (filled only when
    asked for, since it reads the data): candidates for ties that were stored twice. ``kind``:
    ``"safetensors"`` (a file, an index), ``"save_sharded"`` (a `tiekit.save_sharded` folder) or
    ``"dcp"`` (a plain torch.distributed.checkpoint folder).
    """

    path: str
    files: tuple[str, ...]
    tensors: tuple[StoredTensor, ...]
    side_tensors: int
    side_bytes: int
    plan: TiePlan | None
    plan_origin: str
    plan_version: int | None
    checkpoint_version: int | None
    metadata: Mapping[str, str]
    identical: tuple[tuple[str, ...], ...] | None = None
    kind: str = "safetensors"

    @property
    def stored_bytes(self) -> int:
        """Bytes of the model tensors in the file (optimizer state excluded)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def tied_names(self) -> tuple[str, ...]:
        """Names the file covers without storing them: tied names and views of stored tensors."""
        return () if self.plan is None else self.plan.tied_names

    @property
    def saved_bytes(self) -> int:
        """Bytes the file would need more if every tied name were stored as its own tensor."""
        if self.plan is None:
            return 0
        return tied_bytes(self.plan.groups)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (``tiekit inspect --json``)."""
        return {
            "path": self.path,
            "kind": self.kind,
            "files": list(self.files),
            "plan_origin": self.plan_origin,
            "plan_version": self.plan_version,
            "checkpoint_version": self.checkpoint_version,
            "stored_tensors": len(self.tensors),
            "names": len(self.tensors) + len(self.tied_names),
            "stored_bytes": self.stored_bytes,
            "saved_bytes": self.saved_bytes,
            "optimizer_tensors": self.side_tensors,
            "optimizer_bytes": self.side_bytes,
            "plan": None if self.plan is None else self.plan.to_dict(),
            "metadata": dict(self.metadata),
            "identical": None if self.identical is None else [list(g) for g in self.identical],
            "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes, "file": t.file}
                for t in self.tensors
            ],
        }

    def render(self, *, tensors: bool = False) -> str:
        """The human-readable report (``tiekit inspect PATH``)."""
        from tiekit.dcp.layout import DCP_METADATA

        data = sum(os.path.basename(f) != DCP_METADATA for f in self.files)  # DCP's metadata holds no tensor
        shards = f"{data} shard files" if data > 1 else "1 file"
        lines = [f"{self.path}: {shards}, {size_text(self.stored_bytes + self.side_bytes)} of tensors"]
        if self.plan_origin == "tiekit":
            assert self.plan is not None
            lines.append(f"  tie plan: recorded by tiekit (plan format v{self.plan_version})")
        elif self.plan_origin == "safetensors":
            lines.append("  tie plan: none recorded; safetensors.save_model listed the duplicates it dropped")
        elif self.kind == "dcp":
            lines.append("  tie plan: none recorded (a plain torch.distributed.checkpoint folder)")
        else:
            lines.append("  tie plan: none recorded (a plain safetensors / Hugging Face file)")
        names = len(self.tensors) + len(self.tied_names)
        lines.append(f"  tensors: {len(self.tensors)} stored for {names} names (unique vs total)")
        lines.append(
            f"  bytes: {size_text(self.stored_bytes)} stored, {size_text(self.saved_bytes)} saved by de-duplication"
            + (f" ({100 * self.saved_bytes / (self.stored_bytes + self.saved_bytes):.1f}%)" if self.saved_bytes else "")
        )
        if self.checkpoint_version is not None:
            lines.append(
                f"  training checkpoint (format v{self.checkpoint_version}): {self.side_tensors} optimizer/extra "
                f"tensors, {size_text(self.side_bytes)}"
            )
        dtypes: dict[str, int] = {}
        for t in self.tensors:
            dtypes[t.dtype] = dtypes.get(t.dtype, 0) + 1
        lines.append("  dtypes: " + ", ".join(f"{d} x{n}" for d, n in sorted(dtypes.items())))
        if self.plan is not None and self.plan.groups:
            lines.append("  tie groups (stored once, under the source name):")
            lines.extend("  " + line for line in group_table(self.plan.groups))
        elif self.plan_origin == "none":
            lines.append("  storage sharing is not visible in a file: every stored tensor has its own bytes;")
            lines.append(
                "  --check-values finds byte-identical tensors, `tiekit inspect module:factory` the model's ties"
            )
        if self.identical is not None:
            if self.identical:
                lines.append("  byte-identical stored tensors (ties stored twice?), constant tensors left out:")
                lines.extend("    " + ", ".join(g) for g in self.identical)
            else:
                lines.append("  byte-identical stored tensors: none (constant tensors left out)")
        if self.metadata:
            lines.append("  metadata: " + ", ".join(f"{k}={shorten(v)}" for k, v in sorted(self.metadata.items())))
        if tensors:
            lines.append("  stored tensors:")
            width = max(len(t.name) for t in self.tensors) if self.tensors else 0
            for t in self.tensors:
                shape = "x".join(map(str, t.shape)) or "scalar"
                lines.append(f"    {t.name.ljust(width)}  {t.dtype:<9} {shape:<12} {size_text(t.nbytes)}")
        return "\n".join(lines)


def inspect_file(path: str | os.PathLike[str], *, check_values: bool = False) -> FileReport:
    """Describe the checkpoint at ``path`` (a file, an index, a folder, a `tiekit.save_sharded`
    folder or a plain ``torch.distributed.checkpoint`` one) from its headers (DCP's metadata for
    a sharded folder).

    ``check_values`` also reads the data of tensors that share a dtype and shape and reports the
    byte-identical ones. Raises `CheckpointError` naming the file for anything unreadable.
    """
    from tiekit.dcp.layout import is_plain_dcp_folder, is_sharded_checkpoint, lost_its_marker, refuse_save_folder

    check_path(path, "inspection.inspect_file(path)")
    refuse_save_folder(path)  # a plain DCP folder to DCP, but read through its checkpoint's marker only
    # A save_sharded folder: its marker and DCP's metadata (without its marker, named as missing).
    if is_sharded_checkpoint(path) or lost_its_marker(path):
        from tiekit.dcp.report import inspect_sharded

        return inspect_sharded(path, check_values=check_values)
    if is_plain_dcp_folder(path):
        from tiekit.dcp.report import inspect_plain_dcp

        return inspect_plain_dcp(path, check_values=check_values)
    source = open_source(path)
    tensors = tuple(
        StoredTensor(name, dtype_name(entry.dtype), entry.shape, entry.end - entry.start, file)
        for name, (file, entry) in source.entries.items()
    )
    files = tuple(dict.fromkeys(file for file, _ in [*source.entries.values(), *source.side.values()]))
    plan_version = _version(source.metadata.get(PLAN_KEY), source.where, PLAN_KEY)
    checkpoint_version = _version(source.metadata.get(STATE_KEY), source.where, STATE_KEY)
    shown = {k: v for k, v in source.metadata.items() if k not in _HIDDEN_METADATA and isinstance(v, str)}
    if source.plan_origin == "safetensors":
        # Those entries are what the plan was rebuilt from; keep them out of "metadata".
        assert source.plan is not None
        shown = {k: v for k, v in shown.items() if k not in source.plan}
    identical = _identical(source.entries) if check_values else None
    return FileReport(
        path=source.where,
        files=files,
        tensors=tensors,
        side_tensors=len(source.side),
        side_bytes=sum(e.end - e.start for _, e in source.side.values()),
        plan=source.plan,
        plan_origin="none" if source.plan is None else source.plan_origin,
        plan_version=plan_version,
        checkpoint_version=checkpoint_version,
        metadata=shown,
        identical=identical,
    )


def _version(raw: Any, where: str, key: str) -> int | None:
    if raw is None:
        return None
    try:
        data = json.loads(raw) if isinstance(raw, str) else raw
        version = data["version"]
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise CheckpointError(f"{where}: corrupted {key!r} metadata: no version ({exc})") from exc
    if not isinstance(version, int):
        raise CheckpointError(f"{where}: corrupted {key!r} metadata: version {version!r} is not an integer")
    return version


def _identical(entries: Mapping[str, Any]) -> tuple[tuple[str, ...], ...]:
    # Only tensors of one dtype and shape can be copies of one another: hash just those.
    # Constant tensors (zero biases, fresh LayerNorm weights) are equal by construction, not
    # by a tie stored twice, and are left out, as `find_ties(check_values=True)` does.
    buckets: dict[tuple[Any, ...], list[str]] = {}
    for name, (_, entry) in entries.items():
        if entry.end - entry.start > entry.dtype.itemsize:
            buckets.setdefault((entry.dtype, entry.shape), []).append(name)
    found: list[tuple[str, ...]] = []
    for names in buckets.values():
        if len(names) < 2:
            continue
        by_digest: dict[bytes, list[str]] = {}
        for name in names:
            file, entry = entries[name]
            digest = _digest(file, entry.start, entry.end, entry.dtype.itemsize)
            if digest is not None:
                by_digest.setdefault(digest, []).append(name)
        found.extend(tuple(same) for same in by_digest.values() if len(same) > 1)
    return tuple(sorted(found))


def _digest(file: str, start: int, end: int, itemsize: int) -> bytes | None:
    """Hash of the bytes in ``[start, end)``; None when every element is the same."""
    digest = hashlib.blake2b(digest_size=16)
    first = b""
    constant = True
    try:
        with open(file, "rb") as f:
            f.seek(start)
            left = end - start
            while left:
                chunk = f.read(min(left, 1 << 24))  # a multiple of every itemsize
                if not chunk:
                    raise CheckpointError(f"{file}: truncated while reading tensor data")
                first = first or chunk[:itemsize]
                constant = constant and chunk == first * (len(chunk) // itemsize)
                digest.update(chunk)
                left -= len(chunk)
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read: {exc.strerror or exc}") from exc
    return None if constant else digest.digest()
