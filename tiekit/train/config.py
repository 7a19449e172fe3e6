"""The options of one `tiekit.fit` run, checked once, and what each replica reports back.

A `Job` is everything a replica needs; spawn-based launches pickle it, so its model is a module
or a zero-argument factory importable by the child process, and its optimizer a factory such
as ``functools.partial(torch.optim.AdamW, lr=1e-3)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiekit.errors import TiekitError
from tiekit.train.precision import check_precision

STRATEGIES = ("auto", "xla", "spmd", "spmd_fsdp", "ddp", "fsdp", "single")
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]
ModelSource = nn.Module | Callable[[], nn.Module]

#: The default optimizer: AdamW, learning rate 1e-3 (a picklable factory).
DEFAULT_OPTIMIZER: OptimizerFactory = functools.partial(torch.optim.AdamW, lr=1e-3)


@dataclass(frozen=True)
class FitConfig:
    """The options of `tiekit.fit` (see its docstring), validated by `check`."""

    loss_fn: LossFn | None = None
    optimizer: OptimizerFactory = DEFAULT_OPTIMIZER
    epochs: int | None = None
    max_steps: int | None = None
    batch_size: int | None = None
    devices: int | str = "auto"
    strategy: str = "auto"
    precision: str = "32-true"
    checkpoint_dir: Path | None = None
    checkpoint_every: int | None = None
    checkpoint_async: bool = True
    checkpoint_keep: int | None = None
    resume: Path | str | None = None
    seed: int = 0
    drop_last: bool | None = None  # None: the DataLoader's, else True
    shuffle: bool = True
    progress: bool = True
    log_dir: Path | None = None
    log_every: int = 10

    @property
    def epoch_limit(self) -> int | None:
        """Epochs to run: ``epochs``, else 1 without ``max_steps``, else unlimited (None)."""
        if self.epochs is not None:
            return self.epochs
        return 1 if self.max_steps is None else None

    def folder_problem(self) -> str | None:
        """Local: what is wrong with ``checkpoint_dir`` or ``log_dir`` on this process's
        filesystem (a file where the folder goes), or None. Its answer may differ from rank to
        rank (each node its own disk, each rank its own working directory): a rank of several
        must not raise it alone, before the others hear of it (they would wait for it)."""
        for name in ("checkpoint_dir", "log_dir"):
            folder = getattr(self, name)
            if folder is None:
                continue
            if folder.exists() and not folder.is_dir():
                return f"{name}={str(folder)!r} is a file, not a folder"
            # The nearest existing folder above it: a file there means the folder cannot be made.
            above = next((p for p in folder.parents if p.exists() or p.is_symlink()), None)
            if above is not None and not above.is_dir():
                what = "a file, not a folder" if above.exists() else "a symbolic link to nothing"
                return f"{name}={str(folder)!r} cannot be made: {str(above)!r} is {what}"
        return None

    def check(self, *, folders: bool = True) -> None:
        """Raise `TiekitError` naming the first bad option; touches nothing. ``folders=False``:
        not `folder_problem` (one rank of several checks it in `tiekit.train.joining.join`)."""
        if self.strategy not in STRATEGIES:
            raise TiekitError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        check_precision(self.precision)
        for name in ("epochs", "max_steps", "batch_size", "checkpoint_every", "checkpoint_keep"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise TiekitError(f"{name} must be a positive integer or None, not {value!r}")
        if not isinstance(self.log_every, int) or isinstance(self.log_every, bool) or self.log_every < 1:
            raise TiekitError(f"log_every must be a positive integer, not {self.log_every!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise TiekitError(f"seed must be a non-negative integer, not {self.seed!r}")
        for name in ("checkpoint_async", "shuffle", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise TiekitError(f"{name} must be True or False, not {getattr(self, name)!r}")
        if self.drop_last is not None and not isinstance(self.drop_last, bool):
            raise TiekitError(f"drop_last must be True, False or None (the DataLoader's), not {self.drop_last!r}")
        if folders and (problem := self.folder_problem()) is not None:
            raise TiekitError(problem)
        if isinstance(self.devices, bool) or not isinstance(self.devices, int | str):
            raise TiekitError(f"devices must be 'auto', a number of devices or a device string, not {self.devices!r}")
        if isinstance(self.devices, int) and self.devices < 1:
            raise TiekitError(f"devices must be at least 1, not {self.devices}")
        if isinstance(self.devices, str) and self.devices != "auto":
            try:
                device = torch.device(self.devices)
            except RuntimeError as exc:
                raise TiekitError(f"devices={self.devices!r} is neither 'auto' nor a device: {exc}") from exc
            if device.type == "cuda" and not torch.cuda.is_available():
                raise TiekitError(f"devices={self.devices!r}, but torch finds no CUDA device here")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise TiekitError("checkpoint_every needs checkpoint_dir: where should the checkpoints go?")
        if self.checkpoint_keep is not None and self.checkpoint_dir is None:
            raise TiekitError("checkpoint_keep needs checkpoint_dir: the folder whose checkpoints to keep")
        if self.resume == "last" and self.checkpoint_dir is None:
            raise TiekitError('resume="last" needs checkpoint_dir: the folder to look for the last checkpoint in')
        if not callable(self.optimizer):
            raise TiekitError(
                "optimizer must be a factory taking the parameters, e.g. functools.partial(torch.optim.AdamW, lr=1e-3)"
            )
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise TiekitError(f"loss_fn must be callable as loss_fn(output, target), not {self.loss_fn!r}")


@dataclass(frozen=True)
class Job:
    """One run: the model source, the data, the options and where replicas report (spawned runs)."""

    model: ModelSource
    train_data: Any
    val_data: Any
    config: FitConfig
    strategy: str
    run_id: str
    result_dir: Path | None = None


@dataclass(frozen=True)
class Outcome:
    """What one replica reports: its final weights' digest, and (from the master) the history."""

    rank: int
    world_size: int
    device_type: str
    precision: str
    digest: str
    ties_kept: bool
    steps: int
    epochs: int
    losses: tuple[float, ...] = ()
    val_losses: tuple[float, ...] = ()
    samples_per_second: float = 0.0
    seconds: float = 0.0
    checkpoint: str | None = None
    compilations: int | None = None
    xla_report: str | None = None
