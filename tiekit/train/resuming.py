"""The local pieces of `Coordinator.resume`: rank 0's choice of checkpoint, what each rank
sees, and the errors that name the ranks that cannot follow it (none of these waits)."""

from __future__ import annotations

import os
from pathlib import Path

from tiekit.dcp import MARKER_NAME
from tiekit.dcp.layout import SAVE_PREFIX
from tiekit.train import state
from tiekit.train.config import FitConfig


def choose(cfg: FitConfig) -> tuple[str | None, list[Path]]:
    """Rank 0's choice: the checkpoint named by ``resume``, or for ``"last"`` the newest in its
    ``checkpoint_dir`` (None: nothing saved yet); and for ``"last"`` every checkpoint there,
    oldest first (the run continues them)."""
    if cfg.resume == "last":
        assert cfg.checkpoint_dir is not None  # FitConfig.check
        found = state.checkpoints_in(cfg.checkpoint_dir)
        return (str(found[-1]) if found else None), found
    return str(cfg.resume), []


def earlier_run(folder: Path, resume: Path | str | None) -> str | None:
    """For a run started without ``resume``, or from a checkpoint outside ``folder``: why it may
    not write into ``folder`` (None: it may). Local, for the writer to decide once. A folder
    holding complete checkpoints holds an earlier run's: this run would write its ``step-<n>``
    names over them (and delete them with ``checkpoint_keep``), and a later ``resume="last"``
    would continue whichever run wrote the newest step. ``resume="last"`` continues the folder,
    and a ``resume`` path inside it branches from one of its checkpoints on purpose. Leftovers
    that are not checkpoints (uncommitted step folders, temporary files, cut-short deletions, the
    lock file) say nothing."""
    if resume == "last" or (resume is not None and _inside(Path(resume), folder)):
        return None
    found = state.checkpoints_in(folder)
    if not found:
        return None
    names = ", ".join(p.name for p in found[:3]) + (f", ..., {found[-1].name}" if len(found) > 3 else "")
    started = "without resume" if resume is None else f"from {resume}, a checkpoint outside it"
    return (
        f"{folder}: checkpoint_dir already holds {len(found)} checkpoint(s) of an earlier run ({names}), and this "
        f"run was started {started}: it would write its step-<n> checkpoints over them, and a later "
        'resume="last" would continue whichever run wrote the newest step. Pass resume="last" to continue that '
        "run, or give this run another (or an empty) checkpoint_dir; to start from one of those checkpoints on "
        "purpose, pass resume=<path>"
    )


def _inside(path: Path, folder: Path) -> bool:
    """``path`` is ``folder`` or in it, through symlinks too (``resume=`` the folder itself is
    refused later, as a folder that is no checkpoint, naming the ones it holds)."""
    real, real_folder = os.path.realpath(path), os.path.realpath(folder)
    return real == real_folder or real.startswith(real_folder + os.sep)


def newest_here(cfg: FitConfig) -> str | None:
    """For ``resume="last"``: the newest checkpoint in this rank's ``checkpoint_dir`` (local)."""
    if cfg.resume != "last" or cfg.checkpoint_dir is None:
        return None
    newest = state.last_checkpoint(cfg.checkpoint_dir)
    return None if newest is None else str(newest)


def newer_elsewhere(cfg: FitConfig, chosen: Path | None, newer: list[tuple[int, str]], world: int) -> str:
    """Why ``resume="last"`` stops when other ranks find a checkpoint newer than rank 0's newest,
    ``chosen`` (None: rank 0 finds none): ``newer`` is each such rank and what it found."""
    shown = "; ".join(f"rank {rank}: {newest}" for rank, newest in newer[:8])
    folder = cfg.checkpoint_dir
    if chosen is None:
        found, lost = f"rank 0 finds no checkpoint in {folder}", "Starting fresh would train every step again"
        theirs, older = "find one there", ""
    else:
        found, lost = (
            f"rank 0's newest checkpoint in {folder} is {chosen}",
            "Resuming from it would train those steps again",
        )
        theirs, older = (
            "find a newer one there",
            ", or pass resume=<path> on every rank to resume from an older one on purpose",
        )
    return (
        f'resume="last": {found}, but {len(newer)} of the other {world - 1} rank(s) {theirs} ({shown}): the folder '
        "is not one folder for every rank (node-local storage, and rank 0 is on another node this launch?). "
        f"{lost}. Put checkpoint_dir on storage every node shares, or copy the newest checkpoint to rank 0's "
        f"node{older}"
    )


def cannot_open(path: Path) -> str | None:
    """Why this rank cannot read ``path`` (None: it can); a sharded checkpoint's marker for a folder."""
    try:
        if path.is_dir() and not (path / MARKER_NAME).exists():
            return f"{NOT_A_CHECKPOINT}: {_folder_without_marker(path)}"
        with (path / MARKER_NAME if path.is_dir() else path).open("rb") as f:
            f.read(8)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc} (working directory {os.getcwd()})"
    return None


#: How `cannot_open` begins the reason of a folder this rank sees that holds no checkpoint.
NOT_A_CHECKPOINT = "a folder, not a checkpoint"


def _folder_without_marker(path: Path) -> str:
    """What the folder ``path`` (no sharded checkpoint's marker in it) is instead, and what to pass."""
    held = state.checkpoints_in(path)
    if held:
        return (
            f"a checkpoint_dir holding {len(held)} checkpoint(s), the newest {held[-1].name}; pass resume= one of "
            f'them (resume="{held[-1]}"), or resume="last" with checkpoint_dir="{path}"'
        )
    if path.name.startswith(SAVE_PREFIX) and (path.parent / MARKER_NAME).exists():
        return f'one save inside the sharded checkpoint {path.parent}; pass that folder (resume="{path.parent}")'
    if not any(path.iterdir()):
        return "the folder is empty"
    return f"no {MARKER_NAME} in it, so no save into it was committed (a save killed half way?)"


def unreadable(path: Path, failed: list[tuple[int, str]], cfg: FitConfig, world: int) -> str:
    """The error when the ranks of ``failed`` (rank, `cannot_open`'s reason) cannot read ``path``:
    the path itself when no rank can (rank 0's reason); else the ranks that cannot, whose view
    of the folder differs from the others'."""
    if len(failed) == world:
        reason = failed[0][1]
        if reason.startswith(NOT_A_CHECKPOINT):
            return f"resume: {path} is {reason}"
        return f"resume: no checkpoint at {path} ({reason})"
    ranks = ", ".join(str(rank) for rank, _ in failed)
    detail = "; ".join(f"rank {rank}: {problem}" for rank, problem in failed)
    chosen = "the newest in rank 0's checkpoint_dir" if cfg.resume == "last" else "the resume= path"
    return (
        f"resume: rank(s) {ranks} of {world} cannot open {path} ({chosen}), so the ranks would resume at "
        f"different steps: {detail}. Every rank must read the same checkpoint: put checkpoint_dir on storage "
        "every node shares, or copy the checkpoint to every node"
    )


def loaded(outcome: state.Position | str) -> str:
    if isinstance(outcome, str):
        return outcome
    return f"step {outcome.step} (epoch {outcome.epoch}, batch {outcome.batches}) written by run {outcome.run}"
