"""One replica's run: build the model, move it keeping its ties, resume, train, validate, save.

`train_step` is the whole step, from a batch on the device to updated weights; `run_replica`
wraps it in epochs. Every strategy runs this same code; `tiekit.backends` supplies the
few runtime-specific answers (device, placement and sharding, data slice, gradient reduction, end
of step).
"""

from __future__ import annotations

import copy
import hashlib
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from tiekit import devices
from tiekit.backends.base import Backend
from tiekit.checkpoint.direct import host_bytes
from tiekit.errors import ReplicaStopped, TiekitError
from tiekit.launch_threads import thread_failure
from tiekit.moving import moving_plan
from tiekit.retie import verify
from tiekit.train import coordinate, joining, state
from tiekit.train.config import Job, LossFn, Outcome
from tiekit.train.data import ReplicaLoader, derived_seed, make_loader
from tiekit.train.log import TrainLog
from tiekit.train.losses import LossWatch
from tiekit.train.placement import PutBack, floating_dtypes, restore_dtypes
from tiekit.train.precision import Precision, resolve_precision
from tiekit.wrappers import unwrap

# torch_xla.launch runs the replicas of a host as threads of one process: they share torch's
# global RNG, so each builds its model from the seed while holding this lock.
_build_lock = threading.Lock()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    backend: Backend,
    precision: Precision,
    loss_fn: LossFn | None,
    before_update: Callable[[], None] = lambda: None,
) -> torch.Tensor:
    """One optimisation step, from a batch on the device to updated weights; returns the loss.
    ``before_update`` runs just before the optimizer changes the weights."""
    with precision.autocast(backend.device, cache=backend.autocast_cache):
        loss = compute_loss(model, precision.cast_batch(batch), loss_fn)
    loss.backward()  # type: ignore[no-untyped-call]
    before_update()  # fit: a background checkpoint's copy of the weights is made by now
    backend.optimizer_step(optimizer)  # "xla": gradients averaged over the replicas, in the graph
    optimizer.zero_grad(set_to_none=True)
    backend.end_step()  # XLA: the step's graph is compiled once, then launched every step
    return loss.detach()


