"""Write files past the page cache where the system allows.

A write through the page cache costs the kernel's work of finding (on a VM, often growing into)
and filling its pages: 40-150 ms of CPU for 100 MB with ``safetensors.torch.save_file`` on this
project's 2-core test machine, taken from training when a save runs in the background.
`DirectFile` is a stream that opens its file with ``O_DIRECT`` where the platform and the file
system accept it and sends the bytes written to it through one reused, page-aligned 8 MiB
buffer: 11-12 ms of CPU for the same 100 MB. `write_safetensors` writes through it the bytes
``save_file`` writes (the header built as safetensors builds it; the tests compare them with
safetensors' own), and sharded saves give it to torch.distributed.checkpoint as the stream of
each shard file (`tiekit.dcp.writer`). Where ``O_DIRECT`` is refused, the same bytes go through
the page cache; saves that do not wait for the disk use ``save_file`` itself.
A background save writes from a file image instead (`tiekit.checkpoint.image`).
"""

from __future__ import annotations

import errno
import io
import json
import mmap
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tiekit.errors import CheckpointError
from tiekit.header import DTYPES

if TYPE_CHECKING:
    from tiekit.checkpoint.image import LentMemory

BLOCK = 4096  # O_DIRECT wants buffer, offset and length aligned to the device's block (512 or 4096)
CHUNK = 8 << 20  # bytes per write
_MAX_WRITE = 1 << 30  # Linux writes at most 2 GiB - 4 KiB per call
_SMALL_WRITE = 4096  # pieces below this are copied holding the GIL (cheaper per call than numpy)

# safetensors' dtype codes in its writer's order (its Rust enum, compared in reverse; read from the
# files safetensors 0.8 writes): a file's tensors are sorted by this, then by name, which keeps
# each one aligned. Every code safetensors stores: `tiekit.header` reads them all.
_ORDER = (
    "U64",
    "I64",
    "F64",
    "C64",
    "F32",
    "U32",
    "I32",
    "BF16",
    "F16",
    "U16",
    "I16",
    "F8_E5M2FNUZ",
    "F8_E4M3FNUZ",
    "F8_E8M0",
    "F8_E4M3",
    "F8_E5M2",
    "I8",
    "U8",
    "BOOL",
)
_DTYPES = {DTYPES[code]: code for code in _ORDER if code in DTYPES}  # those this torch has
_RANK = {code: rank for rank, code in enumerate(_ORDER)}

# What a file system without O_DIRECT (tmpfs on older kernels, some FUSE and network ones) answers.
_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}

# Aligned buffers free for the next file, shared by every writing thread of the process (DCP
# writes each background save from a thread of its own): a new one is 2,048 page faults.
_free_buffers: list[mmap.mmap] = []
_free_lock = threading.Lock()
_KEPT_BUFFERS = 2  # at most this many stay mapped while no file is written


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str], *, direct: bool = True
) -> None:
    """Write ``tensors`` (host tensors) and ``metadata`` to ``path`` as a safetensors file (the
    bytes ``safetensors.torch.save_file`` writes); ``direct``: past the page cache where allowed,
    else with ``save_file`` itself.

    `CheckpointError` for what safetensors cannot hold (a dtype it lacks, a tensor not on the CPU,
    two names for the same memory); ``OSError`` from the file system as it comes."""
    order = ordered(tensors, path)
    if direct and hasattr(os, "O_DIRECT"):
        _write_direct(path, safetensors_header(order, metadata), order)
        return
    from safetensors.torch import save_file

    # save_file writes a conjugate view's memory, the values before the conjugation: resolved first.
    resolved = {name: t.resolve_conj().resolve_neg().contiguous() for name, t in order}
    try:
        save_file(resolved, os.fspath(path), metadata=dict(metadata))
    except (ValueError, RuntimeError, TypeError) as exc:
        raise CheckpointError(f"{path}: safetensors refused the tensors: {exc}") from exc


