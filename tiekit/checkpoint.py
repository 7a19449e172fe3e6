"""Tied checkpoints: safetensors files that keep ties, load into any state of a model, never lose data.

Format. A standard safetensors file: one tensor per tie group under its source name, every
other tensor under its own name, and in the header metadata ``{"format": "pt"}`` plus the
model's `TiePlan` as JSON under ``"tiekit.plan"``. Any safetensors reader opens it; tiekit
uses the plan to re-tie on load. Sharded saves follow the Hugging Face layout
(``model-00001-of-00003.safetensors`` + ``model.safetensors.index.json``), with the plan in
the index's metadata. Training checkpoints add the optimizer state (tensors under
``optimizer/...``, the rest as JSON under ``"tiekit.checkpoint"``): no pickle anywhere.

Loading validates everything first (headers, names, shapes, dtypes, the file's plan against
the model's declared ties), then commits: real tensors are overwritten in place, so parameter
identity and optimizers stay valid; meta tensors (and tensors on another device than the one
asked for) are replaced by one new tensor per unique weight, then re-tied.

Writing goes to a private work folder inside the target folder; the file is fsynced and
renamed over the target, so a crash at any point leaves the previous checkpoint loadable. For
sharded saves the index is the commit point and is written last. ``durable=False`` drops the
fsyncs: a killed process still leaves the previous checkpoint (the kernel keeps what was
written, renames stay ordered), a power loss may not.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, cast

import torch
from torch import nn

from tiekit import devices
from tiekit._header import DTYPE_CODES, FileIdentity, Header, TensorEntry, file_identity, read_header, read_json
from tiekit._slots import assign, resolve
from tiekit.analyze import dtype_name, find_ties
from tiekit.errors import CheckpointError, TieError
from tiekit.mixin import TPUMixin
from tiekit.plan import MemberKind, TieGroup, TieMember, TiePlan
from tiekit.retie import _group_changes, retie

PathLike = str | os.PathLike[str]
Device = torch.device | str | int | None

WEIGHTS_NAME = "model.safetensors"
CHECKPOINT_NAME = "checkpoint.safetensors"
INDEX_SUFFIX = ".index.json"
PLAN_KEY = "tiekit.plan"
SAVE_ID_KEY = "tiekit.save_id"
STATE_KEY = "tiekit.checkpoint"
STATE_VERSION = 1
# Tensors of a training checkpoint that are not model weights live under these prefixes.
SIDE_PREFIXES = ("optimizer/", "extra/")

_TEMP_TAG = ".tiekit-tmp-"
_BACKUP_TAG = ".tiekit-prev-"
_TEMP_RE = re.compile(r"\..+" + re.escape(_TEMP_TAG) + r"(\d+)-[0-9a-f]+")


# -- results ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadResult:
    """What `load_model` did.

    ``missing``: names of the model's state that the file did not provide (left unchanged).
    ``unexpected``: keys of the file that nothing in the model took. ``retied``: the tie
    groups applied to the model, by the model's names. ``plan_origin``: where the ties came
    from: ``"tiekit"`` (the file's plan), ``"safetensors"`` (safetensors' ``save_model``
    metadata) or ``"model"`` (the model's own ties, for files without tie metadata).
    """

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    retied: tuple[TieGroup, ...]
    plan_origin: str


# -- saving -------------------------------------------------------------------------------


def save_model(
    model: nn.Module,
    path: PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
    max_shard_size: int | str | None = None,
    durable: bool = True,
) -> None:
    """Save ``model``'s weights to a safetensors file, one tensor per tie group, with its `TiePlan`.

    ``path`` is a file (``.../model.safetensors``) or a folder (``model.safetensors`` inside
    it). With ``max_shard_size`` (bytes, or a string like ``"2GB"``/``"500MiB"``) a model
    larger than that is written as Hugging Face style shards plus ``<name>.index.json``.
    XLA tensors cross to the host in one batched transfer. Local: it writes in the calling
    process and never waits for other ranks (with several, call it on one rank, or every rank
    calls `tiekit.collective_save_model`).

    The file appears whole or not at all (written aside, then renamed). ``durable=True`` also
    fsyncs it before the rename, so it survives a power loss; ``durable=False`` skips that wait
    for the disk (safetensors' own guarantee) and stays safe against a killed process.
    """
    target = _target_path(path, WEIGHTS_NAME)
    limit = None if max_shard_size is None else _parse_size(max_shard_size)
    plan = _saving_plan(model)
    names, tensors = _unique_tensors(model, plan)
    header = _header_metadata(metadata, plan)

    state = dict(zip(names, _host_tensors(tensors), strict=True))
    if limit is None or sum(_nbytes(t) for t in state.values()) <= limit:
        _write_single(target, state, header, durable)
    else:
        _write_sharded(target, state, header, plan, limit, durable)


def save_checkpoint(
    path: PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    step: int | None = None,
    extra: Any = None,
    durable: bool = True,
) -> None:
    """Save a training checkpoint: weights (one per tie group), optimizer state, step and ``extra``.

    The optimizer state is stored once per unique (tied) parameter, under the parameter's
    source name. ``extra`` may hold tensors, numbers, strings, None, and lists, tuples and
    string-keyed dicts of these (RNG states, data-loader positions...); nothing is pickled.
    ``durable`` as in `save_model`. Local, as `save_model`.
    """
    target = _target_path(path, CHECKPOINT_NAME)
    plan = _saving_plan(model)
    names, tensors = _unique_tensors(model, plan)
    side: dict[str, torch.Tensor] = {}
    record: dict[str, Any] = {
        "version": STATE_VERSION,
        "step": _encode(step, "extra/step", side),
        "extra": _encode(extra, "extra/value", side),
        "optimizer": None if optimizer is None else _optimizer_record(optimizer, model, plan, side),
    }
    clash = sorted(set(names) & set(side))
    if clash:
        raise CheckpointError(f"cannot save {type(model).__name__}: parameter names {clash} clash with optimizer keys")
    header = _header_metadata(None, plan)
    header[STATE_KEY] = json.dumps(record, separators=(",", ":"))
    all_names = [*names, *side]

    hosts = _host_tensors([*tensors, *side.values()])
    _write_single(target, dict(zip(all_names, hosts, strict=True)), header, durable)


def _target_path(path: PathLike, default_name: str) -> Path:
    """A folder (existing, or a name without suffix) holds ``default_name``; else ``path`` is the file."""
    target = Path(path)
    if target.is_dir() or os.fspath(path).endswith(os.sep) or not target.suffix:
        target = target / default_name
    return target


def _parse_size(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", size.upper().replace("IB", "iB"))
        if match is None:
            raise ValueError(f"max_shard_size {size!r} is not a size like 5GB, 500MiB or 1000000")
        number, unit, binary = match.groups()
        base = 1024 if binary else 1000
        value = int(float(number) * base ** "_KMGT".index(unit or "_"))
    else:
        raise ValueError(f"max_shard_size must be an int or a string, not {type(size).__name__}")
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def _saving_plan(model: nn.Module) -> TiePlan:
    """The model's ties, plus the declared ties that hold in its current tensors.

    A declared tie whose two tensors differ (a tie broken by a move, then trained) is left
    out: dropping one of them would lose data. The file then records two tensors.
    """
    declared = {t: s for t, s in declared_ties(model).items() if _same_values(model, t, s)}
    try:
        return find_ties(model, declared=declared or None)
    except TieError as exc:
        raise CheckpointError(f"cannot save {type(model).__name__}: {exc}") from exc


def _same_values(model: nn.Module, target: str, source: str) -> bool:
    a, b = resolve(model, target)[2], resolve(model, source)[2]
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype or a.is_meta or b.is_meta or a.device != b.device:
        return False
    with torch.no_grad():
        return bool(torch.equal(a, b))


def declared_ties(model: nn.Module) -> dict[str, str]:
    """``{target: source}`` ties the model declares: ``TPUMixin.tied_weights`` and transformers'
    ``_tied_weights_keys`` (expanded), restricted to names that exist in the model."""
    declared: dict[str, str] = {}
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    if callable(expand):
        with contextlib.suppress(TypeError, AttributeError, KeyError, ValueError, RuntimeError):
            found = expand(all_submodels=True)
            if isinstance(found, Mapping):
                declared.update({t: s for t, s in found.items() if isinstance(t, str) and isinstance(s, str)})
    if isinstance(model, TPUMixin):
        declared.update(model.tied_weights)
    out = {}
    for target, source in declared.items():
        try:
            a, b = resolve(model, target)[2], resolve(model, source)[2]
        except TieError:
            continue
        if a.shape == b.shape and a.dtype == b.dtype:
            out[target] = source
    return out


def _unique_tensors(model: nn.Module, plan: TiePlan) -> tuple[list[str], list[torch.Tensor]]:
    """The names to store (each group's source once, every untied name) and their tensors."""
    state = model.state_dict(keep_vars=True)
    names: list[str] = []
    seen: set[str] = set()
    for name in state:
        key = plan.source_of(name)
        if key not in seen:
            seen.add(key)
            names.append(key)
    for group in plan.groups:
        if group.source in seen:
            try:
                _group_changes(model, group)  # the same checks retie makes, so the file can be re-tied
            except TieError as exc:
                raise CheckpointError(f"cannot save {type(model).__name__}: {exc}") from exc
    tensors = []
    for name in names:
        tensor = state[name] if name in state else resolve(model, name)[2]
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"cannot save {type(model).__name__}: state {name!r} is a {type(tensor).__name__}, not a tensor"
            )
        if tensor.is_meta:
            raise CheckpointError(f"cannot save {type(model).__name__}: {name!r} is on the meta device (no data)")
        if tensor.layout != torch.strided or tensor.dtype not in DTYPE_CODES:
            raise CheckpointError(
                f"cannot save {type(model).__name__}: {name!r} is a {tensor.layout} {tensor.dtype} tensor, "
                "which safetensors cannot store"
            )
        tensors.append(tensor.detach())
    return names, tensors


def _host_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU, contiguous, non-overlapping copies where needed; XLA tensors in one batched transfer."""
    hosts = devices.to_host(tensors)
    out = []
    storages: set[int] = set()
    for t in hosts:
        if not t.is_contiguous():
            t = t.contiguous()
        if t.numel():
            # Names left out of the plan can still share memory (a reinterpreting view, two
            # disjoint slices of one buffer); safetensors refuses that, so store a copy.
            storage = t.untyped_storage().data_ptr()
            if storage in storages:
                t = t.clone()
            else:
                storages.add(storage)
        out.append(t)
    return out


def _header_metadata(metadata: Mapping[str, str] | None, plan: TiePlan) -> dict[str, str]:
    user = dict(metadata or {})
    for key, value in user.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise CheckpointError(f"metadata must map strings to strings; {key!r}: {value!r} does not")
        if key.startswith("tiekit.") or (key == "format" and value != "pt"):
            raise CheckpointError(f"metadata key {key!r} is reserved by tiekit")
    return {**user, "format": "pt", PLAN_KEY: plan.to_json()}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- atomic files -------------------------------------------------------------------------


def _write_single(target: Path, state: dict[str, torch.Tensor], header: dict[str, str], durable: bool) -> None:
    _prepare_folder(target)
    _commit_file(target, lambda tmp: _save_tensors(state, tmp, header), durable)
    # A sharded save that this file now replaces: drop it, or a loader might still pick it.
    index = target.with_name(target.name + INDEX_SUFFIX)
    if index.exists():
        _remove(target.parent, [index.name, *_weight_map_files(index)])
    _remove(target.parent, _backups(target))


def _write_sharded(
    target: Path, state: dict[str, torch.Tensor], header: dict[str, str], plan: TiePlan, limit: int, durable: bool
) -> None:
    folder = target.parent
    _prepare_folder(target)
    shards = _split(state, limit)
    stem = target.name.removesuffix(".safetensors")
    files = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    index_path = target.with_name(target.name + INDEX_SUFFIX)
    old_files = _weight_map_files(index_path) if index_path.exists() else []
    save_id = secrets.token_hex(8)
    shard_header = {k: v for k, v in header.items() if k != PLAN_KEY}
    shard_header[SAVE_ID_KEY] = save_id
    try:
        work = _work_folder(index_path)
    except OSError as exc:
        raise CheckpointError(f"{index_path}: cannot write: {exc.strerror or exc}") from exc
    try:
        for file, keys in zip(files, shards, strict=True):
            _save_tensors({k: state[k] for k in keys}, work / file, shard_header)
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
                "total_size": sum(_nbytes(t) for t in state.values()),
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
        if shards[-1] and size + _nbytes(t) > limit:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += _nbytes(t)
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


def _weight_map_files(index_path: Path) -> list[str]:
    """Shard files an existing index names, when they are plain names inside its folder."""
    try:
        raw = read_json(index_path, "index")
    except CheckpointError:
        return []
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
        return []
    return sorted({f for f in weight_map.values() if isinstance(f, str) and f and "/" not in f and f != ".."})


def _prepare_folder(target: Path) -> None:
    folder = target.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"{target}: cannot create the folder: {exc.strerror or exc}") from exc
    # Work folders of saves that were killed (their process is gone) are garbage.
    for entry in folder.iterdir():
        match = _TEMP_RE.fullmatch(entry.name)
        if match and not _alive(int(match.group(1))):
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
    work = target.with_name(f".{target.name}{_TEMP_TAG}{os.getpid()}-{secrets.token_hex(4)}")
    work.mkdir()
    return work


def _commit_file(target: Path, write: Callable[[Path], object], durable: bool = True) -> None:
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
        os.replace(tmp, target)
        if durable:
            _fsync(target.parent)
    except OSError as exc:
        raise CheckpointError(f"{target}: cannot write: {exc.strerror or exc}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _save_tensors(state: dict[str, torch.Tensor], path: Path, header: dict[str, str]) -> None:
    from safetensors.torch import save_file

    try:
        save_file(state, os.fspath(path), metadata=header)
    except (ValueError, RuntimeError, TypeError) as exc:
        raise CheckpointError(f"{path}: safetensors refused the tensors: {exc}") from exc


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


# -- opening a checkpoint -----------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    """A validated checkpoint on disk: where each key's bytes are, its metadata and its ties."""

    where: str
    entries: Mapping[str, tuple[str, TensorEntry]]
    metadata: Mapping[str, Any]
    plan: TiePlan | None
    plan_origin: str
    side: Mapping[str, tuple[str, TensorEntry]] = field(default_factory=dict)
    # Identity of each file when its header was validated; reading checks it, so a save that
    # replaces the file in between is an error before anything is loaded, not a silent mix.
    files: Mapping[str, FileIdentity] = field(default_factory=dict)


def open_source(path: PathLike, preferred: tuple[str, ...] = (WEIGHTS_NAME, WEIGHTS_NAME + INDEX_SUFFIX)) -> _Source:
    """Validate the checkpoint at ``path`` (a file, an index, or a folder holding one) without
    reading any tensor: headers, shard paths, save ids and the tie plan. Within tiekit: the
    loaders and ``tiekit inspect`` start here."""
    target = Path(path)
    if target.is_dir():
        target = _pick_in_folder(target, preferred)
    if not target.is_file():
        raise CheckpointError(f"{target}: no such checkpoint file")
    if target.name.endswith(".json"):
        return _open_index(target)
    header = read_header(target)
    entries = {k: (header.path, e) for k, e in header.entries.items()}
    return _with_plan(header.path, entries, header.metadata, _identities([header]))


def _pick_in_folder(folder: Path, preferred: tuple[str, ...]) -> Path:
    for name in preferred:
        if (folder / name).is_file():
            return folder / name
    candidates = sorted(p.name for p in folder.glob("*.safetensors.index.json")) or sorted(
        p.name for p in folder.glob("*.safetensors") if not p.name.startswith(".")
    )
    if len(candidates) == 1:
        return folder / candidates[0]
    if not candidates:
        raise CheckpointError(f"{folder}: no safetensors file or index in this folder")
    raise CheckpointError(f"{folder}: several checkpoints in this folder ({', '.join(candidates)}); name one")


def _open_index(index_path: Path) -> _Source:
    where = os.fspath(index_path)
    raw = read_json(index_path, "index")
    if not isinstance(raw, dict) or not isinstance(raw.get("weight_map"), dict):
        raise CheckpointError(f"{where}: not a safetensors index (no 'weight_map' object)")
    metadata = raw.get("metadata", {})
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{where}: the index 'metadata' is not an object")
    folder = index_path.parent.resolve()
    headers: dict[str, Any] = {}
    entries: dict[str, tuple[str, TensorEntry]] = {}
    for key, file in raw["weight_map"].items():
        if not isinstance(file, str) or not file:
            raise CheckpointError(f"{where}: key {key!r} maps to {file!r}, not a shard file name")
        if file not in headers:
            shard = _inside(folder, file, where, key)
            if not shard.is_file():
                raise CheckpointError(f"{where}: shard {file!r} (holding key {key!r}) is missing")
            headers[file] = read_header(shard)
        header = headers[file]
        if key not in header.entries:
            raise CheckpointError(f"{where}: the index puts key {key!r} in {file!r}, which does not contain it")
        entries[key] = (header.path, header.entries[key])
    save_id = metadata.get(SAVE_ID_KEY)
    if save_id is not None:
        for file, header in headers.items():
            if header.metadata.get(SAVE_ID_KEY) != save_id:
                raise CheckpointError(
                    f"{where}: shard {file!r} belongs to another save than this index (interrupted or mixed copy)"
                )
    return _with_plan(where, entries, metadata, _identities(headers.values()))


def _identities(headers: Iterable[Header]) -> dict[str, FileIdentity]:
    return {h.path: h.identity for h in headers if h.identity is not None}


def _inside(folder: Path, file: str, where: str, key: str) -> Path:
    relative = PurePosixPath(file)
    if relative.is_absolute() or ".." in relative.parts or "\\" in file or ":" in file:
        raise CheckpointError(f"{where}: shard path {file!r} (key {key!r}) escapes the index's folder")
    full = (folder / relative).resolve()
    if not full.is_relative_to(folder):
        raise CheckpointError(f"{where}: shard path {file!r} (key {key!r}) escapes the index's folder (symlink)")
    return full


def _with_plan(
    where: str,
    entries: dict[str, tuple[str, TensorEntry]],
    metadata: Mapping[str, Any],
    files: Mapping[str, FileIdentity],
) -> _Source:
    side: dict[str, tuple[str, TensorEntry]] = {}
    if STATE_KEY in metadata:
        side = {k: v for k, v in entries.items() if k.startswith(SIDE_PREFIXES)}
        entries = {k: v for k, v in entries.items() if k not in side}
    raw_plan = metadata.get(PLAN_KEY)
    if raw_plan is not None:
        try:
            plan = TiePlan.from_dict(raw_plan) if isinstance(raw_plan, dict) else TiePlan.from_json(raw_plan)
        except TieError as exc:
            raise CheckpointError(f"{where}: invalid tie plan in {PLAN_KEY!r}: {exc}") from exc
        for group in plan.groups:
            if group.source not in entries:
                raise CheckpointError(
                    f"{where}: the tie metadata names key {group.source!r} (source of {', '.join(group.names[1:])}) "
                    "but the file has no such tensor"
                )
            entry = entries[group.source][1]
            if entry.shape != group.shape or dtype_name(entry.dtype) != group.dtype:
                raise CheckpointError(
                    f"{where}: the tie metadata says key {group.source!r} is {group.shape} {group.dtype} "
                    f"but the file stores {entry.shape} {dtype_name(entry.dtype)}"
                )
        return _Source(where, entries, metadata, plan, "tiekit", side, files)
    # safetensors.torch.save_model records each dropped duplicate as {removed: kept}.
    pairs: dict[str, list[str]] = {}
    for removed, kept in metadata.items():
        if isinstance(kept, str) and kept in entries and removed not in entries:
            pairs.setdefault(kept, []).append(removed)
    if not pairs:
        return _Source(where, entries, metadata, None, "model", side, files)
    groups = tuple(
        TieGroup(
            kept,
            tuple(TieMember(n, "parameter") for n in [kept, *sorted(removed)]),
            "parameter",
            entries[kept][1].shape,
            dtype_name(entries[kept][1].dtype),
        )
        for kept, removed in pairs.items()
    )
    return _Source(where, entries, metadata, TiePlan(groups, len(entries), len(entries)), "safetensors", side, files)


# -- loading ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Staged:
    """Everything validated, nothing changed yet: the plan to apply and what to read where."""

    groups: tuple[TieGroup, ...]
    loads: tuple[tuple[str, str], ...]  # (model name to fill, file key)
    anchor: Mapping[str, str]  # model name -> the name holding its tensor after the load
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    device: torch.device | None


def load_model(model: nn.Module, path: PathLike, *, strict: bool = True, device: Device = None) -> LoadResult:
    """Load a safetensors file, an index or a folder into ``model`` and re-tie it.

    Works whatever state the model is in: tied, untied, ties broken by an XLA move, or on
    the meta device (each unique tensor is allocated once, on ``device`` or the CPU). Ties
    come from the file's plan, else safetensors' ``save_model`` metadata, else the model's
    own (detected and declared) ties. ``device`` is where the weights end up; by default
    they stay where the model's tensors are. With ``strict`` missing or unexpected keys
    raise `CheckpointError`; every error is raised before the model is changed.
    """
    source = open_source(path)
    staged = _stage(model, source, strict=strict, device=devices.resolve_device(device))
    _commit(model, source, staged)
    return LoadResult(staged.missing, staged.unexpected, staged.groups, source.plan_origin)


def _slots(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor, MemberKind]]:
    slots: dict[str, tuple[nn.Module, str, torch.Tensor, MemberKind]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for attr, p in module._parameters.items():
            if p is not None:
                slots[dot + attr] = (module, attr, p, "parameter")
        for attr, b in module._buffers.items():
            if b is not None:
                slots[dot + attr] = (module, attr, b, "buffer")
    return slots


def _stage(model: nn.Module, source: _Source, *, strict: bool, device: torch.device | None) -> _Staged:
    where, entries = source.where, source.entries
    slots = _slots(model)
    expected = [n for n in model.state_dict(keep_vars=True) if n in slots]
    try:
        model_plan = find_ties(model, declared=declared_ties(model) or None)
    except TieError as exc:
        raise CheckpointError(f"{where}: cannot load into {type(model).__name__}: {exc}") from exc
    if source.plan is None:
        groups = _rekey(_group_table(model_plan), entries)
    else:
        groups = _group_table(source.plan)
        _reconcile(groups, model_plan, entries, where, type(model).__name__)
    key_of = {m.name: (source_key, m) for source_key, members in groups.items() for m in members}

    retie_groups: list[TieGroup] = []
    anchor: dict[str, str] = {}
    loads: list[tuple[str, str]] = []
    for source_key, members in groups.items():
        present = [m for m in members if m.name in slots]
        holder = next((m for m in present if m.view is None), None)
        if holder is None or source_key not in entries:
            continue  # nothing to load: its names are reported missing below
        tied = [TieMember(m.name, slots[m.name][3], m.view, m.requires_grad) for m in present if m is not holder]
        entry = entries[source_key][1]
        group = TieGroup(
            holder.name,
            (TieMember(holder.name, slots[holder.name][3]), *tied),
            "view" if any(m.view for m in tied) else slots[holder.name][3],
            entry.shape,
            dtype_name(entry.dtype),
        )
        loads.append((holder.name, source_key))
        anchor.update({m.name: holder.name for m in present})
        if tied:
            retie_groups.append(group)
    loads.extend((n, n) for n in expected if n not in key_of and n in entries)

    missing = [n for n in expected if n not in anchor and (n in key_of or n not in entries)]
    absent = set(missing)
    consumed = {key_of.get(n, (n, None))[0] for n in expected if n not in absent}
    if source.plan is None:
        consumed |= _equal_duplicates(expected, key_of, source)
    unexpected = [k for k in entries if k not in consumed]
    if strict and (missing or unexpected):
        problems = [f"missing {_names(missing)}"] if missing else []
        problems += [f"unexpected {_names(unexpected)}"] if unexpected else []
        raise CheckpointError(
            f"{where}: does not match {type(model).__name__}: {'; '.join(problems)} (load with strict=False to accept)"
        )

    for name in expected:
        key, member = key_of.get(name, (name, None))
        if name not in absent:
            _check_fits(name, slots[name][2], entries[key][1], member, where)
    for group in retie_groups:
        try:
            _group_changes(model, group)  # the checks retie makes, without changing anything
        except TieError as exc:
            raise CheckpointError(f"{where}: cannot re-tie {type(model).__name__}: {exc}") from exc
    return _Staged(tuple(retie_groups), tuple(loads), anchor, tuple(missing), tuple(unexpected), device)


def _group_table(plan: TiePlan) -> dict[str, list[TieMember]]:
    return {g.source: list(g.members) for g in plan.groups}


def _rekey(groups: dict[str, list[TieMember]], entries: Mapping[str, Any]) -> dict[str, list[TieMember]]:
    """For the model's own plan: a group whose source name the file lacks takes its data from
    another member the file has (a file that kept ``lm_head.weight`` instead of the embedding)."""
    out: dict[str, list[TieMember]] = {}
    for key, members in groups.items():
        if key not in entries:
            key = next((m.name for m in members if m.view is None and m.name in entries), key)
        out[key] = members
    return out


def _reconcile(
    groups: dict[str, list[TieMember]], model_plan: TiePlan, entries: Mapping[str, Any], where: str, cls: str
) -> None:
    """Check the file's ties against the model's (detected and declared) and extend them.

    A model tie the file has no data for (``lm_head.weight`` absent) joins the file's group;
    a model tie between two tensors the file stores separately is a disagreement: loading
    two different tensors into one would silently drop one of them.
    """
    key_of = {m.name: (key, m) for key, members in groups.items() for m in members}
    for group in model_plan.groups:
        source_key, source_member = key_of.get(group.source, (group.source, None))
        for member in group.members[1:]:
            key, _ = key_of.get(member.name, (member.name, None))
            if key == source_key:
                continue
            if key in entries and source_key not in entries and group.source not in key_of and member.view is None:
                # The file holds this tie's one tensor under the member's name: the source joins it.
                source_member = TieMember(group.source, group.members[0].kind)
                groups.setdefault(key, [TieMember(key, "parameter")]).append(source_member)
                key_of[group.source] = (key, source_member)
                source_key = key
                continue
            if key in entries or member.name in key_of:
                raise CheckpointError(
                    f"{where}: the file's tie plan disagrees with {cls}: it stores {key!r} and "
                    f"{source_key!r} as separate tensors, but the model ties {member.name!r} to "
                    f"{group.source!r}. Load into a model built without this tie, or save it tied."
                )
            if source_member is not None and source_member.view is not None and member.view is None:
                member = TieMember(member.name, member.kind, source_member.view, source_member.requires_grad)
            elif source_member is not None and source_member.view is not None:
                raise CheckpointError(
                    f"{where}: cannot reconcile the view {member.name!r} of {group.source!r}, itself a view in the file"
                )
            groups.setdefault(source_key, [TieMember(source_key, "parameter")]).append(member)
            key_of[member.name] = (source_key, member)


def _equal_duplicates(expected: list[str], key_of: Mapping[str, tuple[str, TieMember]], source: _Source) -> set[str]:
    """Keys of a file without tie metadata that repeat a tied tensor: accepted when equal."""
    entries, where = source.entries, source.where
    duplicates: set[str] = set()
    for name in expected:
        key, member = key_of.get(name, (name, None))
        if key == name or name not in entries or key not in entries or member is None:
            continue
        value = _read(*entries[key], source.files)
        if member.view is not None:
            v = member.view
            if v.offset + 1 + sum((s - 1) * st for s, st in zip(v.size, v.stride, strict=True)) > value.numel():
                continue
            value = value.reshape(-1).as_strided(v.size, v.stride, v.offset)
        copy = _read(*entries[name], source.files)
        if copy.shape != value.shape or copy.dtype != value.dtype or not torch.equal(copy, value):
            raise CheckpointError(
                f"{where}: stores {name!r} and {key!r} with different values, but the model ties them; "
                "load into a model built without this tie"
            )
        duplicates.add(name)
    return duplicates


def _check_fits(name: str, tensor: torch.Tensor, entry: TensorEntry, member: TieMember | None, where: str) -> None:
    shape = entry.shape if member is None or member.view is None else member.view.size
    if tuple(tensor.shape) != shape:
        via = "" if entry.name == name else f" (through key {entry.name!r})"
        raise CheckpointError(
            f"{where}: shape mismatch for {name!r}{via}: the file has {shape}, the model {tuple(tensor.shape)}"
        )
    if tensor.dtype != entry.dtype:
        raise CheckpointError(
            f"{where}: dtype mismatch for {name!r}: the file has {dtype_name(entry.dtype)}, the model "
            f"{dtype_name(tensor.dtype)}; cast the model first (tiekit.move(model, dtype=...))"
        )


def _commit(model: nn.Module, source: _Source, staged: _Staged) -> None:
    plan = TiePlan(staged.groups, 0, 0)
    with torch.no_grad():
        retie(model, plan)  # ties broken by a move: point members at their source, then fill it
        jobs: list[tuple[torch.Tensor, tuple[str, TensorEntry], torch.device, bool]] = []
        seen: set[int] = set()
        for name, key in staged.loads:
            tensor = resolve(model, name)[2]
            if id(tensor) in seen:
                continue  # one tensor under several names the plan does not know (the model's own ties)
            seen.add(id(tensor))
            target = staged.device or (torch.device("cpu") if tensor.is_meta else tensor.device)
            replace = tensor.is_meta or not _same_device(tensor.device, target)
            jobs.append((tensor, source.entries[key], target, replace))
        fresh = _fill(jobs, source.files)
        if staged.device is not None:
            for _, _, tensor, _ in _slots(model).values():
                if id(tensor) not in seen and not tensor.is_meta and not _same_device(tensor.device, staged.device):
                    seen.add(id(tensor))
                    fresh[id(tensor)] = tensor.to(staged.device)
        if fresh:
            for module, attr, tensor, kind in _slots(model).values():
                new = fresh.get(id(tensor))
                if new is not None:
                    if kind == "parameter" and not isinstance(new, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=tensor.requires_grad)
                        fresh[id(tensor)] = new
                    assign(module, attr, new, kind)
        retie(model, plan)  # views are rebuilt on the new sources


def _fill(
    jobs: list[tuple[torch.Tensor, tuple[str, TensorEntry], torch.device, bool]], files: Mapping[str, FileIdentity]
) -> dict[int, torch.Tensor]:
    """Read each job's bytes into its tensor (in place) or into a new tensor; {id(old): new}."""
    fresh: dict[int, torch.Tensor] = {}
    reads: list[tuple[str, TensorEntry, torch.Tensor]] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor, bool]]] = {}
    for tensor, (path, entry), target, replace in jobs:
        if target.type == "cpu" and not replace and tensor.is_contiguous():
            reads.append((path, entry, tensor.detach()))  # straight into the parameter's memory
            continue
        host = torch.empty(entry.shape, dtype=entry.dtype)
        reads.append((path, entry, host))
        if target.type != "cpu":
            by_device.setdefault(target, []).append((tensor, host, replace))
        elif replace:
            fresh[id(tensor)] = host
        else:
            copies.append((tensor, host))
    _read_into(reads, files)
    for tensor, host in copies:
        tensor.copy_(host)
    for target, items in by_device.items():
        moved = devices.to_device([host for _, host, _ in items], target)  # one batched transfer
        for (tensor, _, replace), value in zip(items, moved, strict=True):
            if replace:
                fresh[id(tensor)] = value
            else:
                tensor.copy_(value)
    if by_device:
        devices.sync()
    return fresh


