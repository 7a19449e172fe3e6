"""`convert`: a sharded (DCP) checkpoint to a tied safetensors file or sharded folder, and back,
one tensor at a time.

Sources: a `save_sharded` folder, a plain DCP folder (``dcp.save`` output, which stores both
names of a tie: give ``plan=`` to merge them), or a safetensors file, index or folder that
`tiekit.load_model` reads. Names a plan ties are written once; when the source stores several of
them, their values are compared first and a difference is refused (merging would lose data).
Only model weights are converted: optimizer state, ``extra`` (and a training checkpoint's
``step``) stay in the source; the result's ``left_out`` names them, with a ``UserWarning``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiekit.checkpoint.arguments import check_path
from tiekit.checkpoint.files import removed_on_failure
from tiekit.checkpoint.layout import INDEX_SUFFIX, WEIGHTS_NAME, PathLike, parse_size
from tiekit.dcp.convert_plan import recorded_plan
from tiekit.dcp.convert_source import NON_TENSOR_ENTRIES, ConvertSource, open_convert_source
from tiekit.dcp.destinations import (
    refuse_existing_files,
    refuse_for_sharded_folder,
    refuse_held_checkpoint,
    refuse_overlap,
    refuse_unwritable,
)
from tiekit.dcp.layout import (
    MARKER_NAME,
    SAVE_PREFIX,
    is_plain_dcp_folder,
    is_sharded_checkpoint,
    new_save_id,
    reading_committed,
    write_marker,
)
from tiekit.dcp.stream import Spec, Value, nbytes, write_dcp, write_safetensors
from tiekit.errors import CheckpointError
from tiekit.plan import TiePlan, dtype_name

#: Bytes read from a DCP folder per read call (or the largest tensor, if larger): DCP plans each
#: call, so one call per tensor costs more than the reading for models of many small tensors.
READ_BATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class ConvertResult:
    """What `convert` wrote: the files, the keys stored, the names merged into their tie source;
    and ``left_out``, what the source holds beside the model's tensors that was not converted
    (``"optimizer state"``, ``"extra"``, ``"step"``, a plain DCP folder's non-tensor entries)."""

    files: tuple[str, ...]
    stored: tuple[str, ...]
    merged: tuple[str, ...]
    bytes: int
    left_out: tuple[str, ...] = ()


def convert(
    src: PathLike,
    dst: PathLike,
    *,
    plan: TiePlan | nn.Module | None = None,
    max_shard_size: int | str | None = None,
) -> ConvertResult:
    """Convert the checkpoint ``src`` into ``dst``, streaming (peak memory about the largest tensor).

    A sharded checkpoint folder (`save_sharded`, or a plain DCP folder) becomes a tied safetensors
    file when ``dst`` ends in ``.safetensors``, else a folder holding ``model.safetensors`` (or,
    with ``max_shard_size``, Hugging Face style shards and ``model.safetensors.index.json``). A
    safetensors file, index or folder becomes a `save_sharded` folder ``dst`` that `load_sharded`
    reads on any number of ranks (never a ``.safetensors`` file, and ``max_shard_size`` is refused:
    to reshard a safetensors checkpoint, `tiekit.load_model` it and `tiekit.save_model` it with
    ``max_shard_size``). ``plan`` (a `TiePlan`, or a model whose ties to take) adds ties
    the source does not record (the ties it records stay; a tie sharing a name with a recorded
    one is merged with it, under the recorded source; one naming no stored key is left out, and a
    ``plan`` none of whose ties names a stored key is refused). The destination must be a new path,
    outside the source, not a folder holding a checkpoint already; no file is replaced (with
    ``max_shard_size``, none named as a shard of ``dst`` either). Local: one process, no
    process group. `CheckpointError` naming the file and key on anything wrong, such as two tied
    names stored with different values. A source another process saves over while
    it is read is converted again from its new save.

    Only the model's tensors are converted. Optimizer state, ``extra`` (and the ``step`` of a
    `save_checkpoint` file) stay in the source: the result's ``left_out`` names what the source
    held, and a ``UserWarning`` says it. Resume training from the source itself.
    """
    result = convert_silently(src, dst, plan=plan, max_shard_size=max_shard_size)
    if result.left_out:
        warnings.warn(f"{os.fspath(src)}: tiekit.convert converted {converted(src, result)}", UserWarning, stacklevel=2)
    return result


def converted(src: PathLike, result: ConvertResult) -> str:
    """What a conversion took from ``src`` and what it left out, for its warning and the CLI."""
    shown = ", ".join(result.left_out)
    if any(item.startswith(NON_TENSOR_ENTRIES) for item in result.left_out):
        # A plain DCP folder (a framework's own checkpoint) names no model: every tensor was taken.
        return (
            "every tensor of this plain DCP folder (tiekit cannot tell a model's from optimizer state there); "
            f"left out, not being tensors: {shown}"
        )
    still = f"still in {os.fspath(src)}, which load_sharded / load_checkpoint read"
    return f"the model's tensors only; left out: {shown} ({still})"


def convert_silently(
    src: PathLike, dst: PathLike, *, plan: TiePlan | nn.Module | None = None, max_shard_size: int | str | None = None
) -> ConvertResult:
    """`convert`, without its warning about what it left out (the CLI prints that itself)."""
    check_path(src, "convert(src, dst)", "src")
    check_path(dst, "convert(src, dst)", "dst")
    if plan is not None and not isinstance(plan, TiePlan | nn.Module):
        raise CheckpointError(
            "tiekit.convert(src, dst, plan=...): plan must be a tiekit.TiePlan, a model or None, not a "
            + type(plan).__name__
        )
    for what, path in (("source", src), ("destination", dst)):
        if os.fspath(path) == "":
            raise CheckpointError(f"convert: the {what} is an empty path; give a file or folder")
    return reading_committed(Path(src), lambda: _convert(Path(src), Path(dst), plan, max_shard_size))


def _convert(src: Path, dst: Path, plan: TiePlan | nn.Module | None, max_shard_size: int | str | None) -> ConvertResult:
    refuse_overlap(src, dst)
    source = open_convert_source(src)
    tie_plan = recorded_plan(plan, source.plan, source.where, {spec[0] for spec in source.specs})
    specs, merged, checks = _layout(source, tie_plan)
    if source.where.endswith((".safetensors", INDEX_SUFFIX)) or not _is_dcp(src):
        refuse_for_sharded_folder(src, dst, max_shard_size)
        files = _to_dcp(source, specs, tie_plan, checks, dst)
    else:
        files = _to_safetensors(source, specs, tie_plan, checks, dst, max_shard_size)
    total = sum(nbytes(s) for s in specs)
    stored = tuple(s[0] for s in specs)
    return ConvertResult(tuple(os.fspath(f) for f in files), stored, merged, total, source.left_out)


def _is_dcp(path: Path) -> bool:
    return is_sharded_checkpoint(path) or is_plain_dcp_folder(path)


def _layout(source: ConvertSource, plan: TiePlan | None) -> tuple[list[Spec], tuple[str, ...], dict[str, str]]:
    """The specs to write (tied names dropped), the dropped names, and {dropped: source} to compare."""
    stored = {s[0]: s for s in source.specs}
    checks: dict[str, str] = {}
    for group in plan.groups if plan is not None else ():
        present = [m for m in group.members if m.name in stored and m.view is None]
        if not present:
            continue
        if group.source not in stored:
            raise CheckpointError(
                f"{source.where}: the plan ties {', '.join(group.names)} to key {group.source!r}, which it lacks"
            )
        for member in present[1:] if present[0].name == group.source else present:
            if member.name == group.source:
                continue
            a, b = stored[member.name], stored[group.source]
            if a[1] != b[1] or a[2] != b[2]:
                raise CheckpointError(
                    f"{source.where}: keys {member.name!r} {a[1]} {dtype_name(a[2])} and {group.source!r} {b[1]} "
                    f"{dtype_name(b[2])} are tied in the plan but stored with different shapes or dtypes"
                )
            checks[member.name] = group.source
    specs = [s for s in source.specs if s[0] not in checks]
    return specs, tuple(checks), checks


def _batches(source: ConvertSource, specs: list[Spec], checks: dict[str, str]) -> Iterator[tuple[str, Value]]:
    """Every spec's tensor in order, read in batches of about `READ_BATCH_BYTES` (or the largest
    tensor), each checked by `_check_tied`."""
    limit = max([READ_BATCH_BYTES, *(nbytes(s) for s in specs)])
    batch: list[str] = []
    size = 0
    for i, spec in enumerate(specs):
        batch.append(spec[0])
        size += nbytes(spec)
        if i < len(specs) - 1 and size + nbytes(specs[i + 1]) <= limit:
            continue
        values = source.read(batch)
        for key in batch:
            _check_tied(source, checks, key, values[key])
            yield key, _resolved(values.pop(key))
        batch, size = [], 0


def _resolved(value: Value) -> Value:
    """``value`` with conjugate and negative views materialized: DCP's shard files keep a saved
    ``x.conj()`` as one (torch.save does), whose memory holds the values before the conjugation."""
    if isinstance(value, list):
        return [part.resolve_conj().resolve_neg() for part in value]
    return value.resolve_conj().resolve_neg()


def _check_tied(source: ConvertSource, checks: dict[str, str], key: str, value: Value) -> None:
    """Every tied name the source also stores for ``key`` holds ``value``: else merging loses data."""
    for other, src in checks.items():
        if src != key:
            continue
        copy = whole(source.read([other])[other])
        if not torch.equal(copy, whole(value)):
            raise CheckpointError(
                f"{source.where}: refusing to merge tied keys {other!r} and {key!r}: their stored values differ "
                "(the tie was broken and trained); convert without this tie in the plan"
            )


def whole(value: Value) -> torch.Tensor:
    """A tensor read as its row chunks (`tiekit.dcp.chunks`), joined; a tensor as it is."""
    return torch.cat(value) if isinstance(value, list) else value


def _to_safetensors(
    source: ConvertSource,
    specs: list[Spec],
    plan: TiePlan | None,
    checks: dict[str, str],
    target: Path,
    max_shard_size: int | str | None,
) -> list[Path]:
    file = target if target.name.endswith(".safetensors") else target / WEIGHTS_NAME
    with _destination_errors(target):
        refuse_unwritable(file.parent, target)
        if file.parent == target:
            refuse_held_checkpoint(target)
        limit = None if max_shard_size is None else parse_size(max_shard_size)
        refuse_existing_files(file, sharded=limit is not None)
    kept = None if plan is None else TiePlan(plan.groups, plan.unique_count, plan.total_count)
    with removed_on_failure(file.parent):
        return write_safetensors(file, specs, kept, _batches(source, specs, checks), limit)


@contextlib.contextmanager
def _destination_errors(dst: Path) -> Iterator[None]:
    """Around the checks of the destination ``dst`` and the creation of its folder: an `OSError`
    there (a name too long, a read-only file system, no permission) is a `CheckpointError`
    naming ``dst``. Around nothing that reads the source, whose errors are its own."""
    try:
        yield
    except OSError as exc:
        raise CheckpointError(f"{dst}: cannot be written: {exc.strerror or exc}") from exc


def _to_dcp(
    source: ConvertSource, specs: list[Spec], plan: TiePlan | None, checks: dict[str, str], root: Path
) -> list[Path]:
    with _destination_errors(root):
        refuse_unwritable(root, root)
        refuse_held_checkpoint(root)
    save_id = new_save_id()
    folder = root / f"{SAVE_PREFIX}{save_id}"

    def read(key: str) -> torch.Tensor:
        # DCP's writer asks for tensors in its own order (largest first), one at a time.
        value = whole(source.read([key])[key])
        _check_tied(source, checks, key, value)
        return value

    tensors = {k: [list(shape), dtype_name(dtype)] for k, shape, dtype in specs}
    record: dict[str, Any] = {"state_version": 1, "extra": None, "optimizer": None, "tensors": tensors, "world_size": 1}
    record["torch"] = torch.__version__
    with removed_on_failure(root):
        with _destination_errors(root):
            root.mkdir(parents=True, exist_ok=True)
        try:
            write_dcp(folder, specs, read)
            write_marker(root, folder, save_id, plan, record)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)  # this convert's own new folder, named by no marker
            raise
    # No removal of other save folders, as a save's commit does: convert wrote into a folder that
    # held none (`refuse_held_checkpoint`), so any there now is another process's, still writing.
    return [root / MARKER_NAME, *sorted(folder.iterdir())]
