"""A background save's copy of the state laid out as the checkpoint file itself.

A background save has to copy the state to host memory anyway (training changes it meanwhile).
`FileImage` lays that copy out as the file's bytes in one page-aligned block, so `write_image`
sends it to the file straight from there (past the page cache where allowed,
`tiekit.checkpoint.direct`), without a copy through a write buffer: 3-6 ms of CPU for 100 MB
instead of 20-28 ms on the test machine, CPU that a background save takes from training when
every core computes. Where the training state itself lives in the image (`tiekit.fit` moves it
there, `tiekit.checkpoint.deferred`), the image is `LentMemory`: written from in small chunks
until the training thread takes it back, then from a copy of what was not yet written.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tiekit.checkpoint.direct import aligned, open_new, ordered, round_up, safetensors_header, write_all

# Bytes per write from a lent image: the training step taking it back waits for one such write.
LENT_CHUNK = 2 << 20
# Room a FileImage leaves its header to grow by between saves (the step's digits, RNG states).
_HEADER_SLACK = 1024


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
    order = ordered(tensors, path)
    need = len(safetensors_header(order, metadata))
    layout = [(name, t.dtype, t.shape) for name, t in order]
    if reuse is not None and need <= reuse.head and layout == [(n, t.dtype, t.shape) for n, t in reuse.tensors.items()]:
        _putsafetensors_header(reuse, metadata)
        return reuse
    head = round_up(need + _HEADER_SLACK)
    size = head + sum(t.numel() * t.element_size() for _, t in order)
    memory = aligned(round_up(size))
    views: dict[str, torch.Tensor] = {}
    offset = head
    for name, t in order:  # safetensors' order keeps every tensor aligned to its element size
        length = t.numel() * t.element_size()
        views[name] = memory[offset : offset + length].view(t.dtype).view(t.shape)
        offset += length
    image = FileImage(memory, head, views)
    _putsafetensors_header(image, metadata)
    return image


def _putsafetensors_header(image: FileImage, metadata: Mapping[str, str]) -> None:
    header = safetensors_header(list(image.tensors.items()), metadata, size=image.head)
    image.memory[: image.head].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))


def write_image(image: FileImage, path: Path, *, direct: bool = True, lent: LentMemory | None = None) -> None:
    """Write ``image`` (its tensors filled) to ``path`` as a safetensors file, straight from its
    memory; ``direct``: past the page cache where allowed. With ``lent``, the image is memory
    training will change again: it is written in chunks, each from where `LentMemory` says its
    bytes are. ``OSError`` from the file system as it comes."""
    memory = image.memory.numpy()
    size = image.size
    direct = direct and hasattr(os, "O_DIRECT")
    length = round_up(size) if direct else size
    fd = open_new(path, direct=direct)
    try:
        if lent is None:
            write_all(fd, memory.data[:length], 0)
        else:
            lent.write_to(lambda piece, at: write_all(fd, piece, at), 0, length)
        if length != size:
            os.ftruncate(fd, size)  # the last block's padding is not part of the file
    finally:
        os.close(fd)


class LentMemory:
    """An image (a `FileImage`'s ``memory``, a sharded save's `tiekit.dcp.shard_image.ShardImage`)
    whose tensors are the training state itself (the parameters and optimizer state live in it,
    so a background save need not copy them), lent to the thread writing it until the training
    thread takes it back (`take_back`, before its next optimizer step). The writer asks for each
    chunk (`chunk`, then `written`); `take_back` waits for the chunk being written, then copies the
    bytes not yet written aside (aligned as in the image), where the writer takes the rest from:
    the step waits at most for one chunk's write and that copy. ``spare``: the image's list of
    aside memory from earlier saves (`FileImage.spare`), reused and added to."""

    def __init__(self, memory: np.ndarray, spare: list[np.ndarray]) -> None:
        self._memory = memory
        self._spare = spare
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

    def write_to(self, write: Callable[[memoryview, int], object], start: int, end: int) -> None:
        """Writing thread: bytes ``start:end`` of the image through ``write(piece, offset)``, in
        pieces of `LENT_CHUNK`, each asked for (`chunk`) and given back (`written`) in turn."""
        for at in range(start, end, LENT_CHUNK):
            stop = min(at + LENT_CHUNK, end)
            try:
                write(self.chunk(at, stop), at)
            finally:
                self.written(stop)

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
            whole = self._spare.pop() if self._spare else aligned(len(self._memory)).numpy()
            self._whole, self._aside = whole, whole[:rest]
            # torch's copy runs on the training thread's own (idle) OpenMP team: 1.7x numpy's here
            torch.from_numpy(self._aside).copy_(torch.from_numpy(self._memory[self._done :]))
            self._moved, self.copied = self._done, rest
            self._state.notify_all()
