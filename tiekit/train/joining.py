"""Joining a `tiekit.fit` run: the first collective of every rank, which makes its `Coordinator`.

Rank 0's run id (the key of the run's XLA compile gate) and the options that must be equal on
every rank (``checkpoint_dir``, ``resume``, ``max_steps``...) are checked; the writer locks
``checkpoint_dir`` for the run (`tiekit.train.folder_lock`) and, for a run started without
``resume`` or from a checkpoint elsewhere, refuses a folder holding an earlier run's
checkpoints; what each rank finds wrong on its own filesystem is told to every rank; under a
sharded strategy every rank must see the one folder they all write into.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from tiekit.backends.base import Backend
from tiekit.collective import collective_gather, failure_message
from tiekit.dcp.ranks import folder_names, process_group_needed
from tiekit.errors import TiekitError
from tiekit.train import agreements, resuming
from tiekit.train.config import Job
from tiekit.train.coordinate import Coordinator
from tiekit.train.folder_lock import LOCK_NAME, FolderLock, lock_checkpoint_dir

#: The options of `tiekit.fit` every rank must pass alike: a rank with another ``max_steps`` or
#: ``checkpoint_dir`` would leave its peers waiting in a collective, or train on other steps.
SHARED_OPTIONS = (
    "epochs",
    "max_steps",
    "batch_size",
    "precision",
    "seed",
    "drop_last",
    "shuffle",
    "checkpoint_dir",
    "checkpoint_every",
    "checkpoint_async",
    "checkpoint_keep",
    "resume",
)


def join(job: Job, backend: Backend) -> Coordinator:
    """Collective: the `Coordinator` of this rank; rank 0's run id, and the options that must be
    equal checked on every rank (a `TiekitError` naming the option and the ranks that differ).
    The writer takes the ``checkpoint_dir``'s lock (`tiekit.train.folder_lock`): a folder another
    run holds is a `TiekitError` on every rank; the caller releases it (`Coordinator.release`).
    Without ``resume`` (or with a checkpoint outside the folder), a folder already holding
    checkpoints (an earlier run's, as the writer finds it: `tiekit.train.resuming.earlier_run`)
    is a `TiekitError` on every rank too."""
    where = backend.ranks
    cfg = job.config
    lock: FolderLock | None = None
    refused: TiekitError | None = None
    # This rank's own filesystem (a file where checkpoint_dir or log_dir goes): told to every rank
    # by `_agree_on_run`; raised here alone, it would leave the others waiting for this rank.
    unusable = cfg.folder_problem()
    if where.is_writer and cfg.checkpoint_dir is not None and unusable is None:
        folder = Path(os.path.abspath(str(cfg.checkpoint_dir)))
        try:
            lock = lock_checkpoint_dir(folder, job.run_id)
            # Looked at once the lock is held: a run starting beside it cannot add checkpoints meanwhile.
            earlier = resuming.earlier_run(folder, cfg.resume)
            if earlier is not None:
                raise TiekitError(earlier)
        except TiekitError as exc:
            refused = exc
    try:
        run_id = _agree_on_run(job, backend, refused, unusable)
        if backend.sharded_checkpoints and cfg.checkpoint_dir is not None and where.world > 1:
            _agree_on_one_folder(cfg.checkpoint_dir, run_id, backend)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Coordinator(where, run_id, folder_lock=lock)


def _agree_on_run(job: Job, backend: Backend, refused: TiekitError | None, unusable: str | None) -> str:
    """Collective: `join`'s checks; rank 0's run id. ``refused``: the writer could not lock the
    folder, or found an earlier run's checkpoints in it; ``unusable``: this rank's
    `FitConfig.folder_problem` (each raised on every rank, naming the ranks)."""
    where = backend.ranks
    if where.world == 1:
        if unusable is not None:
            raise TiekitError(unusable)
        if refused is not None:
            raise refused
        return job.run_id
    cfg = job.config
    if backend.sharded_checkpoints and (cfg.checkpoint_dir is not None or cfg.resume is not None):
        # Found by every rank alike, before any collective: refused now rather than at the first
        # checkpoint, after the training before it.
        grouped = torch.distributed.is_available() and torch.distributed.is_initialized()
        needed = process_group_needed(where, grouped, "fit", Path(str(cfg.checkpoint_dir or cfg.resume)))
        if needed is not None:
            raise TiekitError(f"{needed} (strategy={backend.name!r} writes sharded checkpoints)")
    # The strategy first: ranks that differ there would wait in different collectives from here on.
    options = {"strategy": job.strategy, **{name: _comparable(getattr(job.config, name)) for name in SHARED_OPTIONS}}
    folder_shared = backend.sharded_checkpoints and cfg.checkpoint_dir is not None
    if folder_shared:  # every rank writes into the folder: one absolute path, whatever each one's cwd
        # (or the same folder once symbolic links are resolved: one rank reaching it through a link)
        options["checkpoint_dir"] = folder_names(Path(os.path.abspath(str(cfg.checkpoint_dir))))
    if backend.sharded_checkpoints and cfg.resume not in (None, "last"):  # every rank reads its part of one folder
        options["resume"] = folder_names(Path(os.path.abspath(str(cfg.resume))))
    held_here = None if refused is None else str(refused)
    gathered = collective_gather((job.run_id, options, held_here, unusable), operation="fit")
    problems = [problem for _, _, _, problem in gathered]
    if any(p is not None for p in problems):
        raise TiekitError(
            failure_message("fit's check of checkpoint_dir and log_dir", problems)
            + " (each rank looks on its own filesystem, a relative path in its own working directory)"
        )
    held = gathered[0][2]  # the writer's refusal: every rank raises it
    if held is not None:
        if refused is not None:
            raise refused
        raise TiekitError(held)
    shared_folder = backend.name if backend.sharded_checkpoints else None
    agreements.refuse_different_options([other for _, other, _, _ in gathered], shared_folder)
    return str(gathered[0][0])


def _agree_on_one_folder(folder: Path, run_id: str, backend: Backend) -> None:
    """Collective: every rank sees the lock file the writer made in ``folder`` for the run
    ``run_id``, else a `TiekitError` on every rank naming the ranks that do not. Every rank of a
    sharded run writes its part into the folder: node-local disks showed only at the first
    checkpoint's commit, after the steps before it. Unchecked when the writer itself reads no
    such file (a filesystem without locks)."""
    lock = Path(os.path.abspath(str(folder))) / LOCK_NAME
    wait = _shared_folder_wait()  # on every rank: a bad value is refused by all alike, before the gather
    seen = _sees_run(lock, run_id, patience=0.0 if backend.ranks.is_writer else wait)
    gathered = collective_gather(seen, operation="fit")
    if not gathered[0]:
        return
    blind = [rank for rank, saw in enumerate(gathered) if not saw]
    if blind:
        raise TiekitError(
            f"the ranks do not share checkpoint_dir={str(folder)!r}: rank(s) {', '.join(map(str, blind))} of "
            f"{len(gathered)} do not see the lock file {LOCK_NAME} rank 0 made in it for this run (node-local "
            "storage?). Every rank of a sharded run writes its part of each checkpoint into that folder: give "
            "a checkpoint_dir on storage every node shares"
        )


#: Seconds a rank looks for the lock file of a sharded run's checkpoint_dir before it calls the
#: folder node-local (default 65).
SHARED_FOLDER_WAIT = "TIEKIT_SHARED_FOLDER_WAIT"


def _shared_folder_wait() -> float:
    """``TIEKIT_SHARED_FOLDER_WAIT``, else 65 s: an NFS client that looked the name up before rank
    0 made it (fit's own check of the folder did) may answer "no such file" from its cache until
    it revalidates the directory, up to acdirmax (60 s by default), and a shared folder must not
    be taken for a node-local one. The wait costs only a run that is refused anyway."""
    given = os.environ.get(SHARED_FOLDER_WAIT)
    try:
        return 65.0 if given is None else max(0.0, float(given))
    except ValueError:
        raise TiekitError(f"{SHARED_FOLDER_WAIT}={given!r} is not a number of seconds") from None


def _sees_run(lock: Path, run_id: str, patience: float) -> bool:
    """Local: ``lock`` names the run ``run_id``; looked at again for up to ``patience`` seconds
    (a shared filesystem may show another node's new file late)."""
    deadline = time.monotonic() + patience
    while True:
        try:
            if json.loads(lock.read_text(encoding="utf-8")).get("run") == run_id:
                return True
        except (OSError, ValueError, AttributeError):
            pass  # not there (yet), or not written whole yet
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def _comparable(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value
