"""Training checkpoints of `tiekit.fit`: tied weights, optimizer, position in the data, RNG states.

Replicated strategies write them with `tiekit.save_checkpoint` (one tensor per tie group,
safetensors; one writer, see `tiekit.train.coordinate`) as ``<checkpoint_dir>/step-<step>.safetensors``;
sharded ones with `tiekit.save_sharded` (every rank its part) as the folder
``<checkpoint_dir>/step-<step>/``. Either holds in its ``extra`` record where the run stands
(epoch, batches done in it, global step) and every random number generator state the step
touches, so a resumed run continues exactly where the saved one stood. A replicated strategy
resumes from either kind (a sharded folder loads into a replicated model too), a sharded one
from a sharded folder only.
"""

from __future__ import annotations

import random
import re
import shutil
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiekit import devices, load_checkpoint
from tiekit.checkpoint.layout import CHECKPOINT_NAME
from tiekit.checkpoint.source import open_source
from tiekit.dcp import MARKER_NAME, is_sharded_checkpoint, load_sharded
from tiekit.dcp.layout import is_save_folder, read_marker
from tiekit.errors import CheckpointError
from tiekit.plan import TiePlan
from tiekit.slots import slot_table

_STEP_FILE = re.compile(r"step-(\d+)\.safetensors")
_STEP_FOLDER = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class Position:
    """Where a run stands: ``step`` optimizer steps done, ``batches`` of them in epoch ``epoch``;
    ``run``: the id of the run that wrote the checkpoint it was loaded from (None: not loaded, or
    written before tiekit recorded it)."""

    epoch: int = 0
    batches: int = 0
    step: int = 0
    run: str | None = None


def checkpoint_path(folder: Path, step: int, *, sharded: bool = False) -> Path:
    """Where the checkpoint of ``step`` goes in ``folder``: a file, or a folder when ``sharded``."""
    return folder / (f"step-{step:08d}" if sharded else f"step-{step:08d}.safetensors")


def checkpoints_in(folder: Path) -> list[Path]:
    """The checkpoints of ``folder``, oldest step first: the files, and the sharded folders once
    committed (their marker written), so a save killed half way is never taken for one."""
    found = [(int(m.group(1)), p) for p in folder.glob("step-*.safetensors") if (m := _STEP_FILE.fullmatch(p.name))]
    found += [
        (int(m.group(1)), p)
        for p in folder.glob("step-*")
        if (m := _STEP_FOLDER.fullmatch(p.name)) and is_sharded_checkpoint(p)
    ]
    return [p for _, p in sorted(found)]


def step_in_name(path: Path) -> int | None:
    """The step a checkpoint fit wrote is named after (``step-<N>``), or None for another name."""
    match = _STEP_FILE.fullmatch(path.name) or _STEP_FOLDER.fullmatch(path.name)
    return None if match is None else int(match.group(1))


