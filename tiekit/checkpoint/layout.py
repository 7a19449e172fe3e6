"""Names on disk: file and metadata keys of tied checkpoints, and where a path points."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

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


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def name_list(items: Sequence[object], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in items[:limit])
    return f"{shown} and {len(items) - limit} more" if len(items) > limit else shown
