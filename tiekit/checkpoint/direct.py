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

A background save has to copy the state to host memory anyway (training changes it meanwhile).
`FileImage` lays that copy out as the file's bytes in one page-aligned block, so `write_image`
sends it to the file straight from there, without the copy through the write buffer: 3-6 ms of
CPU for 100 MB instead of 20-28 ms on the test machine, CPU that a background save takes from
training when every core computes. Where the training state itself lives in the image (`tiekit.fit`
moves it there, `tiekit.checkpoint.deferred`), the image is `LentMemory`: written from in small
chunks until the training thread takes it back, then from a copy of what was not yet written.
"""

from __future__ import annotations

import errno
import io
import json
import mmap
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiekit.errors import CheckpointError

BLOCK = 4096  # O_DIRECT wants buffer, offset and length aligned to the device's block (512 or 4096)
CHUNK = 8 << 20  # bytes per write
# Bytes per write from a lent image: the training step taking it back waits for one such write.
LENT_CHUNK = 2 << 20
_MAX_WRITE = 1 << 30  # Linux writes at most 2 GiB - 4 KiB per call

# safetensors' dtype codes and torch's names, in its writer's order (its Rust enum, compared in
# reverse): a file's tensors are sorted by this, then by name, which keeps each one aligned.
_CODES = {
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
    "F32": "float32",
    "U32": "uint32",
    "I32": "int32",
    "BF16": "bfloat16",
    "F16": "float16",
    "U16": "uint16",
    "I16": "int16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
_DTYPES = {getattr(torch, name): code for code, name in _CODES.items() if hasattr(torch, name)}
_RANK = {code: rank for rank, code in enumerate(_CODES)}

# What a file system without O_DIRECT (tmpfs on older kernels, some FUSE and network ones) answers.
_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}

# Aligned buffers free for the next file, shared by every writing thread of the process (DCP
# writes each background save from a thread of its own): a new one is 2,048 page faults.
_free_buffers: list[mmap.mmap] = []
_free_lock = threading.Lock()
_KEPT_BUFFERS = 2  # at most this many stay mapped while no file is written
# Room a FileImage leaves its header to grow by between saves (the step's digits, RNG states).
_HEADER_SLACK = 1024


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str], *, direct: bool = True
) -> None:
    """Write ``tensors`` (host tensors) and ``metadata`` to ``path`` as a safetensors file (the
    bytes ``safetensors.torch.save_file`` writes); ``direct``: past the page cache where allowed,
    else with ``save_file`` itself.

    `CheckpointError` for what safetensors cannot hold (a dtype it lacks, a tensor not on the CPU,
    two names for the same memory); ``OSError`` from the file system as it comes."""
    order = _ordered(tensors, path)
    if direct and hasattr(os, "O_DIRECT"):
        _write_direct(path, _header(order, metadata), order)
        return
    from safetensors.torch import save_file

    try:
        save_file({name: t.contiguous() for name, t in order}, os.fspath(path), metadata=dict(metadata))
    except (ValueError, RuntimeError, TypeError) as exc:
        raise CheckpointError(f"{path}: safetensors refused the tensors: {exc}") from exc


@dataclass(frozen=True)
class FileImage:
    """A safetensors file's bytes in one page-aligned block of host memory (``memory``): its
    first ``head`` bytes hold the header, padded with spaces, then every tensor of ``tensors``
    (views of ``memory``) in the file's order. The header area is a whole number of blocks, so the
    tensors stay where they are while the header's length changes from save to save.
    ``spare``: the aligned memory `LentMemory` copied this image's unwritten bytes into, kept for
    the next save into it (fresh memory costs page faults in the training step)."""

    memory: torch.Tensor
    head: int
    tensors: dict[str, torch.Tensor]
    spare: list[np.ndarray] = field(default_factory=list, compare=False, repr=False)

    @property
    def size(self) -> int:
        """The file's length in bytes."""
        return self.head + sum(t.numel() * t.element_size() for t in self.tensors.values())