def compute_loss(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """``loss_fn(model(inputs), target)`` for an ``(inputs..., target)`` batch, else the loss the
    model returns for ``model(*batch)`` / ``model(**batch)`` (a tensor, ``.loss`` or ``["loss"]``)."""
    if loss_fn is not None:
        if not isinstance(batch, tuple | list) or len(batch) < 2:
            raise TiekitError(
                f"with loss_fn, each batch must be (inputs..., target); got a {type(batch).__name__}. "
                "Without loss_fn, the model's forward returns the loss."
            )
        *inputs, target = batch
        value = loss_fn(model(*inputs), target)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
            raise TiekitError(f"loss_fn {name} returned {_what(value)}, not a scalar loss (reduce it: a mean or a sum)")
        return value
    if isinstance(batch, Mapping):
        out = model(**batch)
    elif isinstance(batch, tuple | list):
        out = model(*batch)
    else:
        out = model(batch)
    loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TiekitError(
            f"{type(unwrap(model)).__name__}.forward returned {_what(out if loss is None else loss)}, not a scalar "
            "loss; pass loss_fn=..., or make forward return the loss (or an output with .loss)"
        )
    return loss


def _what(value: Any) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def run_replica(job: Job, backend: Backend) -> tuple[Outcome, nn.Module]:
    """Train this replica; its `Outcome` and its trained model (on the CPU, ties kept).

    Collective: every replica of the run calls it (see `tiekit.train.coordinate`). A replica
    that fails releases the peers waiting for it in this process (launch threads)."""
    coordinate.begin(backend)
    try:
        return _run(job, backend)
    except BaseException as exc:
        reason = f"{type(exc).__name__}: {exc}"
        threads = backend.ranks.kind == "xla-threads"
        if threads and not isinstance(exc, ReplicaStopped):
            # The launch raises replica 0's exception: released by a peer's failure, it names that
            # replica; its own named none (and the traceback its peers show carries the note).
            exc.add_note(f"tiekit.fit: raised in replica {backend.replica_rank} of {backend.replica_count}")
        # Before any peer is released: the failure (its traceback) is what their errors carry.
        coordinate.abort(backend, reason, exc)  # peers waiting in one of fit's collectives
        backend.abort(reason)  # XLA:CPU threads: peers waiting in the step's compile gate
        if threads and isinstance(exc, ReplicaStopped) and exc.__cause__ is None:
            # Stopped in the compile gate: the failing replica's traceback (the line of your loss_fn).
            exc.__cause__ = thread_failure()
        if isinstance(exc, RuntimeError) and "device_ready_queues_" in str(exc):
            raise TiekitError(
                "this process ran a backward pass before the XLA runtime started, and torch's autograd "
                "engine cannot use XLA devices after that (pytorch/xla#4174). Call torch_xla.device() "
                "before any training on CPU, or run tiekit.fit in a fresh process."
            ) from exc
        raise


def _run(job: Job, backend: Backend) -> tuple[Outcome, nn.Module]:
    started = time.perf_counter()
    coordinator = joining.join(job, backend)  # rank 0's run id; the options checked equal
    passed = PutBack(job.model)
    try:
        return _trained(job, backend, coordinator, passed, started)
    except BaseException as exc:
        coordinator.after_failure()  # a background save other ranks share may never finish
        passed.after_failure(exc)  # the module passed to fit back where it was, not left on the device
        raise
    finally:
        coordinator.release()  # checkpoint_dir's lock: the next run may have the folder


def _trained(
    job: Job, backend: Backend, coordinator: coordinate.Coordinator, passed: PutBack, started: float
) -> tuple[Outcome, nn.Module]:
    cfg = job.config
    backend.start(coordinator.run_id)
    precision = resolve_precision(cfg.precision, backend.half_dtype, backend.device.type)
    model, original_dtype = _build(job, backend)
    own_dtypes = floating_dtypes(model)  # precision casts every floating tensor: each gets its own back
    was_training = model.training
    # Before the move: what must be one tensor on the device; as tiekit.move plans (a TPUMixin's
    # tied_weights too, which the mixin ties at the move: a plan without them refused the model).
    plan = moving_plan(model, None)
    coordinator.agree_on_model(plan, model)
    resume_from = coordinator.choose_checkpoint(cfg)  # one nobody can open stops the run before the move
    passed.remember(model, plan, alone=backend.unplaces_alone)
    backend.place(model, precision.param_dtype, plan)  # moved (and sharded), ties kept
    counters_at_start = backend.counters()  # XLA: this run's compilations, from here on
    backend.seed(cfg.seed)
    optimizer = cfg.optimizer(model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TiekitError(
            f"the optimizer factory {cfg.optimizer!r} returned {optimizer!r}, not a torch.optim.Optimizer"
        )
    coordinator.agree_on_optimizer(optimizer)
    train = _loader(job, job.train_data, backend, shuffle=cfg.shuffle, drop_last=cfg.drop_last)
    # Validation keeps its short last batch (one more graph on XLA, compiled once): no padded
    # duplicates in the mean.
    val = None if job.val_data is None else _loader(job, job.val_data, backend, shuffle=False, drop_last=False)
    shares = {"train_data": train.epoch_share()}
    if val is not None:
        shares["val_data"] = val.epoch_share()
    coordinator.agree_on_data(shares)  # else a rank ending its epoch first leaves the others waiting
    coordinator.batch_size = train.batch_size
    coordinator.seed, coordinator.shuffle = train.order_seed, train.order_shuffle
    coordinator.drop_last = train.drop_last
    coordinator.samples = train.samples_per_epoch()
    position = coordinator.resume(resume_from, model, optimizer, backend, plan)  # every rank loads
    backend.end_step()  # XLA: run the set-up's pending work (a resume's copies) through the gate
    per_epoch = train.batches_per_epoch()
    if position.batches >= per_epoch:  # saved after an epoch's last batch: next epoch
        position = state.Position(position.epoch + 1, 0, position.step)
    limit = cfg.epoch_limit
    total = _total_steps(cfg.max_steps, limit, per_epoch)
    # This rank's losses since the last save, checked before the next one: a diverged run's
    # checkpoint would push the good ones out of a folder with checkpoint_keep. The master's log
    # fetches its losses anyway and hands them over: one transfer, not two.
    unsaved = LossWatch(every=cfg.log_every)
    watched_by_log = backend.is_master and cfg.checkpoint_dir is not None
    log = TrainLog(
        enabled=backend.is_master,
        progress=cfg.progress,
        total_steps=total,
        start_step=position.step,
        samples_per_step=train.batch_size * backend.devices_in_run,
        log_dir=cfg.log_dir,
        log_every=cfg.log_every,
        compilations=_compilations(backend) if backend.compiles else None,
        fetched=unsaved.seen if watched_by_log else None,
    )
    step_model = backend.wrap(model)
    model.train()
    epoch, skip, step, saved_at = position.epoch, position.batches, position.step, -1
    if coordinator.last_saved is not None:  # resumed: that checkpoint holds this step, not written again
        saved_at = step
        if cfg.max_steps is not None and step > cfg.max_steps and backend.is_master:
            warnings.warn(
                f"resume: the checkpoint is at step {step}, past max_steps={cfg.max_steps}: nothing to train; "
                "the model is the checkpoint's",
                UserWarning,
                stacklevel=2,
            )
        elif cfg.epochs is not None and (epoch, skip) > (cfg.epochs, 0) and backend.is_master:
            warnings.warn(
                f"resume: the checkpoint is past epochs={cfg.epochs} ({epoch} epoch(s) done"
                f"{f' and {skip} batch(es)' if skip else ''}): nothing to train; "
                "the model is the checkpoint's",
                UserWarning,
                stacklevel=2,
            )
    done = skip
    watch_transfers = backend.is_master and backend.compiles
    try:
        while (limit is None or epoch < limit) and (cfg.max_steps is None or step < cfg.max_steps):
            done, stopped = skip, False
            for batch in backend.batches(train.epoch(epoch, skip)):
                mark = backend.transfer_mark() if watch_transfers else None
                # The device's generator (XLA's) draws the step's dropout from the run's seed and the
                # step alone: every sync advances it (the loader's at an epoch's end, a save's, a
                # resume's), so a state carried from step to step would differ after a resume.
                backend.seed(derived_seed(cfg.seed, step))
                loss = train_step(
                    step_model, optimizer, batch, backend, precision, cfg.loss_fn, coordinator.weights_copied
                )
                transfers = backend.transfers_since(mark) if watch_transfers else 0
                step, done = step + 1, done + 1
                log.step(step, epoch, loss, transfers)
                if cfg.checkpoint_dir is not None and not watched_by_log:
                    with backend.between_steps():  # fetches the losses every log_every steps
                        unsaved.add(step, loss)
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    log.flush()  # the master's losses since the last fetch reach `unsaved`
                    # collective: one writer, its failure raised on every rank
                    with log.outside_steps(), backend.between_steps():
                        coordinator.save(cfg, model, optimizer, state.Position(epoch, done, step), backend, unsaved)
                    saved_at = step
                if cfg.max_steps is not None and step >= cfg.max_steps:
                    stopped = True
                    break
            if stopped and done < per_epoch:
                break  # max_steps reached inside the epoch
            # The epoch ran to its end (max_steps may have ended it with its last batch): validate, next epoch.
            if val is not None:
                with log.outside_steps(), backend.between_steps():
                    log.validation(step, epoch, _validate(model, val, backend, precision, cfg.loss_fn))
            epoch, skip, done = epoch + 1, 0, 0
        backend.steps_done()  # the last save and fetching the trained weights follow
        log.stop_clock()
        if cfg.checkpoint_dir is not None and saved_at != step:
            log.flush()
            with log.outside_steps():
                coordinator.save(cfg, model, optimizer, state.Position(epoch, done, step), backend, unsaved)
        coordinator.finish_saves(cfg)  # the last checkpoint complete before fit returns
    finally:
        backend.steps_done()
        coordinator.weights_copied()  # a failed run's last background save is still written, if it can be
        coordinator.release_staging(model)
        log.close()
    backend.wait()
    counters_at_end = backend.counters()
    counters = (
        None if counters_at_start is None or counters_at_end is None else counters_at_end.since(counters_at_start)
    )
    ties_kept = verify(model, plan, on_error="warn").ok
    back = original_dtype if precision.param_dtype is not None else None
    model = backend.unplace(model, back, plan, lambda: _build(job, backend, own=False)[0])
    if back is not None:
        restore_dtypes(model, own_dtypes, plan)
    digest = _digest(model)
    model.train(was_training)
    outcome = Outcome(
        rank=backend.replica_rank,
        world_size=backend.devices_in_run,
        device_type=backend.device.type,
        precision=precision.name,
        digest=digest,
        ties_kept=ties_kept,
        steps=step,
        epochs=epoch,
        losses=tuple(log.losses),
        val_losses=tuple(log.val_losses),
        samples_per_second=log.samples_per_second,
        seconds=time.perf_counter() - started,
        # The checkpoint holding the trained model: the one written at the last step. Without a
        # checkpoint_dir nothing was written, and the checkpoint resumed from is an earlier step.
        checkpoint=None
        if coordinator.last_saved is None or cfg.checkpoint_dir is None
        else str(coordinator.last_saved),
        compilations=None if counters is None else counters.compilations,
        xla_report=None if counters is None else counters.report(),
    )
    return outcome, model


def _build(job: Job, backend: Backend, *, own: bool = True) -> tuple[nn.Module, torch.dtype | None]:
    """The replica's model, from the seed; ``own``: a copy of a module passed to fit where the
    backend needs one, or where spawned processes would share its tensors (``own=False``: the
    module itself, for the trained weights of a sharded run to land in)."""
    with _build_lock:
        state.seed_generators(job.config.seed)
        if isinstance(job.model, nn.Module):
            # Replicas must not share storage: launch threads hold the very same module, and
            # spawned processes receive its tensors in shared memory (torch.multiprocessing).
            shared = own and (job.result_dir is not None or backend.copies_model)
            model = copy.deepcopy(job.model) if shared else job.model
        else:
            model = job.model()
            if not isinstance(model, nn.Module):
                raise TiekitError(f"the model factory {job.model!r} returned a {type(model).__name__}, not a Module")
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return model, dtypes[0] if dtypes else None


def _compilations(backend: Backend) -> Callable[[], int]:
    def count() -> int:
        counters = backend.counters()
        return 0 if counters is None else counters.compilations

    return count


def _loader(job: Job, data: Any, backend: Backend, *, shuffle: bool, drop_last: bool | None) -> ReplicaLoader:
    cfg = job.config
    return make_loader(
        data,
        batch_size=None if cfg.batch_size is None else cfg.batch_size * backend.batch_scale,
        num_replicas=backend.data_replicas,
        rank=backend.data_rank,
        shuffle=shuffle,
        seed=cfg.seed,
        drop_last=drop_last,
        static_shapes=backend.compiles and data is job.train_data,
        what="train_data" if data is job.train_data else "val_data",
    )


def _total_steps(max_steps: int | None, epochs: int | None, per_epoch: int) -> int | None:
    by_epochs = None if epochs is None else epochs * per_epoch
    if max_steps is None:
        return by_epochs
    return max_steps if by_epochs is None else min(max_steps, by_epochs)


def _validate(model: nn.Module, val: ReplicaLoader, backend: Backend, precision: Precision, loss_fn: Any) -> float:
    """Mean loss per validation sample over every replica's share (batch losses weighted by their
    sizes), in eval mode."""
    model.eval()
    total = torch.zeros((), device=backend.device)
    samples = 0
    with torch.no_grad():
        for batch in backend.batches(val.epoch(0)):
            rows = _rows(batch)
            with precision.autocast(backend.device, cache=backend.autocast_cache):
                loss = compute_loss(model, precision.cast_batch(batch), loss_fn).detach().float()
            total, samples = total + loss * rows, samples + rows
            backend.end_step()  # XLA: each graph compiled once for all replicas (the loader's sync is not gated)
    model.train()
    both = backend.sum_over_replicas(torch.stack([total, torch.tensor(float(samples), device=backend.device)]))
    loss_sum, count = (float(v) for v in devices.to_host([both])[0])
    return loss_sum / max(1.0, count)


def _rows(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (1 when it has none, so an
    unusual batch weighs as one sample rather than failing the validation)."""
    if isinstance(batch, torch.Tensor):
        values: Any = [batch]
    else:
        values = batch.values() if isinstance(batch, Mapping) else batch
    try:
        first = next(v for v in values if isinstance(v, torch.Tensor))
    except (StopIteration, TypeError):
        return 1
    return int(first.shape[0]) if first.dim() else 1


def _digest(model: nn.Module) -> str:
    """SHA-256 of every unique parameter and buffer, by name: equal digests, bit-identical replicas."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    hosts = devices.to_host([t.detach() for _, t in named])
    sha = hashlib.sha256()
    for (name, _), t in sorted(zip(named, hosts, strict=True), key=lambda pair: pair[0][0]):
        sha.update(name.encode())
        sha.update(host_bytes(t).tobytes())
    return sha.hexdigest()