_CHUNK = 1 << 23


def _read_into(reads: list[tuple[str, TensorEntry, torch.Tensor]], files: Mapping[str, FileIdentity]) -> None:
    """Read each entry's bytes into its contiguous CPU tensor, with no intermediate copy.

    Reads are cut in 8 MiB chunks and issued from a few threads (``os.preadv`` releases the
    GIL): one thread copying from the page cache is half as fast as two on this 2-core machine.
    Every file is opened, and checked to be the one validated, before the first byte is read:
    an open descriptor keeps reading that file even if a save replaces it meanwhile.
    """
    chunks: list[tuple[int, memoryview, int, TensorEntry, str]] = []
    fds: dict[str, int] = {}
    try:
        for path, entry, out in reads:
            size = entry.end - entry.start
            if size == 0:
                continue
            if path not in fds:
                try:
                    fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
                    now = file_identity(os.fstat(fds[path]))
                except OSError as exc:
                    raise CheckpointError(f"{path}: cannot open: {exc.strerror or exc}") from exc
                if path in files and now != files[path]:
                    raise CheckpointError(
                        f"{path}: changed on disk after its header was checked (replaced by another save?); "
                        "nothing was loaded, load again"
                    )
            view = memoryview(cast(Any, out.reshape(-1).view(torch.uint8).numpy()))
            handle = fds[path]
            chunks.extend((handle, view[a : a + _CHUNK], entry.start + a, entry, path) for a in range(0, size, _CHUNK))
        workers = max(1, min(8, torch.get_num_threads(), len(chunks)))
        if workers == 1 or not hasattr(os, "preadv"):
            for chunk in chunks:
                _read_chunk(*chunk)
        else:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(lambda c: _read_chunk(*c), chunks))  # list() re-raises a reader's error
    finally:
        for fd in fds.values():
            os.close(fd)


