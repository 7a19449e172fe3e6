"""The run-wide decisions of one `tiekit.fit` run: made once, on rank 0, checked on every rank.

The ranks of a run (torch.distributed processes, ``torch_xla.launch`` replicas, SPMD hosts)
each run `tiekit.train.loop`; whatever they must share goes through a `Coordinator`, and
nowhere else. Its methods are collectives over the backend's ranks (every rank calls them, in
the same order, in `tiekit.train.loop`); a run of one rank decides alone and waits for nobody:

1. `tiekit.train.joining.join` makes the `Coordinator`: rank 0's run id, the options every rank
   must pass alike, the ``checkpoint_dir`` locked for the run and checked.
2. `Coordinator.agree_on_model`: every rank built the same model (names, shapes, dtypes, ties),
   checked before it is moved or sharded: a rank whose model differs is a `TiekitError` on
   every rank naming what differs (FSDP2 would pair tensors of different sizes); then
   `Coordinator.agree_on_optimizer`: the same optimizer class and options. What counts as
   different, and how it is told, is `tiekit.train.agreements`.
3. `Coordinator.agree_on_data`: every rank's share of the training (and validation) data is as
   long: a rank given a shorter dataset would end its epoch first and leave the others waiting.
4. `Coordinator.choose_checkpoint`, before the model is moved: the checkpoint to resume from,
   decided on rank 0 (``"last"``: the newest in rank 0's ``checkpoint_dir``), then opened by
   every rank: a rank that cannot (node-local folders) is a `TiekitError` on every rank naming
   it and the path. `Coordinator.resume` loads it; after the load, every rank must stand at the
   same step.
5. `Coordinator.save`: one writer per checkpoint (rank 0; process index 0 under SPMD; every
   rank its part of a sharded one), its failure raised on every rank: at once, or for a save
   written in the background at the next save or `Coordinator.finish_saves`. First, a loss that
   was not finite on any rank since the last save stops the run on every rank, nothing written
   (`Coordinator.check_finite`).
6. `abort`: a failing rank releases the launch threads waiting for it in a collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import tiekit
from tiekit.agreement import collective_check_same_model
from tiekit.backends.base import Backend
from tiekit.checkpoint.deferred import DeferredCopies
from tiekit.checkpoint.image import FileImage
from tiekit.checkpoint.saving import save_checkpoint_reusing
from tiekit.collective import (
    Ranks,
    collective_gather,
    collective_save_checkpoint,
    failure_message,
)
from tiekit.dcp import SaveHandle
from tiekit.dcp.background import abandon_writes
from tiekit.dcp.saving import save_sharded_staged
from tiekit.errors import CheckpointError, ReplicaStopped, TieError, TiekitError
from tiekit.launch_threads import abort_thread_collectives, begin_thread_collectives, end_thread_collectives
from tiekit.plan import TiePlan
from tiekit.train import agreements, resuming, state
from tiekit.train.config import FitConfig
from tiekit.train.folder_lock import FolderLock
from tiekit.train.losses import LossWatch


@dataclass
class Coordinator:
    """One rank's handle on its run's shared decisions (see the module docstring)."""

    ranks: Ranks
    run_id: str
    batch_size: int = 0  # per replica, as the data loader batches: what a checkpoint's position counts in
    # What orders the epoch a checkpoint's position counts in, as the loop's data loader says
    # (`ReplicaLoader.order_seed`, `order_shuffle`; None: not fit's seed or shuffle).
    seed: int | None = None
    shuffle: bool | None = None
    drop_last: bool | None = None
    samples: int | None = None  # what the training loader's epoch is drawn from (`ReplicaLoader.samples_per_epoch`)
    last_saved: Path | None = None
    pending: SaveHandle | None = None  # this rank's background save, if one is under way
    # The host memory of the last background save, copied into by the next one once that save
    # is written (one save in flight at a time): a sharded save's host tensors, a file's image.
    sharded_staging: dict[str, torch.Tensor] | None = None
    staging: FileImage | None = None
    copying: DeferredCopies | None = None
    pending_path: Path | None = None  # where the save in flight (on any rank) goes
    written: list[Path] = field(default_factory=list)  # this run's complete checkpoints, oldest first (see resume)
    leftovers_cleared: bool = False  # deletions an earlier launch's kill cut short: finished once per run
    folder_lock: FolderLock | None = None  # the writer's hold on checkpoint_dir (one run at a time)

    def release(self) -> None:
        """Local: let go of the ``checkpoint_dir`` lock (at the end of the run, however it ends);
        once this rank's background save is written, if one still is (a failed run's last save
        goes on writing into the folder after fit raised)."""
        lock, self.folder_lock = self.folder_lock, None
        if lock is None:
            return
        if self.pending is not None and not self.pending.done():
            lock.release_once_finished(self.pending)
        else:
            lock.release()

    def after_failure(self) -> None:
        """Local: this rank's training failed. With other ranks, its background sharded save may
        never finish (their writers wait for their training threads, which wait for this rank in
        a training collective): the process's exit does not wait for it for good
        (`tiekit.dcp.background.abandon_writes`), so that it ends, and the others' collectives fail."""
        if self.ranks.world > 1 and self.pending is not None and not self.pending.done():
            abandon_writes()

    def gather(self, value: Any) -> list[Any]:
        """Collective: every rank's ``value`` in rank order (``[value]`` in a run of one rank)."""
        return collective_gather(value) if self.ranks.world > 1 else [value]

    def agree_on_model(self, plan: TiePlan, model: nn.Module) -> None:
        """Collective: `tiekit.agreement.collective_check_same_model`, its error saying that the
        model factory must build the same model on every rank."""
        if self.ranks.world == 1:
            return
        try:
            collective_check_same_model(model, plan)
        except ReplicaStopped:
            raise  # another replica failed (building its model, say): no difference was found
        except TiekitError as exc:
            raise TiekitError(
                f"{exc}. The model factory must build the same model, with the same ties, on every rank of a run"
            ) from exc

    def agree_on_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Collective: every rank built the same optimizer (its class, and each param group's
        options and parameter count); else a `TiekitError` on every rank naming the first option
        that differs and the ranks. Replicas stepping with different options drift apart (DDP)
        or train one model with a mixture of them (FSDP2), without an error."""
        if self.ranks.world > 1:
            agreements.refuse_different_optimizers(self.gather(agreements.optimizer_description(optimizer)))

    def agree_on_data(self, shares: dict[str, tuple[int, int]]) -> None:
        """Collective: every rank was given each dataset, and its share of it,
        ``{"train_data": (samples, batches)}`` per epoch, has as many batches; else a `TiekitError`
        on every rank naming the ranks and their shares. Ranks given datasets of different
        lengths would end an epoch at different steps, and the rank left over would wait in its
        next all-reduce for good."""
        if self.ranks.world > 1:
            agreements.refuse_different_data(self.gather(shares))

    def choose_checkpoint(self, cfg: FitConfig) -> Path | None:
        """Collective: the checkpoint rank 0 chose to resume from (None: start fresh, without
        ``resume``, or when ``"last"`` finds none), which every rank can open; else a
        `TiekitError` on every rank. Reads no more than the file's first bytes: fit asks before it
        places the model."""
        if cfg.resume is None:
            return None
        choice, continued = resuming.choose(cfg) if self.ranks.rank == 0 else (None, [])
        # resume="last": the others say what their own checkpoint_dir holds, so that rank 0
        # finding none, or an older one, where they find a newer one (node-local folders, rank 0
        # on another node this launch) is an error, not a start that trains those steps again.
        seen = resuming.newest_here(cfg) if self.ranks.rank != 0 else None
        gathered = self.gather((choice, seen))
        chosen = gathered[0][0]
        elsewhere = [(rank, newest) for rank, (_, newest) in enumerate(gathered) if newest is not None]
        if chosen is None:
            if elsewhere:
                raise TiekitError(resuming.newer_elsewhere(cfg, None, elsewhere, self.ranks.world))
            return None  # resume="last" and nothing saved yet: every rank starts fresh
        path = Path(chosen)
        newer = [(r, n) for r, n in elsewhere if (state.step_in_name(Path(n)) or 0) > (state.step_in_name(path) or 0)]
        if newer:
            raise TiekitError(resuming.newer_elsewhere(cfg, path, newer, self.ranks.world))
        problems = self.gather(resuming.cannot_open(path))
        failed = [(rank, problem) for rank, problem in enumerate(problems) if problem is not None]
        if failed:
            raise TiekitError(resuming.unreadable(path, failed, cfg, self.ranks.world))
        self.last_saved = path
        # With "last" the run continues the folder (a torchrun restart, a resubmitted job): its
        # checkpoints count as this run's for checkpoint_keep, or every launch would leave N more.
        # Rank 0 listed them when it chose, and rank 0 is the writer, the one that deletes.
        self.written = continued
        return path

    def resume(
        self, path: Path | None, model: nn.Module, optimizer: torch.optim.Optimizer, backend: Backend, plan: TiePlan
    ) -> state.Position:
        """Collective: load ``path``, the checkpoint `choose_checkpoint` chose, into ``model`` and
        ``optimizer`` on every rank; where the run stands (the start for None).

        `TiekitError` on every rank when a rank failed to load it or the ranks stand at different
        steps (each read its own copy of the file, and the copies differ).
        """
        if path is None:
            return state.Position()
        sharded = backend.sharded_checkpoints
        if self.ranks.world == 1:
            return state.resume(
                path, model, optimizer, self.training_run(backend), backend.device, plan, sharded=sharded
            )
        loaded: state.Position | str
        kind: type[TiekitError] = TiekitError
        try:
            loaded = state.resume(
                path, model, optimizer, self.training_run(backend), backend.device, plan, sharded=sharded
            )
        except TiekitError as exc:  # reported to every rank below (a failed load changes nothing)
            loaded = f"{type(exc).__name__}: {exc}"
            kind = (
                CheckpointError if isinstance(exc, CheckpointError) else TieError if isinstance(exc, TieError) else kind
            )
        outcomes = self.gather(loaded)
        if all(isinstance(o, str) for o in outcomes) and len(set(outcomes)) == 1:  # the same failure everywhere
            raise kind(f"resume: every rank failed to load {path}: {loaded}")  # as one rank alone raises it
        if isinstance(loaded, str) or len(set(outcomes)) > 1:
            shown = "; ".join(f"rank {r}: {resuming.loaded(o)}" for r, o in enumerate(outcomes))
            raise TiekitError(
                f"resume: the ranks did not all load the same {path} ({shown}); each read its own "
                "copy of it: every rank must resume from the same checkpoint"
            )
        return loaded

    def training_run(self, backend: Backend) -> state.TrainingRun:
        """What this run's checkpoints record of it. Local."""
        return state.TrainingRun(
            self.run_id,
            backend.devices_in_run,
            self.batch_size,
            self.seed,
            self.shuffle,
            backend.data_replicas,
            self.drop_last,
            self.samples,
        )

    def save(
        self,
        cfg: FitConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        at: state.Position,
        backend: Backend,
        losses: LossWatch,
    ) -> None:
        """Collective: write the checkpoint of step ``at.step`` into ``cfg.checkpoint_dir`` once,
        on the writer (sharded: every rank its part, `tiekit.save_sharded`); its failure is raised
        on every rank (`tiekit.CheckpointError`). With ``cfg.checkpoint_async`` the state is
        copied to host memory here and written in the background: the failure of a save is
        raised at the next save or at `finish_saves`.

        ``losses``: this rank's since the last save (cleared here). A loss that is not finite on
        any rank is a `TiekitError` on every rank and nothing is written (see `check_finite`)."""
        assert cfg.checkpoint_dir is not None  # fit saves only with a checkpoint_dir
        self.finish_saves(cfg)  # one save in flight at a time: the previous one written, or its failure raised
        self.check_finite(losses, at.step)
        losses.clear()
        path = state.checkpoint_path(cfg.checkpoint_dir, at.step, sharded=backend.sharded_checkpoints)
        blocking = not cfg.checkpoint_async
        if backend.sharded_checkpoints:
            sharded = state.sharded_contents(model, optimizer, at, self.training_run(backend), backend.device)
            # As below: the parameters and optimizer state are copied beside the next step, and
            # the optimizer state then moves into the copy (this rank's shard file image).
            self.pending, self.sharded_staging, self.copying = save_sharded_staged(
                path=path, blocking=blocking, staging=self.sharded_staging, defer=True, adopt=True, **sharded
            )
        else:
            contents = state.contents(model, optimizer, at, self.training_run(backend), backend.device)
            if not blocking:
                if self.ranks.is_writer:
                    # The parameters and optimizer state are copied beside the next step's forward and
                    # backward passes (they change only in its optimizer step): see `weights_copied`.
                    # Then they move into the file image, so later saves write them without a copy.
                    self.pending, self.staging, self.copying = save_checkpoint_reusing(
                        path, blocking=False, staging=self.staging, defer=True, adopt=True, **contents
                    )
            elif self.ranks.world > 1:
                collective_save_checkpoint(path, **contents)
            else:
                tiekit.save_checkpoint(path, **contents)
        self.last_saved = path
        if blocking:
            self._complete(cfg, path)
        else:
            self.pending_path = path

    def check_finite(self, losses: LossWatch, step: int) -> None:
        """Collective: a `TiekitError` on every rank when a loss in any rank's ``losses`` (since
        the last save) is NaN or infinite, naming the first one and the last checkpoint written.
        The checkpoint of ``step`` is then not written: with ``checkpoint_keep``, it would push
        the last good checkpoints out of the folder."""
        found = self.gather(losses.fetch())
        bad = [(where, rank) for rank, where in enumerate(found) if where is not None]
        if not bad:
            return
        (bad_step, value), rank = min(bad)
        who = f" on rank {rank}" if self.ranks.world > 1 else ""
        last = "none was written before" if self.last_saved is None else f"the last one written: {self.last_saved}"
        raise TiekitError(
            f"training diverged: the loss of step {bad_step} was {value}{who}. fit stopped at step {step} without "
            f"writing its checkpoint ({last}). Resume from an earlier checkpoint with a lower learning rate "
            "(an optimizer factory with a lower lr: a resumed run keeps the factory's options), gradient clipping "
            "or other data"
        )

    def weights_copied(self, *, then_wait: bool = False) -> None:
        """Local: return once a background save's copy of the parameters and optimizer state is
        made (and checked: nothing wrote them since the save), or the file image they live in
        taken back from its writer. The training loop calls it before each optimizer step, which
        changes them; at once when no copy is under way. ``then_wait``: the caller waits for the
        write next, changing nothing, so the image is not taken back."""
        if self.copying is not None:
            copying, self.copying = self.copying, None
            copying.settle(then_wait=then_wait)

    def release_staging(self, model: nn.Module) -> None:
        """Local: the parameters living in the background saves' file image (see `save`) get
        memory of their own again, and the image goes: the trained model would otherwise keep the
        optimizer state alive with it."""
        image, self.staging = self.staging, None
        if image is None:
            return
        block = image.memory.untyped_storage().data_ptr()
        with torch.no_grad():
            for p in model.parameters():
                if p.device.type == "cpu" and p.untyped_storage().data_ptr() == block:  # host memory only
                    p.data = p.data.clone()

    def finish_saves(self, cfg: FitConfig) -> None:
        """Collective (in a run that saves in the background): wait until this rank's background
        save, if any, is written; raise any rank's failure on every rank (`tiekit.CheckpointError`
        naming the ranks)."""
        self.weights_copied(then_wait=True)
        if cfg.checkpoint_dir is None or not cfg.checkpoint_async:
            return  # the same on every rank: nothing was saved in the background
        handle, self.pending = self.pending, None
        error: str | None = None
        own: CheckpointError | None = None
        if handle is not None:
            try:
                handle.wait()
            except CheckpointError as exc:  # reported to every rank below
                error, own = str(exc), exc
        if self.ranks.world == 1:
            if own is not None:
                raise own
        else:
            errors = self.gather(error)
            if any(e is not None for e in errors):
                raise CheckpointError(failure_message("a background checkpoint save", errors)) from own
        path, self.pending_path = self.pending_path, None
        if path is not None:
            self._complete(cfg, path)  # complete on every rank: the gather above waited for all

    def _complete(self, cfg: FitConfig, path: Path) -> None:
        """``path`` is complete on every rank: with ``checkpoint_keep``, the writer deletes this
        run's checkpoints older than the newest ``checkpoint_keep``, and at the run's first
        complete save finishes the deletions a kill cut short and removes the step folders of
        sharded saves a kill left uncommitted (local, no collective)."""
        self.written = [p for p in self.written if p != path] + [path]  # a step saved twice counts once
        if cfg.checkpoint_keep is None:
            return
        if self.ranks.is_writer and not self.leftovers_cleared:
            state.remove_cut_short_deletions(path.parent)  # a launch killed while deleting left them
            state.remove_uncommitted_step_folders(path.parent, keep=path)  # or while saving
            self.leftovers_cleared = True
        if len(self.written) <= cfg.checkpoint_keep:
            return
        old, self.written = self.written[: -cfg.checkpoint_keep], self.written[-cfg.checkpoint_keep :]
        if self.ranks.is_writer:
            for stale in old:
                state.remove_checkpoint(stale)


def begin(backend: Backend) -> None:
    """Local: this rank starts a fit; launch threads count its collectives apart from an earlier
    fit's in the same launch, and refuse to train after one that failed (you caught its error)."""
    if backend.ranks.kind == "xla-threads":
        begin_thread_collectives()


def end(backend: Backend) -> None:
    """Local: this rank's fit is over (returned or raised); launch threads refuse every later
    collective of the launch after a fit that failed."""
    if backend.ranks.kind == "xla-threads":
        end_thread_collectives()


def abort(backend: Backend, reason: str, failed: BaseException | None = None) -> None:
    """Local: this rank failed with ``reason`` (raising ``failed``); release the launch threads of
    this process that wait for it in a collective (processes find out by its exit)."""
    if backend.ranks.kind == "xla-threads":
        abort_thread_collectives(reason, failed)
