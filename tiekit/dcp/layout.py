"""Names on disk of a sharded checkpoint folder, its commit marker, and opening one without trust.

A folder holds ``tiekit-dcp.json`` (the marker) and one ``save-<id>/`` folder of DCP files per
committed save (older ones are removed after the next commit). The marker is the only thing a
load believes: it names the save folder, the size of every file in it and the SHA-256 of DCP's
``.metadata`` (a pickle), which is checked before it is unpickled (`tiekit.dcp.metadata_pickle`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG
from typing import Any, TypeVar

from tiekit.checkpoint.files import _commit_file, _fsync, remove_dead_work_folders
from tiekit.checkpoint.layout import PathLike
from tiekit.checkpoint.reads import ReplacedWhileReading, reading_again
from tiekit.errors import CheckpointError, TieError
from tiekit.plan import TiePlan

MARKER_NAME = "tiekit-dcp.json"
FORMAT = "tiekit-dcp"
FORMAT_VERSION = 1
SAVE_PREFIX = "save-"
DCP_METADATA = ".metadata"
#: The folder name of a save: `new_save_id` makes the ids. Only folders named so are ever removed
#: from a checkpoint folder, which may hold the user's own ``save-best/`` and such.
SAVE_FOLDER_PATTERN = re.compile(rf"{re.escape(SAVE_PREFIX)}[0-9a-f]{{16}}")

T = TypeVar("T")


def new_save_id() -> str:
    """A new save's id (16 hex digits): its folder is ``save-<id>``, a `SAVE_FOLDER_PATTERN` name."""
    return uuid.uuid4().hex[:16]


def is_save_folder(entry: Path) -> bool:
    """True when ``entry`` is a folder (not a link to one) named as tiekit names a save's folder."""
    return SAVE_FOLDER_PATTERN.fullmatch(entry.name) is not None and entry.is_dir() and not entry.is_symlink()


def holds_file(folder: Path, name: str) -> bool:
    """True when ``folder`` holds a file ``name``; False when the file or the folder is not there.
    `CheckpointError` ``<folder>: cannot read: Permission denied`` when the file system will not
    say (a folder without search permission), where ``Path.is_file`` raised the raw `OSError`."""
    try:
        return S_ISREG(os.stat(folder / name).st_mode)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EBADF):  # as Path.is_file
            return False
        raise CheckpointError(f"{folder}: cannot read: {exc.strerror or exc}") from exc


def is_sharded_checkpoint(path: PathLike) -> bool:
    """True when ``path`` is a folder holding a sharded checkpoint's marker (local, reads nothing
    else; `CheckpointError` when the folder cannot be read)."""
    return holds_file(Path(path), MARKER_NAME)


def is_plain_dcp_folder(path: PathLike) -> bool:
    """True when ``path`` is a folder DCP saved without tiekit (its ``.metadata``, no marker).
    Local, reads nothing; `CheckpointError` when the folder cannot be read."""
    return not is_sharded_checkpoint(path) and holds_file(Path(path), DCP_METADATA)


def refuse_save_folder(path: PathLike) -> None:
    """`CheckpointError` when ``path`` is a save folder inside a sharded checkpoint (a ``save-``
    folder beside the marker): a plain DCP folder to DCP's reader, but of the de-duplicated state
    with tiekit's keys (the optimizer's too), which only the checkpoint's marker describes. Every
    reader (`load_sharded`, `convert`, `tiekit inspect` and `verify`) refuses it alike. Local."""
    for root in (Path(os.path.abspath(path)), Path(os.path.realpath(path))):  # ".", and a link to it
        if root.name.startswith(SAVE_PREFIX) and root.is_dir() and holds_file(root.parent, MARKER_NAME):
            parent = Path(path).parent if Path(path).name == root.name else root.parent
            raise CheckpointError(f"{path}: a save folder inside a checkpoint; load its parent {parent}")


def lost_its_marker(path: PathLike) -> bool:
    """True when ``path`` is a folder holding the save folders of a `save_sharded` checkpoint but
    no marker, and nothing else a loader reads (no safetensors file or index, no DCP metadata): a
    sharded checkpoint whose marker is missing (deleted, or a save killed before its first commit),
    which `read_marker` names as such. Local, reads no file."""
    root = Path(path)
    if not root.is_dir() or is_sharded_checkpoint(root) or is_plain_dcp_folder(root):
        return False
    try:
        entries = list(root.iterdir())
    except OSError as exc:
        raise CheckpointError(f"{root}: cannot read: {exc.strerror or exc}") from exc
    if any(entry.name.endswith((".safetensors", ".safetensors.index.json")) for entry in entries):
        return False
    return any(is_save_folder(entry) for entry in entries)