def image_for(
    tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str], reuse: FileImage | None = None
) -> FileImage:
    """A `FileImage` with the names, shapes and dtypes of ``tensors`` (host tensors; their values
    are not copied) and its header for ``metadata`` written: ``reuse`` when it has that layout
    and room for the header, else new memory. `CheckpointError` (naming ``path``) for what
    safetensors cannot hold."""
    order = _ordered(tensors, path)
    need = len(_header(order, metadata))
    layout = [(name, t.dtype, t.shape) for name, t in order]
    if reuse is not None and need <= reuse.head and layout == [(n, t.dtype, t.shape) for n, t in reuse.tensors.items()]:
        _put_header(reuse, metadata)
        return reuse
    head = _round_up(need + _HEADER_SLACK)
    size = head + sum(t.numel() * t.element_size() for _, t in order)
    memory = _aligned(_round_up(size))
    views: dict[str, torch.Tensor] = {}
    offset = head
    for name, t in order:  # safetensors' order keeps every tensor aligned to its element size
        length = t.numel() * t.element_size()
        views[name] = memory[offset : offset + length].view(t.dtype).view(t.shape)
        offset += length
    image = FileImage(memory, head, views)
    _put_header(image, metadata)
    return image


def _put_header(image: FileImage, metadata: Mapping[str, str]) -> None:
    header = _header(list(image.tensors.items()), metadata, size=image.head)
    image.memory[: image.head].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))


def write_image(image: FileImage, path: Path, *, direct: bool = True, lent: LentMemory | None = None) -> None:
    """Write ``image`` (its tensors filled) to ``path`` as a safetensors file, straight from its
    memory; ``direct``: past the page cache where allowed. With ``lent``, the image is memory
    training will change again: it is written in chunks, each from where `LentMemory` says its
    bytes are. ``OSError`` from the file system as it comes."""
    memory = image.memory.numpy()
    size = image.size
    direct = direct and hasattr(os, "O_DIRECT")
    length = _round_up(size) if direct else size
    fd = _open_new(path, direct=direct)
    try:
        if lent is None:
            _write_all(fd, memory.data[:length], 0)
        else:
            for start in range(0, length, LENT_CHUNK):
                end = min(start + LENT_CHUNK, length)
                try:
                    _write_all(fd, lent.chunk(start, end), start)
                finally:
                    lent.written(end)
        if length != size:
            os.ftruncate(fd, size)  # the last block's padding is not part of the file
    finally:
        os.close(fd)