def round_up(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def aligned(size: int) -> torch.Tensor:
    """``size`` bytes of new host memory starting on a `BLOCK` boundary (not touched: no page faults yet)."""
    raw = torch.empty(size + BLOCK, dtype=torch.uint8)
    start = -raw.data_ptr() % BLOCK
    return raw[start : start + size]


def ordered(tensors: Mapping[str, torch.Tensor], path: Path) -> list[tuple[str, torch.Tensor]]:
    """The tensors in safetensors' order (`_ORDER`, then name); refuses what safetensors cannot hold."""
    seen: dict[tuple[int, int], str] = {}
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise CheckpointError(f"{path}: tensor {name!r} is on {t.device}, not on the CPU")
        if t.dtype not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        if t.numel():
            where = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
            if where in seen:
                raise CheckpointError(f"{path}: tensors {seen[where]!r} and {name!r} share memory; save one of them")
            seen[where] = name
    return sorted(tensors.items(), key=lambda item: (_RANK[_DTYPES[item[1].dtype]], item[0]))


def safetensors_header(
    order: list[tuple[str, torch.Tensor]], metadata: Mapping[str, str], size: int | None = None
) -> bytes:
    """8 bytes of header length, then the JSON header padded with spaces to a multiple of 8, or
    to ``size`` bytes in all (the format allows trailing whitespace; `FileImage` reserves room)."""
    entries: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in order:
        length = t.numel() * t.element_size()
        entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + length]}
        offset += length
    text = json.dumps(entries, separators=(",", ":")).encode()
    if size is not None and 8 + len(text) > size:
        raise CheckpointError(f"the header needs {8 + len(text)} bytes; the file image has room for {size}")
    text += b" " * ((size - 8 - len(text)) if size is not None else -(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text


def _write_direct(path: Path, head: bytes, order: list[tuple[str, torch.Tensor]]) -> None:
    with DirectFile(path) as out:
        for piece in _pieces(head, order):
            out.write(piece)


class DirectFile(io.RawIOBase):
    """A new file written past the page cache (``O_DIRECT``) through an aligned buffer: a stream
    with ``write``, ``tell``, ``fileno`` and ``close`` for writers such as ``torch.save`` and
    torch.distributed.checkpoint's ``FileSystemWriter``. Full 8 MiB chunks go to the file as
    they fill; the last partial block when ``fileno()`` (asked for just before an ``fsync``)
    or ``close()`` is called, padded and the padding cut off again, so the file holds exactly
    the bytes written. Where the file system refuses ``O_DIRECT`` (at open or at the first
    write), the same writes go through the page cache."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)
        self._fd = open_new(self.path, direct=True)
        self._mapped = _take_buffer()
        # numpy copies release the GIL (an mmap slice assignment would hold it): a background
        # save does not stop the training thread while it fills the buffer.
        self._buffer = np.frombuffer(self._mapped, dtype=np.uint8)
        self._base = 0  # the file offset of the buffer's first byte, a multiple of BLOCK
        self._filled = 0  # bytes in the buffer
        self._synced = 0  # bytes of the buffer already on disk (written at fileno())

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.nbytes < _SMALL_WRITE and self._filled + view.nbytes < CHUNK:
            # torch.save hands a record's zip headers over in pieces of a few bytes, about 40
            # calls per record: through numpy they were most of a sharded save's Python time, which
            # a background save takes from the training thread (it waits for the GIL).
            self._mapped[self._filled : self._filled + view.nbytes] = view
            self._filled += view.nbytes
            return view.nbytes
        piece = np.frombuffer(view, dtype=np.uint8)  # the bytes, whatever the item type of ``data``
        size = len(piece)
        while len(piece):
            n = min(len(piece), CHUNK - self._filled)
            self._buffer[self._filled : self._filled + n] = piece[:n]
            piece, self._filled = piece[n:], self._filled + n
            if self._filled == CHUNK:
                self._write_at(self._base, CHUNK)
                self._base, self._filled, self._synced = self._base + CHUNK, 0, 0
        return size

    def write_from(self, memory: memoryview, lent: LentMemory | None = None) -> None:
        """At the start of the file: ``memory`` (its address a multiple of `BLOCK`, as a mapping's
        is) as the file's first bytes, its whole blocks written from where they are, with no copy
        into the buffer; its last partial block is copied and later writes follow it. ``lent``:
        ``memory`` is training state lent to this writer (`LentMemory`), asked for chunk by chunk."""
        if self.tell() != 0:
            raise ValueError(f"{self.path}: write_from writes a file's first bytes; {self.tell()} are written")
        size = len(memory)
        whole = size // BLOCK * BLOCK
        if lent is None:
            for start in range(0, whole, CHUNK):  # in the pieces the buffer would have written
                write_all(self._fd, memory[start : min(start + CHUNK, whole)], start)
            self._base = whole
            self.write(memory[whole:])
            return
        lent.write_to(lambda piece, at: write_all(self._fd, piece, at), 0, whole)
        self._base = whole
        lent.write_to(lambda piece, _: self.write(piece), whole, size)  # the last partial block

    def tell(self) -> int:
        return self._base + self._filled

    def fileno(self) -> int:
        """The file descriptor, every byte written so far in the file (an ``fsync`` follows)."""
        self._write_tail()
        return self._fd

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._write_tail()
        finally:
            os.close(self._fd)
            _give_back(self._mapped)
            super().close()

    def _write_tail(self) -> None:
        if self._filled == self._synced:
            return
        padded = round_up(self._filled)
        self._buffer[self._filled : padded] = 0
        self._write_at(self._base, padded)
        os.ftruncate(self._fd, self._base + self._filled)  # the padding is not part of the file
        self._synced = self._filled

    def _write_at(self, offset: int, length: int) -> None:
        write_all(self._fd, memoryview(self._mapped)[:length], offset)


def open_new(path: Path, *, direct: bool) -> int:
    """A new (or emptied) file for writing; with ``direct``, past the page cache where accepted."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct:
        try:
            return os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o666)
        except OSError as exc:
            if exc.errno not in _REFUSED:
                raise
    return os.open(path, flags, 0o666)


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """``data`` at ``offset`` (aligned to `BLOCK` for an ``O_DIRECT`` file), in writes the kernel
    takes whole; an ``O_DIRECT`` write the file system refuses goes through the page cache."""
    done = 0
    while done < len(data):
        try:
            done += os.pwrite(fd, data[done : done + _MAX_WRITE], offset + done)
        except OSError as exc:
            # Some file systems accept O_DIRECT at open and refuse the write: buffered then.
            import fcntl  # not on every platform; only Linux-like ones have O_DIRECT

            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if exc.errno not in _REFUSED or not flags & getattr(os, "O_DIRECT", 0):
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)


def _pieces(head: bytes, order: list[tuple[str, torch.Tensor]]) -> Iterator[np.ndarray]:
    yield np.frombuffer(head, dtype=np.uint8)
    for _, t in order:
        if t.numel():
            yield host_bytes(t)


def host_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes a safetensors file holds for the host tensor ``t`` (its values, row-major): its
    own memory where that is contiguous, no copy. A conjugate or negative view (``x.conj()``) is
    materialized first, one copy: its memory holds the values before the lazy conjugation (and
    torch refuses a dtype view of it)."""
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def _take_buffer() -> mmap.mmap:
    """A page-aligned write buffer (anonymous memory is aligned to a page), reused from an
    earlier file where one is free."""
    with _free_lock:
        if _free_buffers:
            return _free_buffers.pop()
    return mmap.mmap(-1, CHUNK)


def _give_back(buffer: mmap.mmap) -> None:
    with _free_lock:
        if len(_free_buffers) < _KEPT_BUFFERS:
            _free_buffers.append(buffer)
            return
    buffer.close()