def last_checkpoint(folder: Path) -> Path | None:
    """The checkpoint of ``folder`` with the highest step (see `checkpoints_in`), or None."""
    found = checkpoints_in(folder)
    return found[-1] if found else None


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint fit wrote (``checkpoint_keep``). A sharded folder is first renamed to
    ``.<name>.deleting`` in one step, so a deletion cut short never leaves part of a checkpoint
    that `last_checkpoint` would take (`remove_cut_short_deletions` finishes such a deletion).
    A failure is a warning naming the path; training goes on."""
    try:
        if path.is_dir() and not path.is_symlink():
            doomed = path.with_name(f".{path.name}.deleting")
            shutil.rmtree(doomed, ignore_errors=True)  # a deletion of this name cut short: the rename would fail
            path.rename(doomed)
            shutil.rmtree(doomed)
        else:
            path.unlink(missing_ok=True)
    except OSError as exc:
        warnings.warn(f"checkpoint_keep: could not delete the old checkpoint {path}: {exc}", stacklevel=2)


def remove_cut_short_deletions(folder: Path) -> None:
    """Local, best effort: finish the deletions of sharded checkpoints `remove_checkpoint` began
    in ``folder`` and a kill cut short (``.step-<n>.deleting``): each holds a whole checkpoint's
    bytes that ``checkpoint_keep`` is there to free, and nothing reads it."""
    for leftover in folder.glob(".step-*.deleting"):
        if _CUT_SHORT.fullmatch(leftover.name) and leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)


_CUT_SHORT = re.compile(r"\.step-\d+\.deleting")


def remove_uncommitted_step_folders(folder: Path, keep: Path) -> None:
    """Local, best effort: remove the ``step-<n>`` folders of ``folder`` (other than ``keep``)
    that hold only sharded saves never committed (a launch killed before their marker): no loader
    takes them, and a run that never reaches step n again left their bytes there for good. A
    folder holding anything else (a file of yours) stays."""
    for entry in folder.glob("step-*"):
        if entry == keep or not _STEP_FOLDER.fullmatch(entry.name) or entry.is_symlink() or not entry.is_dir():
            continue
        if is_sharded_checkpoint(entry):
            continue
        inside = list(entry.iterdir())
        marker_work = f".{MARKER_NAME}.tiekit-tmp-"
        if inside and all(is_save_folder(e) or e.name.startswith(marker_work) for e in inside):
            remove_checkpoint(entry)


def _refuse_ties_the_model_lacks(path: Path, saved: TiePlan | None, model: nn.Module, plan: TiePlan) -> None:
    """A tie of the checkpoint's plan ``saved`` that ``plan`` lacks: a load would re-tie it (as
    `tiekit.load_checkpoint` does a model whose ties broke), but fit placed the model, wrapped it
    and built its optimizer as separate tensors: it trained with one parameter fewer than it
    planned and failed at its end."""
    if saved is None:
        return
    held = slot_table(model)  # every parameter and buffer name
    together = {name: i for i, group in enumerate(plan.groups) for name in group.names}
    for group in saved.groups:
        names = [n for n in group.names if n in held]
        if len({together.get(n, n) for n in names}) > 1:
            raise CheckpointError(
                f"{path}: the checkpoint ties {', '.join(repr(n) for n in names)} (one tensor), and the model "
                "passed to fit holds them as separate tensors: build the model with the same ties (or load the "
                "checkpoint into it with tiekit.load_checkpoint before fit, which ties them as the file does)"
            )


@dataclass(frozen=True)
class TrainingRun:
    """What a training checkpoint records of the run beside its position: the run's id, the
    devices, the loaders and each loader's batch size its position counts in, and the ``seed`` and ``shuffle``
    of fit that ordered the epoch it counts in (None: the order did not depend on that option,
    a sampler of the user's decided); ``samples``: how many samples an epoch is drawn from."""

    run_id: str
    world_size: int
    batch_size: int
    seed: int | None
    shuffle: bool | None
    samplers: int = 1  # the data-parallel loaders (DDP, XLA replicas: one per replica; SPMD: per host)
    drop_last: bool | None = None  # whether the training loader drops an epoch's short last batch
    samples: int | None = None  # what an epoch is drawn from: the dataset's length (or the user's sampler's)


def contents(
    model: nn.Module, optimizer: torch.optim.Optimizer, position: Position, run: TrainingRun, device: torch.device
) -> dict[str, Any]:
    """The keywords of `tiekit.save_checkpoint` for a training checkpoint at ``position`` of
    ``run``: the model, the optimizer, the step, and (``extra``) the data position, the run's
    facts and this replica's RNG states. Local: the caller decides who writes."""
    extra = {
        "epoch": position.epoch,
        "batches": position.batches,
        "world_size": run.world_size,
        "batch_size": run.batch_size,
        "samplers": run.samplers,
        "seed": run.seed,
        "shuffle": run.shuffle,
        "drop_last": run.drop_last,
        "samples_per_epoch": run.samples,
        "run": run.run_id,
        "rng": _rng_states(device),
    }
    return {"model": model, "optimizer": optimizer, "step": position.step, "extra": extra}


def sharded_contents(
    model: nn.Module, optimizer: torch.optim.Optimizer, position: Position, run: TrainingRun, device: torch.device
) -> dict[str, Any]:
    """The keywords of `tiekit.save_sharded` for a training checkpoint at ``position`` (as
    `contents`). The RNG states go as JSON lists: stored in rank 0's marker, so the restored
    states are rank 0's, as with one writer (tensors would be DCP items any rank may write)."""
    extra = contents(model, optimizer, position, run, device)["extra"]
    extra["rng"] = _as_lists(extra["rng"])
    return {"model": model, "optimizer": optimizer, "extra": {**extra, "step": position.step}}


def resume(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    run: TrainingRun,
    device: torch.device,
    plan: TiePlan,
    *,
    sharded: bool = False,
) -> Position:
    """Load ``path`` (a file, or a sharded folder: then collective, as `tiekit.load_sharded`) into
    ``model`` and ``optimizer`` of ``run``, restore the RNG states; the saved `Position` (a
    `UserWarning` when it counts in other replicas or batches than ``run``'s, or in an order of
    another ``seed`` or ``shuffle``, or epochs of another ``drop_last`` or number of samples).
    The optimizer keeps the options it was built with (a `UserWarning` for each the checkpoint
    held otherwise); its state is the checkpoint's. A tie the checkpoint holds and ``plan`` (the
    model's, as fit placed it) does not is a `CheckpointError` before anything is loaded."""
    given = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    if is_sharded_checkpoint(path):
        _refuse_ties_the_model_lacks(path, read_marker(path).plan, model, plan)
        extra = load_sharded(model, path, optimizer=optimizer).extra
        record = {"extra": extra, "step": extra.get("step") if isinstance(extra, dict) else None}
        if isinstance(extra, dict) and "rng" in extra:
            extra["rng"] = _as_tensors(extra["rng"])
    elif path.is_dir():
        raise CheckpointError(f"{path}: a folder without a committed sharded checkpoint (a save killed half way?)")
    elif not path.exists():  # found when the run chose it: removed since (checkpoint_keep of another run?)
        raise CheckpointError(f"{path}: no such checkpoint (it was there when the run chose it: removed since?)")
    else:
        if sharded:
            raise CheckpointError(
                f"{path}: a sharded run resumes from a sharded checkpoint folder (step-<step>/, written by "
                "fit with a sharded strategy), not from a single file; to start from this file's weights, "
                "load them with tiekit.load_checkpoint into the model you pass to fit"
            )
        _refuse_ties_the_model_lacks(path, open_source(path, (CHECKPOINT_NAME,)).plan, model, plan)
        record = load_checkpoint(path, model=model, optimizer=optimizer)
    extra = record.get("extra")
    if not isinstance(extra, dict) or not {"epoch", "batches", "rng"} <= set(extra):
        raise CheckpointError(f"{path}: not a tiekit.fit checkpoint (no training position in its 'extra' record)")
    _warn_if_steps_differ(path, extra, run)
    _warn_if_reordered(path, extra, run)
    _keep_given_options(path, optimizer, given)
    _set_rng_states(extra["rng"], device)
    writer = extra.get("run")
    return Position(
        int(extra["epoch"]), int(extra["batches"]), int(record["step"]), writer if isinstance(writer, str) else None
    )


def _warn_if_steps_differ(path: Path, extra: Mapping[str, Any], run: TrainingRun) -> None:
    """A `UserWarning` when the checkpoint's steps took other samples than ``run``'s will. A step
    takes the samples of one span of the epoch's order, as long as the loaders together load as
    many per step (each loader a `DistributedSampler` share, interleaved): 1 loader of 16 and 2 of 8
    take the same ones, 2 hosts' SPMD loaders as many as their devices' batches. Otherwise the
    position in the epoch (in batches) points elsewhere in it. Checkpoints written before the
    loaders were recorded are judged by devices and batch size."""
    saved_batch, saved_loaders = extra.get("batch_size"), extra.get("samplers")
    if saved_batch is None:  # saved before tiekit recorded it
        return
    if saved_loaders is None:
        saved_loaders = run.samplers if extra.get("world_size") == run.world_size else None
    saved = None if saved_loaders is None else int(saved_loaders) * int(saved_batch)
    now = run.samplers * run.batch_size
    if saved == now:
        return
    took = "" if saved is None else f"{saved} samples per step ({saved_loaders} loader(s) of {saved_batch})"
    took = took or f"{extra.get('world_size')} device(s) and loaders of {saved_batch}"
    where = (
        f"its position in the epoch ({extra['batches']} batches) is taken in steps of {now} samples, so the rest "
        "of this epoch skips or repeats samples; "
        if extra.get("batches")
        else ""
    )
    warnings.warn(
        f"resuming {path}, saved by a run that took {took}, with {now} ({run.samplers} loader(s) of "
        f"{run.batch_size}; a loader's batch under spmd and spmd_fsdp is batch_size times its host's devices): "
        f"{where}the data order differs from the original run from here on",
        UserWarning,
        stacklevel=4,
    )


def _keep_given_options(path: Path, optimizer: torch.optim.Optimizer, given: list[dict[str, Any]]) -> None:
    """Put back the options (learning rate, weight decay, betas...) the optimizer factory gave
    each param group, which loading the checkpoint replaced by the saving run's: a resumed run
    trains with what it was given (a run that diverged resumes with a lower learning rate), the
    optimizer's state (moments, step counts) the checkpoint's. A `UserWarning` names each option
    the checkpoint held otherwise."""
    changed = []
    for i, (group, options) in enumerate(zip(optimizer.param_groups, given, strict=True)):
        where = f" in param group {i}" if len(given) > 1 else ""
        for key, value in options.items():
            if key in group and _differs(group[key], value):
                changed.append(f"{key}={value!r}{where} (the checkpoint's: {group[key]!r})")
            group[key] = value
    if changed:
        warnings.warn(
            f"resuming {path} with the options the optimizer was built with: {', '.join(changed)}; its state "
            "(moments, step counts) is the checkpoint's",
            UserWarning,
            stacklevel=3,
        )


def _differs(saved: Any, given: Any) -> bool:
    if isinstance(saved, torch.Tensor) or isinstance(given, torch.Tensor):
        both = isinstance(saved, torch.Tensor) and isinstance(given, torch.Tensor)
        return not (both and saved.shape == given.shape and bool(torch.equal(saved.cpu(), given.cpu())))
    return bool(saved != given)


def _warn_if_reordered(path: Path, extra: dict[str, Any], run: TrainingRun) -> None:
    """A `UserWarning` per option of fit that orders an epoch (``seed``, ``shuffle``) that differs
    from the saving run's: the position counts batches of the order that run drew, so the rest
    of the epoch would repeat some samples and skip others. The same for what makes an epoch
    (``drop_last``, the number of samples it is drawn from). An option one of the runs' orders did
    not depend on (None), or a checkpoint saved before tiekit recorded them, says nothing."""
    for name in ("seed", "shuffle"):
        saved, now = extra.get(name), getattr(run, name)
        if saved is not None and now is not None and saved != now:
            warnings.warn(
                f"resuming {path}, saved by a run with {name}={saved}, with {name}={now}: its position in the "
                f"epoch ({extra['batches']} batches) is taken in another order of the samples, so the rest of "
                "this epoch skips or repeats samples; the data order differs from here on",
                UserWarning,
                stacklevel=4,
            )
    saved, now = extra.get("drop_last"), run.drop_last
    if saved is not None and now is not None and saved != now:
        # fit's drop_last=None takes a DataLoader's own: a loader with drop_last=False resumes a
        # run that dropped its short batches differently, however fit was called.
        warnings.warn(
            f"resuming {path}, saved by a run with drop_last={saved}, with drop_last={now}: an epoch has another "
            f"number of steps, so the epochs, and the data order, differ from the original run's from here on; "
            f"pass drop_last={saved} to fit to continue as it did",
            UserWarning,
            stacklevel=4,
        )
    saved, now = extra.get("samples_per_epoch"), run.samples
    if saved is not None and now is not None and saved != now:  # None: saved before tiekit recorded it
        batches = int(extra["batches"])
        # The position counts batches of the saving run's epoch: in an epoch of other samples it
        # points elsewhere, or past the end, and the loop goes on at the next epoch.
        where = (
            f"its position in the epoch ({batches} batches) is taken in an epoch of other samples, in another "
            f"order, so the rest of this epoch skips or repeats samples (all of it is skipped when this epoch has "
            f"{batches} batches or fewer); "
            if batches
            else ""
        )
        warnings.warn(
            f"resuming {path}, saved by a run whose epoch was drawn from {saved} samples, with {now} (train_data, "
            f"or the sampler of its DataLoader, has another length): {where}the epochs and the data order differ "
            "from the original run's from here on; resume with the data the run was saved with to continue as it did",
            UserWarning,
            stacklevel=4,
        )


def _as_lists(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"tensor": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, dict):
        return {k: _as_lists(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [v if type(v) is int else _as_lists(v) for v in value]  # Python's state: 625 ints
    return value


def _as_tensors(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"tensor", "dtype"}:
        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
    if isinstance(value, dict):
        return {k: _as_tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_tensors(v) for v in value]
    return value


def seed_generators(seed: int) -> None:
    """Seed torch's, Python's and NumPy's global generators (the ones a checkpoint records) with
    ``seed``: a spawned replica starts them from fresh entropy, so a dataset drawing its
    augmentations from ``random`` or ``numpy.random`` would differ between two runs of one seed."""
    torch.manual_seed(seed)
    random.seed(seed)
    if "numpy" in sys.modules:  # torch imports it where it is installed
        sys.modules["numpy"].random.seed(seed % 2**32)


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
