"""`tiekit.fit`: train a model on every core with the right sampler, keeping its ties."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from tiekit.backends.torch_distributed import launched_rank
from tiekit.backends.xla import spmd_hosts
from tiekit.errors import TiekitError
from tiekit.train.config import DEFAULT_OPTIMIZER, FitConfig, Job, LossFn, OptimizerFactory
from tiekit.train.launch import refuse_a_replica_importing_main, resolve_strategy, run


@dataclass(frozen=True)
class FitResult:
    """What `fit` did.

    ``model`` is the trained model on the CPU in its original dtype, ties kept (the module you
    passed, trained in place or loaded with the master's weights, with new Parameter objects
    after a run on an XLA device in this process; or a fresh one from your factory). ``losses``
    are the master replica's per-step training losses, ``val_losses`` the validation loss after
    each epoch (over every replica's share). ``replica_digests`` hold a
    SHA-256 of each replica's final weights (rank order): equal digests, bit-identical replicas.
    ``ties_kept`` says every replica still had its ties on the device after training.
    ``checkpoint`` is the checkpoint holding ``model`` (written at the last step; None without
    ``checkpoint_dir``, also after a resume from a checkpoint given by path).
    ``compilations`` and ``xla_report`` come from ``torch_xla.debug.metrics`` (XLA only).
    """

    model: nn.Module
    strategy: str
    world_size: int
    device_type: str
    precision: str
    steps: int
    epochs: int
    losses: tuple[float, ...]
    val_losses: tuple[float, ...]
    samples_per_second: float
    seconds: float
    checkpoint: Path | None
    replica_digests: tuple[str, ...]
    ties_kept: bool
    compilations: int | None
    xla_report: str | None

    @property
    def replicas_identical(self) -> bool:
        """True when every replica ended with bit-identical weights."""
        return len(set(self.replica_digests)) == 1


def fit(
    model: nn.Module | Callable[[], nn.Module],
    train_data: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerFactory = DEFAULT_OPTIMIZER,
    epochs: int | None = None,
    max_steps: int | None = None,
    batch_size: int | None = None,
    devices: int | str = "auto",
    strategy: str = "auto",
    precision: str = "32-true",
    val_data: Any = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int | None = None,
    checkpoint_async: bool = True,
    checkpoint_keep: int | None = None,
    resume: str | Path | None = None,
    seed: int = 0,
    drop_last: bool | None = None,
    shuffle: bool = True,
    progress: bool = True,
    log_dir: str | Path | None = None,
    log_every: int = 10,
) -> FitResult:
    """Train ``model`` on ``train_data`` on every core of the chosen strategy, keeping its ties.

    Collective where this process is one rank of a run it did not start: under torchrun, in a
    process group of yours (or ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set), as each of your own
    ``torch_xla.launch`` replicas, or on each SPMD host. There every process calls ``fit`` with
    the same options (checked: a difference is a `TiekitError`), and it waits for the others
    throughout: to agree on the options, model and data, at every step, save and validation,
    and at the end. Otherwise ``fit`` starts the replicas itself (or trains here) and waits for
    nobody else.

    ``model``: a module, or a zero-argument factory (spawned replicas build their own copy from
    ``seed``). ``train_data``/``val_data``: a map-style dataset or a DataLoader; a
    ``DistributedSampler`` is inserted for you (a DataLoader's own DistributedSampler is kept).
    Like ``DistributedSampler``, it repeats up to ``replicas - 1`` samples when the dataset
    does not split evenly between the replicas.
    ``loss_fn(output, target)`` for ``(inputs..., target)`` batches; None: the model returns the
    loss. ``optimizer``: a factory taking the parameters. ``epochs`` (default 1, unlimited with
    ``max_steps``) and ``max_steps`` bound the run. ``batch_size``: per device (default: the
    DataLoader's, else 32). ``devices``: "auto", a number of devices/processes, or one device
    ("cpu", "cuda:1", "xla"). ``strategy``: "auto", "xla", "spmd", "spmd_fsdp", "ddp", "fsdp" or "single" (see
    docs/training.md). ``precision``: "32-true", "bf16-true", "bf16-mixed" or "16-true" (bf16 on
    XLA). ``checkpoint_dir``/``checkpoint_every``: tied checkpoints every N steps and at the end
    (sharded strategies: `tiekit.save_sharded` folders), written in the background while
    training goes on unless ``checkpoint_async=False``; fit returns once the last is complete.
    ``checkpoint_keep``: keep only the N newest checkpoints this run wrote, deleting an older one
    once a newer one is complete (default: keep all); with ``resume="last"`` the checkpoints
    already in ``checkpoint_dir`` count as the run's (restarts keep N in the folder). A NaN or
    infinite loss on any rank stops the run at its next save, writing nothing (`TiekitError`).
    ``resume``: a checkpoint path or "last". ``drop_last``: drop each replica's short last batch
    of an epoch (else it is trained, padded on XLA by repeating the epoch's first samples so every
    step has one shape); default: the DataLoader's, else True. ``progress``: tqdm bar on the master;
    ``log_dir``: ``metrics.csv`` (and TensorBoard logs when installed).
    """
    config = FitConfig(
        loss_fn=loss_fn,
        optimizer=optimizer,
        epochs=epochs,
        max_steps=max_steps,
        batch_size=batch_size,
        devices=devices,
        strategy=strategy,
        precision=precision,
        checkpoint_dir=_path("checkpoint_dir", checkpoint_dir),
        checkpoint_every=checkpoint_every,
        checkpoint_async=checkpoint_async,
        checkpoint_keep=checkpoint_keep,
        resume="last" if resume == "last" else _path("resume", resume),
        seed=seed,
        drop_last=drop_last,
        shuffle=shuffle,
        progress=progress,
        log_dir=_path("log_dir", log_dir),
        log_every=log_every,
    )
    refuse_a_replica_importing_main()
    # A rank of several (torchrun, a launcher, SPMD hosts) checks its folders once it has joined
    # the others, who are told of its refusal there: raised here, it would leave them waiting.
    config.check(folders=launched_rank(os.environ) is None and spmd_hosts() is None)
    if not isinstance(model, nn.Module) and not callable(model):
        raise TiekitError(f"model must be an nn.Module or a zero-argument factory, not {type(model).__name__}")
    job = Job(
        model=model,
        train_data=train_data,
        val_data=val_data,
        config=config,
        strategy=resolve_strategy(strategy, devices),
        run_id=uuid.uuid4().hex,  # a proposal: the ranks of a run take rank 0's (tiekit.train.coordinate)
    )
    outcomes, trained = run(job)
    master = outcomes[0]
    if progress and master.xla_report:
        print(master.xla_report)
    return FitResult(
        model=trained,
        strategy=job.strategy,
        world_size=master.world_size,
        device_type=master.device_type,
        precision=master.precision,
        steps=master.steps,
        epochs=master.epochs,
        losses=master.losses,
        val_losses=master.val_losses,
        samples_per_second=master.samples_per_second,
        seconds=master.seconds,
        checkpoint=None if master.checkpoint is None else Path(master.checkpoint),
        replica_digests=tuple(o.digest for o in outcomes),
        ties_kept=all(o.ties_kept for o in outcomes),
        compilations=master.compilations,
        xla_report=master.xla_report,
    )


def _path(name: str, value: Any) -> Path | None:
    """The path option ``name`` as a `Path` (None stays None); `TiekitError` for anything else."""
    if value is None:
        return None
    try:
        return Path(value)
    except TypeError:
        raise TiekitError(f"{name} must be a path (a str or os.PathLike), not {value!r}") from None
