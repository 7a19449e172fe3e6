"""Atomic files: a save is written in a private work folder and renamed into place.

A crash at any point leaves the previous checkpoint loadable. Single files are fsynced (when
``durable``) and renamed over the target; sharded saves rename their shards first (keeping the
previous save's shards reachable through backup links) and commit with the index, written last.
Work folders of killed saves are removed by the next save into the same folder.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from tiekit.checkpoint.direct import write_safetensors
from tiekit.checkpoint.image import FileImage, LentMemory, write_image
from tiekit.checkpoint.layout import PLAN_KEY, SAVE_ID_KEY, index_of, nbytes, shard_name
from tiekit.errors import CheckpointError
from tiekit.header import read_json
from tiekit.plan import TiePlan

_TEMP_TAG = ".tiekit-tmp-"
_BACKUP_TAG = ".tiekit-prev-"
# Work folders are named after their writer's host and process id: a later save cleans up only
# what a dead process of its own host left (a shared folder's other hosts may be writing).
_TEMP_RE = re.compile(r"\..+" + re.escape(_TEMP_TAG) + r"(?:(?P<host>[A-Za-z0-9_.-]+)-)??(?P<pid>\d+)-[0-9a-f]+")


def _host() -> str:
    """This host's name, as it may stand in a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "localhost"


def write_single(
    target: Path,
    state: dict[str, torch.Tensor] | FileImage,
    header: dict[str, str],
    durable: bool,
    before_publish: Callable[[], None] | None = None,
    lent: LentMemory | None = None,
) -> None:
    """Write ``state`` (host tensors, or their `FileImage`) as the safetensors file ``target``,
    atomically; ``before_publish`` runs once the file is written (and synced) and before it
    replaces ``target``: its exception leaves the previous file in place. ``lent``: the image is
    training state, written as `tiekit.checkpoint.image.write_image` says. A symbolic link at
    ``target`` stays: the file it names is the one replaced, as ``open(target, "wb")`` would write."""
    target = _through_link(target)
    with _folder_for(target):
        _commit_file(target, lambda tmp: _save_tensors(state, tmp, header, durable, lent), durable, before_publish)
    # A sharded save that this file now replaces: drop it, or a loader might still pick it.
    index = index_of(target)
    if index.exists():
        _remove(target.parent, [index.name, *weight_map_files(index)])
    _remove(target.parent, _backups(target))


def write_sharded(
    target: Path, state: dict[str, torch.Tensor], header: dict[str, str], plan: TiePlan, limit: int, durable: bool
) -> None:
    with _folder_for(target):
        _write_sharded(target, state, header, plan, limit, durable)


