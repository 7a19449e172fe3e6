"""Writing tied checkpoints one tensor at a time: safetensors files and DCP folders whose tensors
arrive from a reader, so a conversion holds about one tensor in memory, not the model.

Safetensors: the header (every name, dtype, shape and offset) is known before the first byte,
so a file is the header followed by each tensor's bytes as it is read. The files are the ones
`tiekit.save_model` writes (the plan under ``tiekit.plan``; shards with a save id and an index
written last) and `tiekit.load_model` reads. DCP: ``dcp.save`` plans with meta tensors and a
planner that reads each tensor when DCP's writer asks for it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from tiekit.checkpoint.files import _fsync, _work_folder
from tiekit.checkpoint.layout import PLAN_KEY, SAVE_ID_KEY, index_of, shard_name
from tiekit.errors import CheckpointError
from tiekit.header import DTYPE_CODES
from tiekit.plan import TiePlan
from tiekit.tracebacks import chained

#: (key, shape, dtype) of each tensor to write, in order.
Spec = tuple[str, tuple[int, ...], torch.dtype]

#: A tensor to write, or its chunks along the first dimension in order (a DCP tensor saved by
#: several ranks, `tiekit.dcp.chunks`): their bytes one after the other are the tensor's.
Value = torch.Tensor | list[torch.Tensor]

#: How many bytes of tensors a DCP write streams before the cycles torch.save leaves are collected.
_RECLAIM_BYTES = 64 * 2**20


def nbytes(spec: Spec) -> int:
    size = spec[2].itemsize
    for d in spec[1]:
        size *= d
    return size


def _header(specs: Sequence[Spec], metadata: dict[str, str]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, shape, dtype in specs:
        if dtype not in DTYPE_CODES:
            raise CheckpointError(f"cannot write key {key!r}: safetensors cannot store {dtype}")
        end = offset + nbytes((key, shape, dtype))
        entries[key] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(text).to_bytes(8, "little") + text


def _write_file(
    path: Path, specs: Sequence[Spec], metadata: dict[str, str], tensors: Iterator[tuple[str, Value]]
) -> None:
    with open(path, "wb") as f:
        f.write(_header(specs, metadata))
        for key, shape, dtype in specs:
            name, value = _next_tensor(tensors)
            parts = value if isinstance(value, list) else [value]
            joined = (sum(p.shape[0] for p in parts), *parts[0].shape[1:]) if len(parts) > 1 else parts[0].shape
            if (
                name != key
                or tuple(joined) != shape
                or any(p.dtype != dtype or p.shape[1:] != shape[1:] for p in parts)
            ):
                got = ", ".join(f"{tuple(p.shape)} {p.dtype}" for p in parts)
                raise CheckpointError(f"{path}: key {key!r}: got {name!r} {got}")
            _write_parts(f, parts)
            # Dropped before the next tensor is read, so its memory is reused, not added to.
            del value, parts
    os.chmod(path, 0o644)


def _next_tensor(tensors: Iterator[tuple[str, Value]]) -> tuple[str, Value]:
    """The next key and tensor to write. The iterator reads them from the source: an `OSError` it
    raises is the source's (a file removed or unreachable), raised as a `CheckpointError` naming
    that file, so that the writer's callers do not take it for a failure to write the destination."""
    try:
        return next(tensors)
    except OSError as exc:
        raise _read_failure(exc) from exc


def _read_failure(exc: OSError) -> CheckpointError:
    """``exc``, raised reading a tensor to write, as a `CheckpointError` naming the file it names."""
    source = exc.filename if exc.filename is not None else "the source"
    return CheckpointError(f"{source}: cannot read the tensor to write: {exc.strerror or exc}")


def _write_parts(f: Any, parts: list[torch.Tensor]) -> None:
    """Write the bytes of ``parts`` one after the other (in a function of its own: a loop variable
    would hold the last part, a whole tensor, until the next one had been read)."""
    for part in parts:
        if part.numel():
            f.write(memoryview(cast(Any, part.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())))


def write_safetensors(
    target: Path,
    specs: Sequence[Spec],
    plan: TiePlan | None,
    tensors: Iterator[tuple[str, Value]],
    max_shard_size: int | None = None,
) -> list[Path]:
    """Write ``tensors`` (yielded in ``specs`` order) as one tied safetensors file ``target``, or
    as Hugging Face style shards of at most ``max_shard_size`` bytes (`shard_name`) plus
    ``<target>.index.json`` (written last: the commit). ``plan`` None: no tie plan recorded (the
    loader then takes the model's ties, as for any plain file). Returns the files written.

    Replaces no file: one that appears under a name being written meanwhile (another writer's)
    is a `CheckpointError` naming it, and the files this call had put in place are removed
    again, as on any failure. Local."""
    header = {"format": "pt"} if plan is None else {"format": "pt", PLAN_KEY: plan.to_json()}
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a name too long, a read-only file system, no permission
        why = exc.strerror or exc
        raise CheckpointError(f"{target.parent}: cannot create the folder of {target.name}: {why}") from exc
    total = sum(nbytes(s) for s in specs)
    if max_shard_size is None or total <= max_shard_size:
        return _publish_new([(target, lambda tmp: _write_file(tmp, specs, header, tensors))])
    shards: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + nbytes(spec) > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes(spec)
    files = [target.with_name(shard_name(target, i + 1, len(shards))) for i in range(len(shards))]
    save_id = secrets.token_hex(8)
    index = {
        "metadata": {"format": "pt", "total_size": total, SAVE_ID_KEY: save_id}
        | ({} if plan is None else {PLAN_KEY: plan.to_dict()}),
        "weight_map": {s[0]: file.name for file, part in zip(files, shards, strict=True) for s in part},
    }
    shard_meta = {"format": "pt", SAVE_ID_KEY: save_id}

    def shard(part: list[Spec]) -> Callable[[Path], None]:
        return lambda tmp: _write_file(tmp, part, shard_meta, tensors)

    writes: list[tuple[Path, Callable[[Path], object]]] = [
        (file, shard(part)) for file, part in zip(files, shards, strict=True)
    ]
    text = json.dumps(index, indent=2)
    writes.append((index_of(target), lambda tmp: tmp.write_text(text, encoding="utf-8")))
    return _publish_new(writes)


