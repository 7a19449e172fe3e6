"""Names on disk: file and metadata keys of tied checkpoints, and where a path points."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from tiekit.errors import CheckpointError

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


def target_path(path: PathLike, default_name: str) -> Path:
    """A folder (existing, or a name without suffix) holds ``default_name``; else ``path`` is the file."""
    target = Path(path)
    if target.is_dir() or os.fspath(path).endswith(os.sep) or not target.suffix:
        target = target / default_name
    return target


def index_of(target: Path) -> Path:
    """The index a sharded save to the file path ``target`` (``max_shard_size``) writes beside it."""
    return target.with_name(target.name + INDEX_SUFFIX)


def saved_at(path: PathLike) -> Path:
    """The file a save to ``path`` left: ``path``, or the index beside it when only that exists (a
    sharded save given a file path holds no file there; its index names the shards)."""
    target = Path(path)
    index = index_of(target)
    return index if not target.exists() and index.is_file() else target


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def name_list(items: Sequence[object], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in items[:limit])
    return f"{shown} and {len(items) - limit} more" if len(items) > limit else shown


def parse_size(size: int | str) -> int:
    """Bytes of a ``max_shard_size``: an int, or a string like ``"5GB"``, ``"500MiB"``, ``"1000000"``."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", size.upper().replace("IB", "iB"))
        if match is None:
            raise CheckpointError(f"max_shard_size {size!r} is not a size like 5GB, 500MiB or 1000000")
        number, unit, binary = match.groups()
        base = 1024 if binary else 1000
        value = int(float(number) * base ** "_KMGT".index(unit or "_"))
    else:
        raise CheckpointError(f"max_shard_size must be an int or a string, not {type(size).__name__}")
    if value <= 0:
        raise CheckpointError(f"max_shard_size must be positive, got {size!r}")
    return value


def shard_name(target: Path, number: int, count: int) -> str:
    """The name of shard ``number`` of ``count`` of the sharded safetensors file ``target``
    (Hugging Face's: ``model-00001-of-00003.safetensors`` for ``model.safetensors``)."""
    return f"{target.name.removesuffix('.safetensors')}-{number:05d}-of-{count:05d}.safetensors"


_SHARD = r"-\d{5,}-of-\d{5,}\.safetensors"


def is_shard_name(name: str) -> bool:
    """Whether ``name`` is named as a shard of some sharded safetensors file (`shard_name`)."""
    return re.fullmatch(r".+" + _SHARD, name) is not None


def shards_beside(target: Path) -> list[Path]:
    """The files beside ``target`` named as shards of it (`shard_name`), of any count. Local."""
    stem = re.escape(target.name.removesuffix(".safetensors"))
    pattern = re.compile(stem + _SHARD)
    if not target.parent.is_dir():
        return []
    return sorted(p for p in target.parent.iterdir() if pattern.fullmatch(p.name))