def _write_sharded(
    target: Path, state: dict[str, torch.Tensor], header: dict[str, str], plan: TiePlan, limit: int, durable: bool
) -> None:
    folder = target.parent
    shards = _split(state, limit)
    files = [shard_name(target, i + 1, len(shards)) for i in range(len(shards))]
    index_path = index_of(target)
    old_files = weight_map_files(index_path) if index_path.exists() else []
    save_id = secrets.token_hex(8)
    shard_header = {k: v for k, v in header.items() if k != PLAN_KEY}
    shard_header[SAVE_ID_KEY] = save_id
    try:
        work = _work_folder(index_path)
    except OSError as exc:
        raise CheckpointError(f"{index_path}: cannot write: {exc.strerror or exc}") from exc
    try:
        for file, keys in zip(files, shards, strict=True):
            _save_tensors({k: state[k] for k in keys}, work / file, shard_header, durable)
            if durable:
                _fsync(work / file)
        backups = _protect_previous(index_path, old_files, set(files))
        for file in files:
            os.replace(work / file, folder / file)
        if durable:
            _fsync(folder)
        index = {
            "metadata": {
                **{k: v for k, v in header.items() if k != PLAN_KEY},
                "total_size": sum(nbytes(t) for t in state.values()),
                SAVE_ID_KEY: save_id,
                PLAN_KEY: plan.to_dict(),
            },
            "weight_map": {key: file for file, keys in zip(files, shards, strict=True) for key in keys},
        }
        text = json.dumps(index, indent=2)
        _commit_file(index_path, lambda tmp: tmp.write_text(text, encoding="utf-8"), durable)
    except OSError as exc:
        raise CheckpointError(f"{index_path}: cannot write the sharded checkpoint: {exc}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # Committed: the previous save's leftovers and a single file this save replaces go.
    _remove(folder, [f for f in [*old_files, *backups, *_backups(target), target.name] if f not in files])


def _split(state: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in state.items():
        if shards[-1] and size + nbytes(t) > limit:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes(t)
    return shards


def _protect_previous(index_path: Path, old_files: list[str], new_files: set[str]) -> list[str]:
    """Keep the previous sharded save loadable while its shard names are being overwritten.

    Shards about to be replaced get a hard link under a hidden name, and the previous index
    is rewritten to point at those links, so whatever instant a crash happens, one complete
    index names complete shards. Returns the backup names, removed once the new index is in.
    """
    colliding = [f for f in old_files if f in new_files]
    if not colliding:
        return []
    folder = index_path.parent
    token = secrets.token_hex(4)
    renamed = {f: f".{f}{_BACKUP_TAG}{token}" for f in colliding}
    for old, backup in renamed.items():
        try:
            os.link(folder / old, folder / backup)
        except OSError:  # a filesystem without hard links: copy
            with open(folder / old, "rb") as src, open(folder / backup, "wb") as dst:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
            _fsync(folder / backup)
    raw = read_json(index_path, "index")
    raw["weight_map"] = {k: renamed.get(v, v) for k, v in raw["weight_map"].items()}
    text = json.dumps(raw, indent=2)
    _commit_file(index_path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return list(renamed.values())


def _backups(target: Path) -> list[str]:
    """Backup links of shards of ``target`` left by a save killed after its index was committed."""
    stem = target.name.removesuffix(".safetensors")
    pattern = re.compile(re.escape(f".{stem}-") + r".+" + re.escape(_BACKUP_TAG) + r"[0-9a-f]+")
    return [p.name for p in target.parent.iterdir() if pattern.fullmatch(p.name)]


def weight_map_files(index_path: Path) -> list[str]:
    """Shard files an existing index names, when they are plain names inside its folder; none when
    it does not read as an index (which its own open then names). Local."""
    try:
        raw = read_json(index_path, "index")
    except CheckpointError:
        return []
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
        return []
    return sorted({f for f in weight_map.values() if isinstance(f, str) and f and "/" not in f and f != ".."})


def _through_link(target: Path) -> Path:
    """The file a symbolic link at ``target`` names (a save replaces that file, keeping the link)."""
    return Path(os.path.realpath(target)) if target.is_symlink() else target


@contextlib.contextmanager
def _folder_for(target: Path) -> Iterator[None]:
    """``target``'s folder, created where missing and cleaned of dead saves' work folders; the
    folders created here are removed again when the save fails (a failed call leaves nothing)."""
    with removed_on_failure(target.parent):
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"{target}: cannot create the folder: {exc.strerror or exc}") from exc
        remove_dead_work_folders(target.parent)
        yield


@contextlib.contextmanager
def removed_on_failure(folder: Path) -> Iterator[None]:
    """``folder`` and those of its parents that do not exist yet (the body creates them), removed
    again, when still empty, if the body raises: a failed save leaves nothing behind. Local."""
    made = list(itertools.takewhile(lambda p: not p.exists(), (folder, *folder.parents)))
    try:
        yield
    except BaseException:
        for path in made:  # deepest first; one another writer has filled stays
            with contextlib.suppress(OSError):
                path.rmdir()
        raise


def remove_dead_work_folders(folder: Path) -> None:
    """Remove the work folders (and files) in ``folder`` that killed saves of this host left: their
    process is gone. Those of live processes and of other hosts stay. Local, best effort."""
    for entry in folder.iterdir():
        match = _TEMP_RE.fullmatch(entry.name)
        ours = match is not None and match.group("host") in (None, _host())  # None: named before hosts were
        if match and ours and not _alive(int(match.group("pid"))):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink()


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def _work_folder(target: Path) -> Path:
    """A private folder next to ``target`` (same filesystem, so renames out of it are atomic).

    Writers put their own temporary files in it (safetensors does), and one ``rmtree`` removes
    whatever a crash left there.
    """
    work = target.with_name(f".{target.name}{_TEMP_TAG}{_host()}-{os.getpid()}-{secrets.token_hex(4)}")
    work.mkdir()
    return work


def _commit_file(
    target: Path,
    write: Callable[[Path], object],
    durable: bool = True,
    before_publish: Callable[[], None] | None = None,
) -> None:
    """Write in a work folder, fsync (if ``durable``), rename over ``target``, fsync the folder."""
    try:
        work = _work_folder(target)
    except OSError as exc:
        raise CheckpointError(f"{target}: cannot write: {exc.strerror or exc}") from exc
    try:
        tmp = work / target.name
        write(tmp)
        if durable:
            _fsync(tmp)
        if before_publish is not None:
            before_publish()
        os.replace(tmp, target)
        if durable:
            _fsync(target.parent)
    except OSError as exc:
        raise CheckpointError(f"{target}: cannot write: {exc.strerror or exc}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _save_tensors(
    state: dict[str, torch.Tensor] | FileImage,
    path: Path,
    header: dict[str, str],
    durable: bool,
    lent: LentMemory | None = None,
) -> None:
    # A durable save waits for the disk anyway: then past the page cache (tiekit.checkpoint.direct).
    if isinstance(state, FileImage):
        write_image(state, path, direct=durable, lent=lent)
    else:
        write_safetensors(state, path, header, direct=durable)
    # A checkpoint is an ordinary file, readable as the umask allows (as torch.save's; safetensors
    # makes its files private), so the other users of a shared folder can load it.
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """This process's umask, read without changing it where Linux tells (os.umask sets it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: Path) -> None:
    # A file's data (or a folder's entries) reach the disk before the rename that publishes it.
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if path.is_dir() else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError:
        if path.is_dir():
            return  # some platforms cannot open folders; the rename is still atomic there
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(folder: Path, names: Iterable[str]) -> None:
    removed = False
    for name in names:
        with contextlib.suppress(OSError):
            (folder / name).unlink()
            removed = True
    if removed:  # leftovers only: the new checkpoint is already published, durably or not
        with contextlib.suppress(OSError):
            _fsync(folder)
