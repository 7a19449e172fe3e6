"""What `convert` reads: a `save_sharded` folder, a plain DCP folder (``dcp.save`` output) or a
safetensors file, index or folder, each opened as one `ConvertSource` (its tensors' specs, its
plan, a reader of tensors by key, and what it holds beside the model that convert leaves out).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tiekit.checkpoint.layout import INDEX_SUFFIX, WEIGHTS_NAME
from tiekit.checkpoint.reads import read_tensors
from tiekit.checkpoint.source import open_source, training_record
from tiekit.dcp.chunks import read_rows, row_chunks
from tiekit.dcp.layout import (
    file_ends,
    is_plain_dcp_folder,
    is_sharded_checkpoint,
    lost_its_marker,
    read_marker,
    refuse_save_folder,
)
from tiekit.dcp.metadata_pickle import metadata_reader
from tiekit.dcp.records import dcp_metadata, save_metadata
from tiekit.dcp.state import running_dcp
from tiekit.dcp.stream import Spec, Value
from tiekit.errors import CheckpointError
from tiekit.plan import TiePlan

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


class ConvertSource:
    """A source: its tensors' specs, its plan, reading tensors by key, and what it holds beside
    the model's tensors (`ConvertResult.left_out`)."""

    def __init__(
        self,
        where: str,
        specs: list[Spec],
        plan: TiePlan | None,
        read: Callable[[list[str]], dict],
        left_out: tuple[str, ...] = (),
    ):
        self.where = where
        self.specs = specs
        self.plan = plan
        self._read = read
        self.left_out = left_out

    def read(self, keys: list[str]) -> dict:
        """The tensors of ``keys``. An `OSError` that names no file (an I/O error reading a mapped
        or open file) is raised naming the source, so that the error says what could not be read."""
        try:
            return self._read(keys)
        except OSError as exc:
            if exc.filename is not None:
                raise
            raise OSError(exc.errno, exc.strerror or str(exc), self.where) from exc


#: How `ConvertResult.left_out` begins for a plain DCP folder's entries that are not tensors.
NON_TENSOR_ENTRIES = "non-tensor entries"


def open_convert_source(path: Path) -> ConvertSource:
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    refuse_save_folder(path)  # a plain DCP folder to DCP, but read through its checkpoint's marker only
    if is_sharded_checkpoint(path) or lost_its_marker(path):
        marker = read_marker(path)  # without a marker: "no tiekit-dcp.json", as load_sharded says
        metadata = save_metadata(marker)
        stored = metadata.state_dict_metadata
        specs = [(k, marker.tensors[k][0], stored[k].properties.dtype) for k in marker.model_keys()]
        return ConvertSource(marker.where, specs, marker.plan, dcp_read(marker.folder), _training_state(marker.record))
    if is_plain_dcp_folder(path):  # a plain DCP folder: its metadata read as `dcp_metadata` reads it
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = plain_dcp_metadata(path)
        specs = [
            (k, tuple(v.size), v.properties.dtype)
            for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        ]
        others = [k for k, v in metadata.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata)]
        left_out: tuple[str, ...] = (f"{NON_TENSOR_ENTRIES} {', '.join(map(repr, others))}",) if others else ()
        return ConvertSource(os.fspath(path), specs, None, dcp_read(path), left_out)
    opened = open_source(path, (WEIGHTS_NAME, WEIGHTS_NAME + INDEX_SUFFIX))
    specs = [(k, e.shape, e.dtype) for k, (_, e) in opened.entries.items()]

    def read(keys: list[str]) -> dict[str, torch.Tensor]:
        return read_tensors({k: opened.entries[k] for k in keys}, opened.files)

    try:
        left_out = _training_state(training_record(opened))
    except CheckpointError:  # the model's tensors still convert, as load_model still reads them
        left_out = ("a training record it cannot read",)
    return ConvertSource(opened.where, specs, opened.plan, read, left_out)


def plain_dcp_metadata(folder: Path) -> Metadata:
    """DCP's metadata of a plain folder (``dcp.save``, no tiekit marker); `CheckpointError`
    naming the file when it cannot be read or names a global DCP's records do not (`dcp_metadata`). Local."""
    metadata = dcp_metadata(folder)
    _check_plain_files(folder, metadata)
    return metadata


def _check_plain_files(folder: Path, metadata: Metadata) -> None:
    """Every chunk DCP's ``metadata`` lists lies inside an existing file of ``folder``: else a
    `CheckpointError` naming the file and a key it holds. A plain folder has no marker recording
    its files' sizes (`load_sharded` checks a `save_sharded` folder against its marker), so the
    chunks' ends are the sizes to check: one stat per file, no data read. Without it a truncated
    or missing shard file was inspected as whole and failed only once its bytes were read, as
    torch's error or, for convert, as an error naming the destination."""
    for name, chunks in sorted(file_ends(metadata).items()):
        file = folder / name
        key, end = max(chunks, key=lambda chunk: chunk[1])
        keys = sorted({k for k, _ in chunks})
        held = f"holding {', '.join(map(repr, keys[:4]))}{' and more' if len(keys) > 4 else ''}"
        try:
            info = file.stat()
        except OSError as exc:
            state = "missing" if isinstance(exc, FileNotFoundError) else f"unreadable ({exc.strerror or exc})"
            raise CheckpointError(f"{file}: {state} shard file of the DCP checkpoint {folder} ({held})") from exc
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{file}: not a file, but DCP's metadata stores {held} in it")
        if info.st_size < end:
            raise CheckpointError(
                f"{file}: {info.st_size} bytes, but DCP's metadata has key {key!r} reach byte {end} "
                f"(truncated or replaced; {held})"
            )


def _training_state(record: Any) -> tuple[str, ...]:
    """What a training checkpoint's record (a `save_sharded` marker's, a `save_checkpoint`
    file's) holds beside the model: convert leaves it out."""
    held = {"optimizer": "optimizer state", "extra": "extra", "step": "step"}
    return tuple(said for key, said in held.items() if record.get(key) is not None)


def dcp_read(folder: Path) -> Callable[[list[str]], dict]:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load

    metadata = dcp_metadata(folder)
    rows = row_chunks(metadata)

    def read(keys: list[str]) -> dict[str, Value]:
        specs = {}
        for k in keys:
            info = metadata.state_dict_metadata[k]
            assert isinstance(info, TensorStorageMetadata)
            specs[k] = (tuple(info.size), info.properties.dtype)
        direct = read_rows(folder, {k: rows[k] for k in keys if k in rows}, {k: specs[k][1] for k in keys})
        got: dict[str, Value] = {k: v[0] if len(v) == 1 else v for k, v in direct.items()}
        out = {k: torch.empty(specs[k][0], dtype=specs[k][1]) for k in keys if k not in got}
        if out:
            # The keys are flat, so DCP's flattening (whose helpers leave reference cycles
            # holding the tensors) is off; the planner's own dicts are emptied after the read.
            # Then only `out` holds the tensors, each freed once written, with no gc.collect()
            # (a full pass took 0.3 s per batch in a process holding GPT-2 small and transformers).
            planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
            with running_dcp(folder, reading=True):
                load(dict(out), storage_reader=metadata_reader(folder), planner=planner, no_dist=True)
            planner.state_dict.clear()
            planner.original_state_dict.clear()
        got.update(out)
        return {k: got.pop(k) for k in keys}

    return read
