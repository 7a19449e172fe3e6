"""Training checkpoints of `tiekit.fit`: tied weights, optimizer, position in the data, RNG states.

Written with `tiekit.save_checkpoint` (one tensor per tie group, safetensors; one writer, see
`tiekit.train.coordinate`) as ``<checkpoint_dir>/step-<step>.safetensors``. The ``extra`` record holds where the run
stands (epoch, batches done in it, global step) and every random number generator state the
step touches, so a resumed run continues exactly where the saved one stood.
"""

from __future__ import annotations

import random
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiekit import devices, load_checkpoint
from tiekit.errors import CheckpointError

_STEP_FILE = re.compile(r"step-(\d+)\.safetensors")


@dataclass(frozen=True)
class Position:
    """Where a run stands: ``step`` optimizer steps done, ``batches`` of them in epoch ``epoch``."""

    epoch: int = 0
    batches: int = 0
    step: int = 0


def checkpoint_path(folder: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` goes in ``folder``."""
    return folder / f"step-{step:08d}.safetensors"


def last_checkpoint(folder: Path) -> Path | None:
    """The checkpoint of ``folder`` with the highest step, or None."""
    found = [(int(m.group(1)), p) for p in folder.glob("step-*.safetensors") if (m := _STEP_FILE.fullmatch(p.name))]
    return max(found)[1] if found else None


def contents(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    position: Position,
    world_size: int,
    device: torch.device,
) -> dict[str, Any]:
    """The keywords of `tiekit.save_checkpoint` for a training checkpoint at ``position``: the
    model, the optimizer, the step, and (``extra``) the data position and this replica's RNG
    states. Local: the caller decides who writes."""
    extra = {
        "epoch": position.epoch,
        "batches": position.batches,
        "world_size": world_size,
        "rng": _rng_states(device),
    }
    return {"model": model, "optimizer": optimizer, "step": position.step, "extra": extra}


def resume(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, world_size: int, device: torch.device
) -> Position:
    """Load ``path`` into ``model`` and ``optimizer``, restore the RNG states; the saved `Position`."""
    record = load_checkpoint(path, model=model, optimizer=optimizer)
    extra = record.get("extra")
    if not isinstance(extra, dict) or not {"epoch", "batches", "rng"} <= set(extra):
        raise CheckpointError(f"{path}: not a tiekit.fit checkpoint (no training position in its 'extra' record)")
    if extra.get("world_size") != world_size:
        warnings.warn(
            f"resuming {path}, saved by a run on {extra.get('world_size')} replica(s), on {world_size}: "
            "the data order differs from the original run from here on",
            UserWarning,
            stacklevel=3,
        )
    _set_rng_states(extra["rng"], device)
    return Position(int(extra["epoch"]), int(extra["batches"]), int(record["step"]))


def _rng_states(device: torch.device) -> dict[str, Any]:
    version, state, gauss = random.getstate()
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(state), gauss]}
    if "numpy" in sys.modules:
        kind, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
        states["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    states.update(devices.device_rng_state(device))  # CUDA's or XLA's own generator
    return states


def _set_rng_states(states: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(states["torch"])
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))
    if "numpy" in states and "numpy" in sys.modules:
        np = sys.modules["numpy"]
        kind, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    devices.set_device_rng_state(device, states)