def _read_chunk(fd: int, view: memoryview, offset: int, entry: TensorEntry, path: str) -> None:
    done = 0
    while done < len(view):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view[done:]], offset + done)
        else:
            os.lseek(fd, offset + done, os.SEEK_SET)
            n = os.readv(fd, [view[done:]])
        if n <= 0:
            raise CheckpointError(f"{path}: truncated while reading key {entry.name!r} (did the file change?)")
        done += n


def _read(path: str, entry: TensorEntry, files: Mapping[str, FileIdentity]) -> torch.Tensor:
    out = torch.empty(entry.shape, dtype=entry.dtype)
    _read_into([(path, entry, out)], files)
    return out


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _names(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in items[:limit])
    return f"{shown} and {len(items) - limit} more" if len(items) > limit else shown


# -- training checkpoints -----------------------------------------------------------------


def load_checkpoint(
    path: PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a `save_checkpoint` file into ``model`` (and ``optimizer``); returns step and extra.

    The returned dict holds ``"step"``, ``"extra"`` and ``"load_result"`` (a `LoadResult`).
    The optimizer's parameters are re-bound to the model's (re-tied) parameters and get their
    state back, matched by parameter name.
    """
    source = open_source(path, (CHECKPOINT_NAME,))
    record = _record(source)
    staged = _stage(model, source, strict=True, device=None)
    tensors = {k: _read(*v, source.files) for k, v in source.side.items()}
    step = _decode(record.get("step"), tensors, source.where)
    extra = _decode(record.get("extra"), tensors, source.where)
    restore: Callable[[], None] | None = None
    if optimizer is not None:
        if not record.get("optimizer"):
            raise CheckpointError(f"{source.where}: holds no optimizer state")
        restore = _stage_optimizer(optimizer, model, staged, record["optimizer"], tensors, source.where)
    _commit(model, source, staged)
    if restore is not None:
        restore()
    result = LoadResult(staged.missing, staged.unexpected, staged.groups, source.plan_origin)
    return {"step": step, "extra": extra, "load_result": result}


def _record(source: _Source) -> dict[str, Any]:
    text = source.metadata.get(STATE_KEY)
    if text is None:
        return {}
    try:
        record = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{source.where}: corrupted {STATE_KEY!r} metadata: {exc}") from exc
    if not isinstance(record, dict) or not isinstance(record.get("version"), int):
        raise CheckpointError(f"{source.where}: corrupted {STATE_KEY!r} metadata (no version)")
    if record["version"] > STATE_VERSION:
        raise CheckpointError(
            f"{source.where}: checkpoint format {record['version']} is newer than this tiekit reads "
            f"({STATE_VERSION}); upgrade tiekit"
        )
    return record


def _optimizer_record(
    optimizer: torch.optim.Optimizer, model: nn.Module, plan: TiePlan, side: dict[str, torch.Tensor]
) -> dict[str, Any]:
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), plan.source_of(name))
    packed = optimizer.state_dict()
    index_name: dict[int, str] = {}
    groups = []
    for i, (live, saved) in enumerate(zip(optimizer.param_groups, packed["param_groups"], strict=True)):
        group_names = []
        for p, index in zip(live["params"], saved["params"], strict=True):
            found = names.get(id(p))
            if found is None:
                raise CheckpointError(
                    f"cannot save the optimizer: param group {i} holds a tensor of shape {tuple(p.shape)} that is "
                    f"not a parameter of {type(model).__name__} (tiekit stores optimizer state by parameter name)"
                )
            group_names.append(found)
            index_name[index] = found
        options = {k: v for k, v in saved.items() if k != "params"}
        groups.append({"params": group_names, "options": _encode(options, f"optimizer/param_groups/{i}", side)})
    state: dict[str, Any] = {}
    for index, values in packed["state"].items():
        name = index_name[index]
        if name not in state:  # tied names share one parameter, so one state
            state[name] = _encode(dict(values), f"optimizer/state/{name}", side)
    return {"class": type(optimizer).__name__, "param_groups": groups, "state": state}


def _stage_optimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    staged: _Staged,
    record: Any,
    tensors: Mapping[str, torch.Tensor],
    where: str,
) -> Callable[[], None]:
    """Validate the saved optimizer state against ``optimizer``; return the commit step."""
    if not isinstance(record, dict) or not isinstance(record.get("param_groups"), list):
        raise CheckpointError(f"{where}: corrupted optimizer record")
    if record.get("class") != type(optimizer).__name__:
        raise CheckpointError(f"{where}: holds {record.get('class')} state, not {type(optimizer).__name__}")
    saved_groups = record["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{where}: {len(saved_groups)} optimizer param group(s) saved, "
            f"the optimizer has {len(optimizer.param_groups)}"
        )
    # Names before the commit (it may replace or re-tie tensors), mapped to the name that
    # holds each tensor afterwards.
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), staged.anchor.get(name, name))
    key_anchor = {key: name for name, key in staged.loads}
    live_groups: list[list[str]] = []
    options: list[dict[str, Any]] = []
    for i, (live, saved) in enumerate(zip(optimizer.param_groups, saved_groups, strict=True)):
        anchors = list(dict.fromkeys(names.get(id(p), "") for p in live["params"]))
        if "" in anchors:
            raise CheckpointError(f"optimizer param group {i} holds a tensor that is not a parameter of the model")
        saved_names = [key_anchor.get(n, n) for n in saved.get("params", [])]
        if set(saved_names) != set(anchors):
            raise CheckpointError(
                f"{where}: optimizer param group {i}: the checkpoint has state for {_names(sorted(saved_names))} "
                f"but the optimizer holds {_names(sorted(anchors))}"
            )
        live_groups.append(anchors)
        decoded = _decode(saved.get("options", {}), tensors, where)
        if not isinstance(decoded, dict):
            raise CheckpointError(f"{where}: corrupted options of optimizer param group {i}")
        options.append(decoded)
    state: dict[str, Any] = {}
    for name, values in record.get("state", {}).items():
        decoded = _decode(values, tensors, where)
        if not isinstance(decoded, dict):
            raise CheckpointError(f"{where}: corrupted optimizer state of {name!r}")
        state[key_anchor.get(name, name)] = decoded

    def restore() -> None:
        packed: dict[str, Any] = {"state": {}, "param_groups": []}
        index = 0
        for group, anchors, opts in zip(optimizer.param_groups, live_groups, options, strict=True):
            group["params"] = [resolve(model, a)[2] for a in anchors]
            ids = []
            for anchor in anchors:
                if anchor in state:
                    packed["state"][index] = state[anchor]
                ids.append(index)
                index += 1
            packed["param_groups"].append({**opts, "params": ids})
        optimizer.state.clear()
        optimizer.load_state_dict(packed)

    return restore


def _encode(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON for ``value``, its tensors moved into ``tensors`` under keys derived from ``key``."""
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach()
        return {"__tensor__": key}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{key}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{key}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value) or {"__tensor__", "__tuple__"} & set(value):
            raise CheckpointError(f"cannot store {key!r}: dict keys must be strings other than __tensor__/__tuple__")
        return {k: _encode(v, f"{key}/{k}", tensors) for k, v in value.items()}
    raise CheckpointError(
        f"cannot store {key!r}: a {type(value).__name__} (tiekit stores tensors, numbers, strings, None, and "
        "lists, tuples and dicts of these; it never pickles)"
    )


def _decode(value: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, where) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            key = value["__tensor__"]
            if key not in tensors:
                raise CheckpointError(f"{where}: the checkpoint metadata names key {key!r}, which the file lacks")
            return tensors[key]
        if set(value) == {"__tuple__"} and isinstance(value["__tuple__"], list):
            return tuple(_decode(v, tensors, where) for v in value["__tuple__"])
        return {k: _decode(v, tensors, where) for k, v in value.items()}
    return value
