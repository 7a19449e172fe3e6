"""Reading DCP's ``.metadata`` without running what its pickle names.

DCP's metadata is a pickle, and torch's ``FileSystemReader.read_metadata`` unpickles it with
``pickle.load``: a crafted ``.metadata`` runs any code it names the moment it is read (``tiekit
inspect`` of a downloaded folder, say). The SHA-256 a `save_sharded` marker records does not help:
the marker lies in the same folder, so whoever wrote the one wrote the other.

`read_dcp_metadata` unpickles with `ALLOWED_GLOBALS` only: the globals real metadata holds, read
off the ``.metadata`` of every kind of folder torch 2.9.1 and 2.14.1 write (`save_sharded` saves of
a plain model, of FSDP2 on 2 ranks and of XLA SPMD, blocking and in the background, and replayed;
`tiekit.convert`'s; ``dcp.save`` of tensors, DTensors, an optimizer's state and values that are
not tensors: ints, strings, bytes, lists, dicts, None). `metadata_reader` is torch's reader reading
it so, for the DCP loads tiekit runs. torch's own safe loader does not fit: ``torch.load`` reads
``torch.save``'s formats only, and its weights-only unpickler (``torch._weights_only_unpickler``,
private) refuses protocol 4's FRAME opcode, which every DCP metadata begins with (2.9 and 2.14).
"""

from __future__ import annotations

import functools
import io
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tiekit.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

_RECORDS = "torch.distributed.checkpoint.metadata"

#: The globals a DCP metadata names, (module, name), besides torch's dtypes (``torch.float32``:
#: `_allowed` adds every dtype this torch has). Found by listing what ``find_class`` is asked for
#: while unpickling real metadata of torch 2.9.1 and 2.14.1 (the same set in both).
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_RECORDS, "Metadata"),
        (_RECORDS, "MetadataIndex"),
        (_RECORDS, "StorageMeta"),
        (_RECORDS, "TensorStorageMetadata"),
        (_RECORDS, "TensorProperties"),
        (_RECORDS, "ChunkStorageMetadata"),
        (_RECORDS, "BytesStorageMetadata"),
        (_RECORDS, "_MEM_FORMAT_ENCODING"),  # TensorProperties' memory format, an Enum
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # where each chunk is
        ("torch.serialization", "_get_layout"),  # TensorProperties' layout, by its name
        ("torch", "Size"),
        # StorageMeta.checkpoint_id, when the folder was given as a Path: PosixPath is what the
        # saves above hold; a save made on Windows holds WindowsPath, which is inert too (it
        # refuses to be made on POSIX, which reads as unreadable metadata).
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
    }
)


