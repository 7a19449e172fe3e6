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
checksums; ``torch.load`` reads such files as any other) and set back afterwards.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from tiekit.checkpoint.direct import DirectFile

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
