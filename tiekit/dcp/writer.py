"""DCP's ``FileSystemWriter`` with its shard files written past the page cache.

DCP writes each rank's shard file through a buffered Python file and ``fsync``s it before
closing it. For a durable save that page-cache detour is pure cost, and a background one pays it
in CPU taken from training (`tiekit.checkpoint.direct`). Here DCP's file system hands out a
`DirectFile` for every ``.distcp`` file it creates (``torch.save`` records are written into it as
into any stream; ``fileno()`` writes the last partial block before DCP's ``fsync``); ``.metadata``
and every read go through DCP's own code.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from tiekit.checkpoint.direct import DirectFile


class DirectFileSystem(FileSystem):
    """DCP's local file system, its new shard files opened as `DirectFile` streams."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        if mode == "wb" and os.fspath(path).endswith(".distcp") and hasattr(os, "O_DIRECT"):
            with DirectFile(Path(path)) as stream:
                yield stream
        else:
            with super().create_stream(path, mode) as stream:
                yield stream


def durable_writer(folder: Path) -> FileSystemWriter:
    """A ``FileSystemWriter`` into ``folder`` that fsyncs every file and writes its shard files
    past the page cache where the file system allows."""
    writer = FileSystemWriter(folder, sync_files=True)
    writer.fs = DirectFileSystem()
    return writer