@functools.cache
def _allowed() -> dict[tuple[str, str], Any]:
    """`ALLOWED_GLOBALS` and this torch's dtypes, each with the object it names."""
    import importlib

    allowed = {("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
    for module, name in ALLOWED_GLOBALS:
        allowed[(module, name)] = getattr(importlib.import_module(module), name)
    return allowed


class _Refused(pickle.UnpicklingError):
    """The pickle names a global outside `ALLOWED_GLOBALS`."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.module, self.name = module, name


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that finds only the allowed globals (Python's documented way to restrict one)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed().get((module, name))
        if found is not None:
            return found
        if module == "torch" and name.isidentifier() and not hasattr(torch, name):
            # A dtype of a newer torch (the caller says which torch wrote the save), not a refusal.
            raise pickle.UnpicklingError(f"Can't get attribute {name!r} on module 'torch'")
        raise _Refused(module, name)


def _mutable_allowed() -> list[Any]:
    """The allowed globals whose attributes a pickle can set, and the Enum members it can reach:
    pickle's BUILD sets attributes on whatever object it is given, a class too."""
    objects: list[Any] = []
    for value in _allowed().values():
        if hasattr(value, "__dict__"):
            objects.append(value)
        if isinstance(value, type) and hasattr(value, "__members__"):
            objects.extend(m for m in value.__members__.values() if hasattr(m, "__dict__"))
    return objects


def read_dcp_metadata(file: Path | str) -> Metadata:
    """DCP's metadata in ``file``, unpickled with `ALLOWED_GLOBALS` only. `CheckpointError` naming
    the file and the global when the pickle names anything else (or rewrites an allowed class, or
    is no `Metadata`); OSError and other unpickling errors as they come (the caller names them).
    Local."""
    from torch.distributed.checkpoint.metadata import Metadata

    with open(file, "rb") as stream:
        data = stream.read()
    # A pickle can set attributes of the classes it may name (BUILD on the class itself), which
    # would change them for the whole process: compare them after the read, and put them back.
    objects = _mutable_allowed()
    before = [dict(vars(o)) for o in objects]
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise CheckpointError(
            f"{file}: refuses to unpickle {exc.module}.{exc.name}: DCP metadata holds only "
            "torch.distributed.checkpoint's records (a file from someone you do not trust?)"
        ) from None
    finally:
        changed = [_restore(o, saved) for o, saved in zip(objects, before, strict=True)]
    rewritten = [said for said in changed if said]
    if rewritten:
        raise CheckpointError(
            f"{file}: refuses to unpickle it: it sets {', '.join(rewritten)} (DCP metadata never does; a file from "
            "someone you do not trust?)"
        )
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file}: holds a {type(metadata).__name__}, not DCP's Metadata")
    _refuse_files_outside(file, metadata)
    return metadata


def _refuse_files_outside(file: Path | str, metadata: Metadata) -> None:
    """`CheckpointError` when the metadata places a chunk in a file outside its folder: DCP joins
    each chunk's ``relative_path`` to the folder, so ``../../home/x/.ssh/id_rsa`` would be read as
    a tensor's bytes (and `convert` would copy them into its output). DCP's writers name files in
    the folder itself (``__0_0.distcp``)."""
    for index, where in (getattr(metadata, "storage_data", None) or {}).items():
        name = getattr(where, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            key = getattr(index, "fqn", index)
            raise CheckpointError(
                f"{file}: key {key!r} is stored in {name!r}, not a file of the checkpoint's folder (DCP's writers "
                "name only files in it; a file from someone you do not trust?)"
            )


def _restore(obj: Any, saved: dict[str, Any]) -> str:
    """Put ``obj``'s attributes back as ``saved``; the name of the first that differed, or ``""``."""
    now = vars(obj)
    changed = [k for k in set(now) | set(saved) if k not in saved or k not in now or now[k] is not saved[k]]
    for key in changed:
        if key in saved:
            setattr(obj, key, saved[key])
        else:
            delattr(obj, key)
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{name}.{sorted(changed)[0]}" if changed else ""


@functools.cache
def _reader_class() -> type:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class MetadataReader(FileSystemReader):  # type: ignore[misc]
        """torch's ``FileSystemReader``, its metadata read by `read_dcp_metadata`."""

        #: The refusal of the metadata, if any: DCP's load swallows the error of its first read
        #: (it tries rank-local metadata next) and fails with an empty AssertionError instead.
        refusal: CheckpointError | None = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            # As torch's own (2.9 and 2.14): rank-local metadata when a rank is given; a load id.
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            try:
                metadata = read_dcp_metadata(Path(self.path) / name)
            except CheckpointError as exc:
                self.refusal = self.refusal or exc
                raise
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
            return metadata

    return MetadataReader


def metadata_reader(folder: Path | str) -> Any:
    """torch's ``FileSystemReader`` of ``folder``, except that it reads the metadata with
    `read_dcp_metadata`: give it to DCP's ``load``, which reads the metadata again itself. Its
    ``refusal`` is the `CheckpointError` of a refused metadata (DCP's own error does not say it)."""
    return _reader_class()(folder)