def _publish_new(writes: Sequence[tuple[Path, Callable[[Path], object]]]) -> list[Path]:
    """Write each file in a work folder beside the first (fsynced), then move each to its name,
    in order (the last one is the commit), replacing none. On any failure the files moved are
    removed again, and the work folder always. Returns the names written."""
    first = writes[0][0]
    try:
        work = _work_folder(first)
    except OSError as exc:
        raise CheckpointError(f"{first}: cannot write: {exc.strerror or exc}") from exc
    placed: list[Path] = []
    try:
        for target, write in writes:
            write(work / target.name)
            _fsync(work / target.name)
        for target, _ in writes:
            _move_new(work / target.name, target)
            placed.append(target)
        _fsync(first.parent)
    except BaseException as exc:
        for path in placed:
            with contextlib.suppress(OSError):
                path.unlink()
        if isinstance(exc, OSError):
            raise CheckpointError(f"{first}: cannot write: {exc.strerror or exc}") from exc
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return [target for target, _ in writes]


def _move_new(source: Path, target: Path) -> None:
    """Move ``source`` to ``target``, which must not exist: a hard link refuses an existing name
    atomically (a file another writer put there after convert checked); on a file system without
    hard links the name is checked, then renamed to."""
    try:
        os.link(source, target)
    except FileExistsError:
        raise CheckpointError(f"{target}: exists; convert writes a new checkpoint and replaces no file") from None
    except OSError:
        if target.exists() or target.is_symlink():
            raise CheckpointError(f"{target}: exists; convert writes a new checkpoint and replaces no file") from None
        os.replace(source, target)
        return
    source.unlink()


def write_dcp(folder: Path, specs: Sequence[Spec], read: Callable[[str], torch.Tensor]) -> None:
    """A DCP save (one process) of ``specs`` whose values ``read(key)`` returns when DCP writes them.

    An error of ``read`` (the source's: a refusal naming it, a file of it gone) is raised as it is
    (an `OSError` as a `CheckpointError` naming its file), not as DCP's failure to write ``folder``."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

    from tiekit.dcp.state import dcp_save, running_dcp

    unreclaimed = 0  # bytes handed to DCP since the last collection
    failed_reads: list[BaseException] = []  # what ``read`` raised inside DCP's writer, which wraps it

    class Streaming(DefaultSavePlanner):
        """Plans with meta tensors; DCP's writer asks for each tensor once, just before writing it."""

        def lookup_object(self, index: Any) -> Any:
            nonlocal unreclaimed
            # Torch before 2.14 leaves each tensor it saves in a reference cycle of torch.save's own
            # (measured on 2.9.1: every 32 MiB tensor written stayed held until a collection, so a
            # conversion held the model). The young generations hold that cycle; collecting them
            # once per _RECLAIM_BYTES bounds what is held, at a few ms each.
            if unreclaimed >= _RECLAIM_BYTES:
                gc.collect(1)
                unreclaimed = 0
            try:
                value = read(index.fqn)
            except BaseException as exc:
                failed_reads.append(_read_failure(exc) if isinstance(exc, OSError) else exc)
                raise
            unreclaimed += value.numel() * value.element_size()
            return value

    class NamingFileSystem(FileSystem):
        """DCP's local file system, remembering the last file it opened for writing (one at a
        time: one process, DCP's one writing thread): the file a failed write names."""

        writing: str | None = None

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            if "w" in mode:
                self.writing = os.fspath(path)
            with super().create_stream(path, mode) as stream:
                yield stream

    placeholders = {key: torch.empty(shape, dtype=dtype, device="meta") for key, shape, dtype in specs}
    files = NamingFileSystem()
    try:
        with running_dcp(folder, reading=False):
            # A file per tensor: torch's writer holds every tensor of a file until the file is done.
            writer = FileSystemWriter(folder, single_file_per_rank=False)
            writer.fs = files
            dcp_save(placeholders, storage_writer=writer, planner=Streaming(), no_dist=True)
    except CheckpointError as exc:
        if failed_reads:
            raise failed_reads[0] from None  # the source's error; DCP's message blamed the write
        refused = _write_error(exc)
        if refused is not None and files.writing is not None:
            raise CheckpointError(f"{files.writing}: cannot write: {refused.strerror or refused}") from exc
        raise


def _write_error(failure: CheckpointError) -> OSError | None:
    """The `OSError` (a full disk, a file size limit) under DCP's failure to write, which
    `running_dcp` raised as ``failure``: torch's zip writer reports it as its own RuntimeError
    ("unexpected pos 704 vs 598"), the `OSError` only its context."""
    for error in getattr(failure.__cause__, "failures", {}).values():
        for exc in chained(error[0] if isinstance(error, tuple) else error):  # DCP keeps (error, traceback)
            if isinstance(exc, OSError) and exc.errno is not None:
                return exc
    return None
