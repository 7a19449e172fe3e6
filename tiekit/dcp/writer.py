"""DCP's ``FileSystemWriter`` with its shard files written past the page cache, without checksums.

DCP writes each rank's shard file through a buffered Python file and ``fsync``s it before
closing it. For a durable save that page-cache detour is pure cost, and a background one pays it
in CPU taken from training (`tiekit.checkpoint.direct`). Here DCP's file system hands out a
`DirectFile` for every ``.distcp`` file it creates (``torch.save`` records are written into it as
into any stream; ``fileno()`` writes the last partial block before DCP's ``fsync``); ``.metadata``
and every read go through DCP's own code.

Each tensor of a shard file is a ``torch.save`` record, and ``torch.save`` computes a CRC32 of
every record it writes: 27 of the 35 ms of CPU that saving 50 MB takes here. ``torch.load``
never checks it (a record with a flipped data byte loads without complaint), so while a shard
file is written the computation is switched off (`torch.serialization.set_crc32_options`,
a process-wide option: ``torch.save`` calls of other threads in that moment also write zero
checksums; ``torch.load`` reads such files as any other) and set back afterwards. Without them a
record is a fixed prefix, the tensor's bytes and a fixed suffix, so `DurableWriter` writes each
from its layout's template (`tiekit.dcp.torch_records`): the bytes DCP's own loop would write,
in its order, with a few writes instead of ``torch.save``'s forty.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystem,
    FileSystemWriter,
    SerializationFormat,
    _StorageInfo,
)
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from tiekit.checkpoint.direct import DirectFile
from tiekit.dcp.torch_records import write_record

_checksums_lock = threading.Lock()
_writers_without_checksums = 0
_checksums_before = True


@contextmanager
def records_without_checksums() -> Iterator[None]:
    """``torch.save`` writes no CRC32 while any block of this kind runs in the process; the option
    is set back to what it was when the last one ends."""
    global _writers_without_checksums, _checksums_before
    if not hasattr(torch.serialization, "set_crc32_options"):  # torch < 2.6 always writes them
        yield
        return
    with _checksums_lock:
        if _writers_without_checksums == 0:
            _checksums_before = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _writers_without_checksums += 1
    try:
        yield
    finally:
        with _checksums_lock:
            _writers_without_checksums -= 1
            if _writers_without_checksums == 0:
                torch.serialization.set_crc32_options(_checksums_before)


class DirectFileSystem(FileSystem):
    """DCP's local file system, its new shard files opened as `DirectFile` streams and written
    without record checksums."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        if mode == "wb" and os.fspath(path).endswith(".distcp"):
            with records_without_checksums():
                if hasattr(os, "O_DIRECT"):
                    with DirectFile(Path(path)) as stream:
                        yield stream
                else:
                    with super().create_stream(path, mode) as stream:
                        yield stream
        else:
            with super().create_stream(path, mode) as stream:
                yield stream


class DurableWriter(FileSystemWriter):
    """A ``FileSystemWriter`` into ``folder`` that fsyncs every file and writes its shard files
    past the page cache where the file system allows, without record checksums.

    ``ready`` (optional) runs in DCP's local planning step, before this rank's plan is sent: it
    may wait (for the copies a background save makes beside training) or raise, and DCP then
    fails the save on every rank alike, before any rank writes a byte or waits for this one."""

    def __init__(self, folder: Path, ready: Callable[[], None] | None = None) -> None:
        super().__init__(folder, sync_files=True)
        self.fs = DirectFileSystem()
        self._ready = ready

    def prepare_local_plan(self, plan: Any) -> Any:
        if self._ready is not None:
            self._ready()
        return super().prepare_local_plan(plan)

    def write_data(self, plan: Any, planner: Any) -> Future[list[WriteResult]]:
        """DCP's one shard file of this rank, as its own single-thread loop writes it (the byte
        items, then each tensor as a ``torch.save`` record, then an ``fsync``), each record from
        its layout's template; DCP's loop where this writer was set up otherwise."""
        if not (
            self.single_file_per_rank
            and self.thread_count == 1
            and getattr(self, "serialization_format", SerializationFormat.TORCH_SAVE) == SerializationFormat.TORCH_SAVE
            and not getattr(getattr(self, "transforms", None), "extensions", ())
        ):
            return super().write_data(plan, planner)
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results = []
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            byte_items = [item for item in plan.items if item.type == WriteItemType.BYTE_IO]
            tensor_items = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
            for item in byte_items + tensor_items:
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(planner.resolve_data(item).getbuffer())
                else:
                    write_record(stream, _host_tensor(planner.resolve_data(item)))
                length = stream.tell() - offset
                results.append(
                    WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))
                )
            if self.sync_files:
                os.fsync(stream.fileno())
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


def _host_tensor(data: torch.Tensor) -> torch.Tensor:
    """The tensor DCP's loop writes for ``data``: on the host, owning exactly its storage."""
    tensor = data.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()  # a view: torch.save would write its whole storage
    return tensor
