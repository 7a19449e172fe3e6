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
in its order, with a few writes instead of ``torch.save``'s forty. A background save's copies
are already laid out as those records (`tiekit.dcp.shard_image`): they go to the file from where
they are.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Generator, Sequence
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
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from tiekit.checkpoint.direct import DirectFile
from tiekit.checkpoint.image import LentMemory
from tiekit.dcp.shard_image import ShardImage, Slot
from tiekit.dcp.torch_records import records_without_checksums, write_record
from tiekit.errors import CheckpointError


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
    fails the save on every rank alike, before any rank writes a byte or waits for this one.
    ``confirm`` (optional) runs once this rank's shard file is written and synced: it may wait (for
    the training thread to check the copies written) or raise, failing the save on every rank
    before any of them writes the metadata."""

    def __init__(
        self,
        folder: Path,
        ready: Callable[[], None] | None = None,
        image: ShardImage | None = None,
        *,
        lent: LentMemory | None = None,
        confirm: Callable[[], None] | None = None,
    ) -> None:
        """``image``: the `ShardImage` holding the host copies being written, if any; ``lent``: that
        image lent by training (`ShardImage.lend`), asked for chunk by chunk."""
        super().__init__(folder, sync_files=True)
        self.fs = DirectFileSystem()
        self._ready = ready
        self._image = image
        self._lent = lent
        self._confirm = confirm
        self.coordinator = False
        # What `tiekit.dcp.replay` needs to write the next save of the same image without DCP's
        # planning: when this rank's file was the image whole followed by tensor items only, its
        # name, the image's write results and those items; and the global metadata DCP planned.
        self.image_file: tuple[str, list[WriteResult], list[Any]] | None = None
        self.planned_metadata: Metadata | None = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.coordinator = is_coordinator
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: Any) -> Any:
        if self._ready is not None:
            self._ready()
        return super().prepare_local_plan(plan)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # A copy: DCP's finish sets the storage data, version and storage meta of what it is given.
        self.planned_metadata = dataclasses.replace(metadata)
        super().finish(metadata, results)

    def write_image_file(self, image: ShardImage, name: str, extras: Sequence[tuple[Any, torch.Tensor]]) -> list[Any]:
        """This rank's shard file ``name``, synced: ``image`` whole, then the record of each of
        ``extras`` (a write item and its host tensor), as `write_data` writes a plan of the image's
        records and those items (`tiekit.dcp.replay`), after ``ready`` and before ``confirm`` as
        there. The extras' write results."""
        if self._ready is not None:
            self._ready()
        self.fs.mkdir(self.path)
        results = []
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            try:
                _write_image(stream, image, self._lent)
            finally:
                if self._lent is not None:
                    self._lent.close()
            for item, value in extras:
                offset = stream.tell()
                write_record(stream, _host_tensor(value))
                results.append(_stored(item, name, offset, stream.tell() - offset))
            if self.sync_files:
                os.fsync(stream.fileno())
        if self._confirm is not None:
            self._confirm()
        return results

    def write_data(self, plan: Any, planner: Any) -> Future[list[WriteResult]]:
        """DCP's one shard file of this rank, with the records DCP's own single-thread loop writes
        (each from its layout's template), then an ``fsync``: the image's records first, written
        from where they are, when every one of them is planned here; then the byte items and
        the other tensors, in DCP's order. DCP's loop where this writer was set up otherwise."""
        if not (
            self.single_file_per_rank
            and self.thread_count == 1
            and getattr(self, "serialization_format", SerializationFormat.TORCH_SAVE) == SerializationFormat.TORCH_SAVE
            and not getattr(getattr(self, "transforms", None), "extensions", ())
        ):
            if self._lent is not None:  # DCP's loop would write the tensors training changes meanwhile
                raise CheckpointError(f"{self.path}: a lent image is written by DurableWriter's own loop only")
            theirs = super().write_data(plan, planner)
            if self._confirm is not None:
                self._confirm()
            return theirs
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results = []

        def written(item: Any, offset: int, length: int) -> None:
            results.append(_stored(item, name, offset, length))

        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            byte_items = [item for item in plan.items if item.type == WriteItemType.BYTE_IO]
            tensor_items = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
            slots: list[Slot | None] = [None] * len(tensor_items)
            values: list[torch.Tensor | None] = [None] * len(tensor_items)
            image, lent = self._image, self._lent
            if image is not None:
                resolved = [_host_tensor(planner.resolve_data(item)) for item in tensor_items]
                values, slots = list(resolved), image.placement(resolved)
                if image.covers(slots):
                    _write_image(stream, image, lent)
                    for item, slot in zip(tensor_items, slots, strict=True):
                        if slot is not None:
                            written(item, slot.start, slot.end - slot.start)
                    kept = [i for i, slot in enumerate(slots) if slot is None]
                    tensor_items, values = [tensor_items[i] for i in kept], [values[i] for i in kept]
                    slots = [None] * len(kept)
                    if not byte_items:
                        self.image_file = (name, list(results), list(tensor_items))
            # What the image does not hold, and the image's records where it is not written whole:
            # each from the image's memory (the lent memory, until the write is over).
            records = None
            if any(slots):
                assert image is not None
                records = image.records() if lent is None else lent.chunk(0, image.size)
            try:
                for item in byte_items:
                    offset = stream.tell()
                    stream.write(planner.resolve_data(item).getbuffer())
                    written(item, offset, stream.tell() - offset)
                for item, slot, value in zip(tensor_items, slots, values, strict=True):
                    offset = stream.tell()
                    if slot is not None and records is not None:
                        stream.write(records[slot.start : slot.end])
                    else:
                        write_record(stream, _host_tensor(planner.resolve_data(item)) if value is None else value)
                    written(item, offset, stream.tell() - offset)
            finally:
                if lent is not None:
                    lent.close()  # the image is written (or failed): taking it back copies nothing
            if self.sync_files:
                os.fsync(stream.fileno())
        if self._confirm is not None:
            self._confirm()
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


def _write_image(stream: Any, image: ShardImage, lent: LentMemory | None) -> None:
    """The image's records as the stream's first bytes: from where they are (`DirectFile`), else
    through the stream, chunk by chunk from the lent memory."""
    records = image.records()
    if isinstance(stream, DirectFile):
        stream.write_from(records, lent)
    elif lent is None:
        stream.write(records)
    else:
        lent.write_to(lambda piece, _: stream.write(piece), 0, image.size)


def _stored(item: Any, name: str, offset: int, length: int) -> WriteResult:
    """DCP's write result for ``item``, stored at ``offset`` in the file ``name``."""
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))


def _host_tensor(data: torch.Tensor) -> torch.Tensor:
    """The tensor DCP's loop writes for ``data``: on the host, owning exactly its storage."""
    tensor = data.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()  # a view: torch.save would write its whole storage
    return tensor