def committed_save_id(path: PathLike) -> str | None:
    """The save id the marker of ``path`` names now, or None when there is no readable marker
    (local; reads the marker only, validates nothing)."""
    try:
        raw = json.loads((Path(path) / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    save_id = raw.get("save_id") if isinstance(raw, dict) else None
    return save_id if isinstance(save_id, str) else None


def reading_committed(root: Path, read: Callable[[], T]) -> T:
    """Local: ``read()``, something reading the checkpoint folder ``root``, started again while it
    fails because another process committed a new save under it (removing the files it read), at
    most ``READ_ATTEMPTS`` attempts (`tiekit.checkpoint.reads.reading_again`)."""

    def attempt() -> T:
        opened = committed_save_id(root)
        try:
            return read()
        except CheckpointError as exc:
            now = committed_save_id(root)
            if opened is not None and now is not None and now != opened:
                raise ReplacedWhileReading(
                    f"{root}: save {opened} replaced by save {now} while it was read: {exc}"
                ) from exc
            raise

    return reading_again(attempt)


@dataclass(frozen=True)
class Marker:
    """A validated ``tiekit-dcp.json``: the committed save and what the loader must find there."""

    where: str  # the marker file, for messages
    folder: Path  # the save folder of DCP files
    save_id: str
    plan: TiePlan | None  # None: no ties recorded (converted from a file that records none)
    tensors: Mapping[str, tuple[tuple[int, ...], str]]  # key -> (global shape, dtype name)
    files: Mapping[str, int]  # file name in the save folder -> size in bytes
    metadata_sha256: str
    record: Mapping[str, Any]  # optimizer record, extra, world size...

    def model_keys(self) -> list[str]:
        return [k for k in self.tensors if not k.startswith(("optimizer/", "extra/"))]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_marker(root: Path, folder: Path, save_id: str, plan: TiePlan | None, record: Mapping[str, Any]) -> None:
    """The commit: describe the finished save folder and publish the marker atomically (fsynced).

    Until ``os.replace`` puts it in place, the previous marker (and its save folder) is the
    checkpoint; afterwards, the new one. Local: the coordinating rank calls it.
    """
    files = {}
    for entry in sorted(folder.iterdir()):
        if entry.is_file():
            files[entry.name] = entry.stat().st_size
    if DCP_METADATA not in files:
        raise CheckpointError(f"{folder}: DCP wrote no {DCP_METADATA} file; the save did not finish")
    from tiekit.dcp.metadata_pickle import read_dcp_metadata

    metadata = read_dcp_metadata(folder / DCP_METADATA)  # as every read of tiekit: see its module
    absent = _not_here(files, file_ends(metadata))
    if absent:
        # This rank (rank 0, the committing one) wrote its own files into this folder and saw them
        # written: gone now, something removed them, whatever the other ranks see.
        removed = any(writer == 0 for writer, _ in absent)
        why = (
            "files this rank wrote are gone, so something removed them while the save was under way (another "
            "process deleting in this folder?)"
            if removed
            else "every rank must save into one folder all of them see (on several hosts: a shared filesystem)"
        )
        raise CheckpointError(
            f"{folder}: the ranks' shard files are not all here: {'; '.join(said for _, said in absent)}; {why}. "
            "Nothing was committed: the previous checkpoint stays the one loaded."
        )
    unwritten = _not_stored(metadata, record.get("tensors", {}))
    if unwritten:
        raise CheckpointError(
            f"{folder}: DCP's metadata does not cover {'; '.join(unwritten)}: a planner wrote none or only part "
            "of it. Nothing was committed: the previous checkpoint stays the one loaded."
        )
    _fsync(folder)
    body = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "save_id": save_id,
        "folder": folder.name,
        "files": files,
        "metadata_sha256": file_sha256(folder / DCP_METADATA),
        "plan": None if plan is None else plan.to_dict(),
        **record,
    }
    text = json.dumps(body, separators=(",", ":"))
    _commit_file(root / MARKER_NAME, lambda p: p.write_text(text, encoding="utf-8"), durable=True)


def file_ends(metadata: Any) -> dict[str, list[tuple[str, int]]]:
    """``{file name: [(key, end offset)]}``: where DCP's ``metadata`` says each chunk of each key is."""
    ends: dict[str, list[tuple[str, int]]] = {}
    for index, where in (metadata.storage_data or {}).items():
        ends.setdefault(where.relative_path, []).append((index.fqn, where.offset + where.length))
    return ends


def _not_here(files: Mapping[str, int], ends: Mapping[str, list[tuple[str, int]]]) -> list[tuple[int | None, str]]:
    """The files DCP's metadata names that the folder lacks (or holds short): each one's writing
    rank (None: a name not DCP's ``__<rank>_<n>.distcp``) and its description, with its keys."""
    found: list[tuple[int | None, str]] = []
    for name, chunks in sorted(ends.items()):
        size = files.get(name)
        if size is not None and size >= max(end for _, end in chunks):
            continue
        writer = re.match(r"__(\d+)_", name)  # FileSystemWriter's __<rank>_<n>.distcp
        rank = int(writer.group(1)) if writer else None
        by = f"written by rank {rank}, " if rank is not None else ""
        keys = sorted({key for key, _ in chunks})
        state = "missing" if size is None else f"{size} bytes, short"
        held = f"{', '.join(repr(k) for k in keys[:4])}{' ...' if len(keys) > 4 else ''}"
        found.append((rank, f"{name} ({state}; {by}holding {held})"))
    return found


def _not_stored(metadata: Any, tensors: Mapping[str, Any]) -> list[str]:
    """The tensors of the save's key table (``{key: [shape, dtype]}``) whose chunks in DCP's
    ``metadata`` do not add up to their size, each described. A planner may leave one out without
    an error (torch_xla 2.9's ``SPMDSavePlanner`` wrote nothing for a tensor sharded over one axis of
    a 2-D mesh and replicated over the other), so a commit checks before it publishes."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = metadata.state_dict_metadata
    out = []
    for key, (shape, _) in tensors.items():
        info = stored.get(key)
        if not isinstance(info, TensorStorageMetadata):
            out.append(f"{key!r} (not stored)")
            continue
        covered = sum(math.prod(chunk.sizes) for chunk in info.chunks)
        if covered < math.prod(shape):
            out.append(f"{key!r} ({covered} of its {math.prod(shape)} elements)")
    return out[:5] + ([f"and {len(out) - 5} more"] if len(out) > 5 else [])


def remove_stale(root: Path, keep: str | None) -> None:
    """Remove save folders other than ``keep`` (older saves, killed saves) and the marker's work
    folders that killed commits left. Local, best effort.

    Only folders named ``save-<16 hex digits>`` (`SAVE_FOLDER_PATTERN`, the names tiekit gives
    its saves): the folder may hold anything else of the user's, ``save-best/`` included."""
    for entry in root.iterdir():
        if entry.name != keep and is_save_folder(entry):
            shutil.rmtree(entry, ignore_errors=True)
    remove_dead_work_folders(root)
    with contextlib.suppress(OSError):
        _fsync(root)


def read_marker(path: PathLike) -> Marker:
    """Open and validate the marker of the checkpoint folder ``path`` and the files it names:
    DCP's ``.metadata`` the one written by this save (the data files are checked against it by
    `check_files`). `CheckpointError` naming the file (and key) otherwise. Reads no tensor."""
    root = Path(path)
    marker_path = root / MARKER_NAME
    where = os.fspath(marker_path)
    if not holds_file(root, MARKER_NAME):
        refuse_save_folder(root)
        found = "no such folder" if not root.exists() else f"no {MARKER_NAME} (not a committed sharded checkpoint)"
        if is_plain_dcp_folder(root):
            from tiekit.checkpoint.source import PLAIN_DCP_HINT

            found += f"; {PLAIN_DCP_HINT}"
        raise CheckpointError(f"{root}: {found}")
    try:
        raw = json.loads(marker_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{where}: unreadable marker: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a tiekit sharded checkpoint marker (format {FORMAT!r} expected)")
    version = raw.get("version")
    if "version" not in raw:
        raise CheckpointError(f"{where}: damaged marker: key 'version' is missing")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        # Not a version any tiekit wrote: upgrading would not help (it said "newer", for a missing key too).
        raise CheckpointError(f"{where}: damaged marker: key 'version' is {version!r}, not a format version")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{where}: format version {version!r} is newer than this tiekit reads; upgrade tiekit")
    try:
        folder_name = _text(raw, "folder", where)
        if not folder_name.startswith(SAVE_PREFIX) or "/" in folder_name or "\\" in folder_name:
            raise CheckpointError(f"{where}: key 'folder' is {folder_name!r}, not a save folder of this checkpoint")
        files = raw["files"]
        tensors = raw["tensors"]
        if not isinstance(files, dict) or not all(isinstance(v, int) for v in files.values()):
            raise CheckpointError(f"{where}: key 'files' is not an object of file sizes")
        if not isinstance(tensors, dict):
            raise CheckpointError(f"{where}: key 'tensors' is not an object")
        table = {str(k): (tuple(int(d) for d in v[0]), str(v[1])) for k, v in tensors.items()}
        plan = None if raw["plan"] is None else TiePlan.from_dict(raw["plan"])
    except TieError as exc:
        raise CheckpointError(f"{where}: key 'plan': {exc}") from exc
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CheckpointError(f"{where}: malformed marker ({type(exc).__name__}: {exc})") from exc
    folder = root / folder_name
    if not folder.is_dir():
        raise CheckpointError(f"{where}: the save folder {folder} it names is missing")
    if any("/" in name or "\\" in name or name in ("", ".", "..") for name in files):
        raise CheckpointError(f"{where}: key 'files' names a file outside the save folder")
    metadata = folder / DCP_METADATA
    if DCP_METADATA not in files or not holds_file(folder, DCP_METADATA):
        raise CheckpointError(f"{metadata}: missing (the DCP metadata of save {raw.get('save_id')!r})")
    if _readable_sha256(metadata, raw.get("save_id")) != raw.get("metadata_sha256"):
        raise CheckpointError(
            f"{metadata}: not the DCP metadata of save {raw.get('save_id')!r}: its SHA-256 differs from key "
            f"'metadata_sha256' of {where} (from another save or model, or modified); refused before reading it"
        )
    digest = str(raw["metadata_sha256"])
    record = {k: v for k, v in raw.items() if k not in ("files", "tensors", "plan")}
    return Marker(where, folder, str(raw.get("save_id")), plan, table, files, digest, record)


def _readable_sha256(metadata: Path, save_id: object) -> str:
    """`file_sha256` of the DCP metadata file of save ``save_id``: `CheckpointError` naming it when
    it cannot be read (removed by a newer save since it was found: `reading_committed` then reads
    the new save)."""
    try:
        return file_sha256(metadata)
    except OSError as exc:
        raise CheckpointError(
            f"{metadata}: cannot be read (the DCP metadata of save {save_id!r}): {exc.strerror or exc}"
        ) from exc


def _text(raw: Mapping[str, Any], key: str, where: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str):
        raise CheckpointError(f"{where}: key {key!r} is {value!r}, not a string")
    return value


def check_files(marker: Marker, chunks: Mapping[str, list[tuple[str, int]]]) -> None:
    """Every data file of the save present with the size the save wrote, and every chunk inside
    it; ``chunks``: file name -> [(key, end offset)] from DCP's metadata. `CheckpointError` naming
    the file and the keys it holds otherwise."""
    for name, size in marker.files.items():
        file = marker.folder / name
        held = sorted({key for key, _ in chunks.get(name, [])})
        keys = f" (holding {', '.join(repr(k) for k in held[:6])}{' and more' if len(held) > 6 else ''})"
        try:
            stat = file.stat()  # one call: a file removed between two checks is still named as missing
        except OSError:  # as is_file() took it
            stat = None
        if stat is None or not S_ISREG(stat.st_mode):
            raise CheckpointError(f"{file}: missing shard file of save {marker.save_id!r}{keys if held else ''}")
        actual = stat.st_size
        if actual != size:
            raise CheckpointError(
                f"{file}: {actual} bytes, but save {marker.save_id!r} wrote {size} (truncated or replaced)"
                f"{keys if held else ''}"
            )
    for name, ends in chunks.items():
        if name not in marker.files:
            raise CheckpointError(f"{marker.folder / name}: holds key {ends[0][0]!r} but is not a file of this save")
        for key, end in ends:
            if end > marker.files[name]:
                raise CheckpointError(
                    f"{marker.folder / name}: key {key!r} reaches byte {end}, the file has {marker.files[name]}"
                )
