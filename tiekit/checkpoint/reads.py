"""Reading tensor bytes from validated files straight into tensors, in parallel chunks."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar, cast

import torch

from tiekit.errors import CheckpointError
from tiekit.header import FileIdentity, TensorEntry, file_identity

_CHUNK = 1 << 23
_WORKERS = 8
_Chunk = tuple[int, memoryview, int, TensorEntry, str]  # descriptor, destination, offset, entry, path

T = TypeVar("T")

#: A load starts over when a checkpoint it validated is replaced before it reads it (another
#: process saved over it meanwhile: an evaluator beside training); at most this many attempts.
READ_ATTEMPTS = 5


class ReplacedWhileReading(CheckpointError):
    """A file changed on disk between its validation and its first read; nothing was read."""


def reading_again(load: Callable[[], T]) -> T:
    """``load()``, started over while a file it validated is replaced before it reads it (at
    most `READ_ATTEMPTS` attempts; then that error is raised). Local."""
    for _ in range(READ_ATTEMPTS - 1):
        try:
            return load()
        except ReplacedWhileReading:
            continue
    return load()


class TensorReader:
    """Open files and reader threads kept for many reads: a load that streams batch after batch
    opens each file and starts its threads once (a new pool per 16 MiB batch spent 0.26 s of a
    1.27 s load of GPT-2 starting threads, on this loaded 2-core machine).

    Reads are cut in 8 MiB chunks and issued from a few threads (``os.preadv`` releases the
    GIL): one thread copying from the page cache is half as fast as two on this 2-core machine.
    Every file is opened, and checked to be the one validated, before its first byte is read:
    an open descriptor keeps reading that file even if a save replaces it meanwhile.
    """

    def __init__(self, files: Mapping[str, FileIdentity]) -> None:
        self._files = files
        self._fds: dict[str, int] = {}
        self._pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Wait for every read started (none writes into memory freed after), close the files."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def open(self, paths: set[str]) -> None:
        """Open and check every file now, before the first byte of a read in several steps."""
        for path in sorted(paths):
            self._open(path)

    def read(self, reads: list[tuple[str, TensorEntry, torch.Tensor]]) -> None:
        """Read each entry's bytes into its contiguous CPU tensor, with no intermediate copy."""
        chunks = self._chunks(reads)
        if len(chunks) == 1 or self._workers() == 1:
            for chunk in chunks:
                _read_chunk(*chunk)
        else:
            self.wait(self._submit(chunks))

    def start(self, reads: list[tuple[str, TensorEntry, torch.Tensor]]) -> list[Future[None]]:
        """Begin reading each entry into its tensor in the background (the caller meanwhile
        does other work, a transfer); `wait` on the result before using the tensors."""
        chunks = self._chunks(reads)
        if self._workers() > 1:
            return self._submit(chunks)
        done: Future[None] = Future()  # no threads to read with: read now
        try:
            for chunk in chunks:
                _read_chunk(*chunk)
        except BaseException as exc:  # noqa: BLE001 - handed to wait(), which raises it
            done.set_exception(exc)
        else:
            done.set_result(None)
        return [done]

    def _chunks(self, reads: list[tuple[str, TensorEntry, torch.Tensor]]) -> list[_Chunk]:
        chunks: list[_Chunk] = []
        for path, entry, out in reads:
            size = entry.end - entry.start
            if size == 0:
                continue
            handle = self._open(path)
            view = memoryview(cast(Any, out.reshape(-1).view(torch.uint8).numpy()))
            chunks.extend((handle, view[a : a + _CHUNK], entry.start + a, entry, path) for a in range(0, size, _CHUNK))
        return chunks

    @staticmethod
    def _workers() -> int:
        return min(_WORKERS, torch.get_num_threads()) if hasattr(os, "preadv") else 1

    def _submit(self, chunks: list[_Chunk]) -> list[Future[None]]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._workers())
        return [self._pool.submit(_read_chunk, *chunk) for chunk in chunks]

    @staticmethod
    def wait(started: list[Future[None]]) -> None:
        """Wait for reads begun by `start`; raises the first reader's error (after all finished)."""
        errors = [exc for future in started if (exc := future.exception()) is not None]
        if errors:
            raise errors[0]

    def _open(self, path: str) -> int:
        if path in self._fds:
            return self._fds[path]
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot open: {exc.strerror or exc}") from exc
        self._fds[path] = fd  # closed by close() from here on
        try:
            now = file_identity(os.fstat(fd))
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot open: {exc.strerror or exc}") from exc
        if path in self._files and now != self._files[path]:
            raise ReplacedWhileReading(
                f"{path}: changed on disk after its header was checked (replaced by another save?); "
                "nothing was loaded, load again"
            )
        return fd


def read_into(reads: list[tuple[str, TensorEntry, torch.Tensor]], files: Mapping[str, FileIdentity]) -> None:
    """Read each entry's bytes into its contiguous CPU tensor, with no intermediate copy (`TensorReader`)."""
    with TensorReader(files) as reader:
        reader.read(reads)


def _read_chunk(fd: int, view: memoryview, offset: int, entry: TensorEntry, path: str) -> None:
    done = 0
    while done < len(view):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view[done:]], offset + done)
        else:
            os.lseek(fd, offset + done, os.SEEK_SET)
            n = os.readv(fd, [view[done:]])
        if n <= 0:
            raise CheckpointError(f"{path}: truncated while reading key {entry.name!r} (did the file change?)")
        done += n


def read_tensor(path: str, entry: TensorEntry, files: Mapping[str, FileIdentity]) -> torch.Tensor:
    return read_tensors({entry.name: (path, entry)}, files)[entry.name]


def read_tensors(
    entries: Mapping[str, tuple[str, TensorEntry]], files: Mapping[str, FileIdentity]
) -> dict[str, torch.Tensor]:
    """Each ``key: (file, entry)`` read into a new CPU tensor, all in one `read_into`."""
    out = {key: torch.empty(entry.shape, dtype=entry.dtype) for key, (_, entry) in entries.items()}
    read_into([(path, entry, out[key]) for key, (path, entry) in entries.items()], files)
    return out