class LentMemory:
    """A `FileImage` whose tensors are the training state itself (the parameters and optimizer
    state live in it, so a background save need not copy them), lent to the thread writing it
    until the training thread takes it back (`take_back`, before its next optimizer step). The
    writer asks for each chunk (`chunk`, then `written`); `take_back` waits for the chunk being
    written, then copies the bytes not yet written aside (aligned as in the image), where the
    writer takes the rest from: the step waits at most for one chunk's write and that copy."""

    def __init__(self, image: FileImage) -> None:
        self._memory = image.memory.numpy()
        self._spare = image.spare
        self._state = threading.Condition()
        self._done = 0  # bytes of the image written to the file
        self._busy = False  # a chunk of the image itself is being written
        self._wanted = False  # the training thread waits to take the image back: no new chunk from it
        self._aside: np.ndarray | None = None  # the image's bytes from `_moved` on, once taken back
        self._moved = 0
        self._whole: np.ndarray | None = None  # the spare memory `_aside` is the start of
        self.copied = 0  # bytes `take_back` copied aside (0: the write was done in time)

    def chunk(self, start: int, end: int) -> memoryview:
        """Writing thread: where bytes ``start:end`` of the image are to be written from (the image,
        until it is taken back)."""
        with self._state:
            while self._wanted and self._aside is None:
                self._state.wait()
            if self._aside is None:
                self._busy = True
                return self._memory.data[start:end]
            return self._aside.data[start - self._moved : end - self._moved]

    def written(self, end: int) -> None:
        """Writing thread: the chunk asked for is written (or failed); the image's bytes up to ``end``
        are no longer needed (all of them once the write is over: ``end`` = the image's size)."""
        with self._state:
            self._busy = False
            self._done = max(self._done, end)
            self._state.notify_all()

    def close(self) -> None:
        """Writing thread: the write is over (done or failed); `take_back` has nothing to copy."""
        self.written(len(self._memory))
        with self._state:
            if self._whole is not None:
                self._spare.append(self._whole)  # for the next save into this image
                self._whole = None

    def take_back(self) -> None:
        """Training thread, before it changes the image: wait for the chunk under way, copy what is
        not yet written aside for the writer. At once when the write is over."""
        with self._state:
            self._wanted = True  # the writer starts no further chunk from the image
            while self._busy:
                self._state.wait()
            if self._aside is not None or self._done >= len(self._memory):
                return
            rest = len(self._memory) - self._done
            # New spare memory is as large as the image, so it serves every later save (pages are
            # touched only as far as they are used).
            whole = self._spare.pop() if self._spare else _aligned(len(self._memory)).numpy()
            self._whole, self._aside = whole, whole[:rest]
            # torch's copy runs on the training thread's own (idle) OpenMP team: 1.7x numpy's here
            torch.from_numpy(self._aside).copy_(torch.from_numpy(self._memory[self._done :]))
            self._moved, self.copied = self._done, rest
            self._state.notify_all()


def _round_up(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _aligned(size: int) -> torch.Tensor:
    """``size`` bytes of new host memory starting on a `BLOCK` boundary (not touched: no page faults yet)."""
    raw = torch.empty(size + BLOCK, dtype=torch.uint8)
    start = -raw.data_ptr() % BLOCK
    return raw[start : start + size]


def _ordered(tensors: Mapping[str, torch.Tensor], path: Path) -> list[tuple[str, torch.Tensor]]:
    """The tensors in safetensors' order (`_CODES`, then name); refuses what safetensors cannot hold."""
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


def _header(order: list[tuple[str, torch.Tensor]], metadata: Mapping[str, str], size: int | None = None) -> bytes:
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
        self._fd = _open_new(self.path, direct=True)
        self._mapped = _take_buffer()
        # numpy copies release the GIL (an mmap slice assignment would hold it): a background
        # save does not stop the training thread while it fills the buffer.
        self._buffer = np.frombuffer(self._mapped, dtype=np.uint8)
        self._base = 0  # the file offset of the buffer's first byte, a multiple of CHUNK
        self._filled = 0  # bytes in the buffer
        self._synced = 0  # bytes of the buffer already on disk (written at fileno())

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        piece = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
        size = len(piece)
        while len(piece):
            n = min(len(piece), CHUNK - self._filled)
            self._buffer[self._filled : self._filled + n] = piece[:n]
            piece, self._filled = piece[n:], self._filled + n
            if self._filled == CHUNK:
                self._write_at(self._base, CHUNK)
                self._base, self._filled, self._synced = self._base + CHUNK, 0, 0
        return size

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
        padded = _round_up(self._filled)
        self._buffer[self._filled : padded] = 0
        self._write_at(self._base, padded)
        os.ftruncate(self._fd, self._base + self._filled)  # the padding is not part of the file
        self._synced = self._filled

    def _write_at(self, offset: int, length: int) -> None:
        _write_all(self._fd, memoryview(self._mapped)[:length], offset)


def _open_new(path: Path, *, direct: bool) -> int:
    """A new (or emptied) file for writing; with ``direct``, past the page cache where accepted."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct:
        try:
            return os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o666)
        except OSError as exc:
            if exc.errno not in _REFUSED:
                raise
    return os.open(path, flags, 0o666)


def _write_all(fd: int, data: memoryview, offset: int) -> None:
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
            yield t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


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
