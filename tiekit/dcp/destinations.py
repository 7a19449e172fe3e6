"""Where `tiekit.convert` may write: refusals, each a `CheckpointError` naming the path, made
before anything is read or created (a destination overlapping its source, a file where a folder
is needed, a folder holding a checkpoint, a file a safetensors destination would replace)."""

from __future__ import annotations

import os
from pathlib import Path

from tiekit.checkpoint.layout import INDEX_SUFFIX, WEIGHTS_NAME, index_of, shards_beside
from tiekit.dcp.layout import DCP_METADATA, MARKER_NAME, is_save_folder
from tiekit.errors import CheckpointError


def refuse_overlap(src: Path, dst: Path) -> None:
    """`CheckpointError` naming both when ``dst`` is ``src``, inside it or holds it: the writing
    (and a sharded folder's removal of its older saves) would change the source it reads."""
    source, target = src.resolve(), dst.resolve()
    if target == source:
        where = "is the source"
    elif source in target.parents:
        where = "is inside the source"
    elif target in source.parents:
        where = "contains the source"
    else:
        return
    raise CheckpointError(f"{dst}: the destination {where} {src}; convert into a new path outside it")


def refuse_for_sharded_folder(src: Path, dst: Path, max_shard_size: int | str | None) -> None:
    """A safetensors source converts to a sharded (DCP) folder only: `CheckpointError` for a
    ``.safetensors`` destination (it would be a folder so named) or a shard size (DCP's files are
    one per rank), saying how to reshard a safetensors checkpoint instead."""
    reshard = (
        f"to reshard it, load it (tiekit.load_model(model, {os.fspath(src)!r})) and save it with "
        "tiekit.save_model(model, path, max_shard_size=...)"
    )
    if dst.name.endswith((".safetensors", INDEX_SUFFIX)):
        raise CheckpointError(
            f"{dst}: {src} is a safetensors checkpoint, which converts to a sharded (DCP) folder, not to a "
            f"safetensors file; give a folder name, or {reshard}"
        )
    if max_shard_size is not None:
        raise CheckpointError(
            f"{dst}: max_shard_size (--max-shard-size) applies to a safetensors destination; {src} converts "
            f"to a sharded (DCP) folder, whose files DCP sizes itself (one per saving rank). Leave it out, or {reshard}"
        )


def refuse_unwritable(folder: Path, dst: Path) -> None:
    """`CheckpointError` naming ``dst`` when ``folder`` (where it is written) or the nearest of its
    parents that exists is a file, not a folder: checked before anything is created."""
    for path in (folder, *folder.parents):
        if path.is_dir():
            return
        if path.exists() or path.is_symlink():
            where = "is a file" if path == dst else f"lies in {path}, a file"
            raise CheckpointError(f"{dst}: cannot be written: it {where}, not a folder; give a new path")


#: The files that make a folder a checkpoint `tiekit.load_model` or `load_sharded` (or DCP) reads.
CHECKPOINT_FILES = (MARKER_NAME, DCP_METADATA, WEIGHTS_NAME, WEIGHTS_NAME + INDEX_SUFFIX)


def held_checkpoint_files(folder: Path) -> list[Path]:
    """The files of ``folder`` that a loader given the folder would consider a checkpoint, those
    of `CHECKPOINT_FILES` first, then any index, then any other ``*.safetensors`` that is not
    hidden (another name, a fit folder's ``step-*.safetensors``, shards). Local, reads no file."""
    if not folder.is_dir():
        return []
    names = sorted(entry.name for entry in folder.iterdir() if entry.is_file() or entry.is_symlink())
    visible = [name for name in names if not name.startswith(".") and name not in CHECKPOINT_FILES]
    indexes = [name for name in visible if name.endswith(".safetensors" + INDEX_SUFFIX)]
    singles = [name for name in visible if name.endswith(".safetensors")]
    return [folder / name for name in (*(n for n in CHECKPOINT_FILES if n in names), *indexes, *singles)]


def refuse_held_checkpoint(folder: Path) -> None:
    """`CheckpointError` naming the file when the destination folder holds a checkpoint (any file
    of `held_checkpoint_files`): a second one beside it would leave the folder two checkpoints,
    read by different loaders, or change which one the folder loads as.

    A save folder without a marker (``save-<16 hex digits>``: a `save_sharded` under way in
    another process, or a checkpoint whose marker is gone) is refused too: a sharded destination's
    commit would make it a stale save of the new checkpoint, which the next save removes, and
    the other process's commit would replace the converted checkpoint."""
    held = held_checkpoint_files(folder)
    if held:
        raise CheckpointError(
            f"{held[0]}: exists; convert writes a new checkpoint and {folder} holds one already "
            "(remove it first, or convert into a new folder)"
        )
    saves = sorted(entry.name for entry in folder.iterdir() if is_save_folder(entry)) if folder.is_dir() else []
    if saves:
        more = f" (and {len(saves) - 1} more)" if len(saves) > 1 else ""
        raise CheckpointError(
            f"{folder / saves[0]}: exists{more}, the save folder of a sharded checkpoint with no marker (a "
            f"save_sharded under way, or a checkpoint whose {MARKER_NAME} is gone); convert writes a new "
            f"checkpoint and {folder} holds that one's files (remove them first, or convert into a new folder)"
        )


def refuse_existing_files(file: Path, *, sharded: bool) -> None:
    """`CheckpointError` naming the first file the safetensors destination ``file`` would replace:
    itself, its index and, ``sharded``, any file named as one of its shards (of any count: their
    number is known only once written, and shards of another count beside the new index would
    leave the folder two checkpoints' files). Checked before any tensor is read.

    Unlike `tiekit.save_model`, which replaces the save it made before at that name (its index
    and the shards it lists), convert writes a new checkpoint and replaces no file: shards
    without their index (a user's, or those of a save or convert killed before its index) are
    not known to be a previous save of this destination, so they are named, not guessed at."""
    existing = [p for p in (file, index_of(file)) if p.exists() or p.is_symlink()]
    if existing:
        raise CheckpointError(f"{existing[0]}: exists; convert writes a new checkpoint (remove it first)")
    shards = shards_beside(file) if sharded else []
    if shards:
        more = f" (and {len(shards) - 1} more)" if len(shards) > 1 else ""
        raise CheckpointError(
            f"{shards[0]}: exists{more}, named as a shard of {file.name}; convert writes a new checkpoint "
            "and replaces no file (remove them first, or convert to another name)"
        )
