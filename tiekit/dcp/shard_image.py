"""A background sharded save's host copies, laid out as the shard file that holds them.

A background save copies the state into host memory, and its writer then wrote each copy's
``torch.save`` record through `DirectFile`'s buffer: a second pass over every byte (100 MB of
memory traffic per 100 MB saved, beside training). A `ShardImage` is page-aligned memory holding
the records themselves back to back: each record's prefix and suffix (its layout's template,
`tiekit.dcp.torch_records`, written once) around the tensor's bytes, which are the host copies
(each a tensor owning exactly its slot, so that it is its own record's contents). The writer
sends the image to the shard file from where it is (`DirectFile.write_from`), then anything
else DCP planned for the rank after it.

Records start on 64-byte boundaries (so does each tensor's data, torch.save aligns it within its
record): the gaps between records are a few bytes no record names. An image is reused by each
save of the same layout; a save whose plan leaves out a record of it (DCP gave a replicated
tensor to another rank) is written record by record instead, as it was before.

The optimizer's state may go on living in the image (`tiekit.fit` moves it there): the next save
then writes it from where it is, without a copy, the image lent to the writer (`lend`) until the
next optimizer step takes it back.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tiekit.checkpoint.image import LentMemory
from tiekit.dcp.torch_records import layout_of, record_template

_RECORD_ALIGNMENT = 64


@dataclass(frozen=True)
class Slot:
    """One record of an image: where it starts, where its tensor's bytes start, where it ends."""

    start: int
    data: int
    end: int
    layout: tuple[Any, ...]


class ShardImage:
    """The records of new contiguous tensors of the given shapes and dtypes, in that order:
    ``tensors`` are the tensors (in the image's memory), ``records()`` the bytes of the file they
    make. Layouts without a template (`record_template`) have no slot: ``tensors`` holds None for them."""

    def __init__(self, layouts: Sequence[tuple[torch.Size, torch.dtype]]) -> None:
        templates = [record_template(shape, dtype) for shape, dtype in layouts]
        self.slots: list[Slot | None] = []
        offset = 0
        for (shape, dtype), template in zip(layouts, templates, strict=True):
            if template is None:
                self.slots.append(None)
                continue
            layout, prefix, suffix = template
            start = -(-offset // _RECORD_ALIGNMENT) * _RECORD_ALIGNMENT
            data = start + len(prefix)
            end = data + shape.numel() * dtype.itemsize + len(suffix)
            self.slots.append(Slot(start, data, end, layout))
            offset = end
        self.size = offset
        self._memory = mmap.mmap(-1, max(offset, 1))  # page-aligned, as O_DIRECT wants it
        self.tensors: list[torch.Tensor | None] = []
        for (shape, dtype), template, slot in zip(layouts, templates, self.slots, strict=True):
            if slot is None or template is None:
                self.tensors.append(None)
                continue
            _, prefix, suffix = template
            self._memory[slot.start : slot.data] = prefix
            self._memory[slot.end - len(suffix) : slot.end] = suffix
            # A tensor owning exactly its slot's bytes: its record is its slot.
            count = shape.numel()
            self.tensors.append(torch.frombuffer(self._memory, dtype=dtype, count=count, offset=slot.data).view(shape))
        self._at = {slot.data: i for i, slot in enumerate(self.slots) if slot is not None}
        self._bytes = np.frombuffer(self._memory, dtype=np.uint8)
        self._base = int(self._bytes.ctypes.data)
        self._spare: list[np.ndarray] = []  # `LentMemory`'s aside memory, kept for the next save

    def lend(self) -> LentMemory:
        """The image as memory training goes on changing once taken back (its tensors hold
        training state): the writer asks for it chunk by chunk (`LentMemory`)."""
        return LentMemory(self._bytes[: self.size], self._spare)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory is in this image."""
        return 0 <= t.data_ptr() - self._base < self.size

    def records(self) -> memoryview:
        """The image's bytes: the file its records make (gaps included)."""
        return memoryview(self._memory)[: self.size]

    def placement(self, tensors: Sequence[torch.Tensor]) -> list[Slot | None]:
        """For each of ``tensors`` (what DCP resolved this rank's planned tensors to), its slot if
        it is one of this image's tensors (the first time it is met), else None."""
        found: list[Slot | None] = []
        used: set[int] = set()
        for t in tensors:
            i = self._at.get(t.data_ptr() - self._base)
            slot = None if i is None or i in used else self.slots[i]
            if slot is not None and layout_of(t) != slot.layout:
                slot = None
            if slot is not None and i is not None:
                used.add(i)
            found.append(slot)
        return found

    def covers(self, placed: Sequence[Slot | None]) -> bool:
        """Whether ``placed`` (a `placement`) holds every slot of the image: the image written
        whole then holds their records, and nothing planned for another rank."""
        return bool(self._at) and sum(slot is not None for slot in placed) == len(self._at)
