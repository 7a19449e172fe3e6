"""The questions a training run asks its runtime, and their answers for one process on one device."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tiekit.collective import Ranks
from tiekit.moving import move
from tiekit.plan import TiePlan

if TYPE_CHECKING:
    from tiekit.backends.xla import XlaCounters

#: The ranks of a run of one process and one device: it decides alone and waits for nobody.
ALONE = Ranks(0, 1, "single")


class Backend:
    """One replica's view of the run.

    ``ranks`` are the `tiekit.collective.Ranks` that train together (`ALONE` for one process on
    one device): fit's run-wide decisions are collectives over them, and their writer (rank 0,
    under SPMD process index 0) writes the run's files. ``data_rank``/``data_replicas`` place
    this replica's sampler; ``batch_scale`` multiplies the per-device batch size into the
    loader's (SPMD: the host's devices share one loader); ``devices_in_run`` counts every
    device, for throughput. ``autocast_cache``: whether autocast may cache its casts here.
    ``half_dtype``: the 16-bit floating point the device computes (``precision="16-true"``).
    ``compiles``: steps run as compiled graphs (XLA), so batches keep one shape, and compilations
    and host transfers are watched.

    The training loop asks only these questions, so a runtime is one module: `torch_distributed`
    (one process or DDP), `fsdp` (FSDP2 over processes), `xla_replicas` (``torch_xla.launch``)
    and `xla_spmd` (SPMD, replicated or FSDP-style sharded parameters).
    """

    name: str
    device: torch.device
    ranks: Ranks = ALONE
    replica_rank: int = 0
    replica_count: int = 1
    data_rank: int = 0
    data_replicas: int = 1
    batch_scale: int = 1
    devices_in_run: int = 1
    autocast_cache: bool = True
    half_dtype: torch.dtype = torch.float16
    compiles: bool = False
    #: A module passed to fit is copied for this replica (it would otherwise share it with others).
    copies_model: bool = False
    #: Checkpoints are `tiekit.save_sharded` folders every rank writes its part of (the parameters
    #: are sharded), not one file from the run's writer.
    sharded_checkpoints: bool = False
    #: `unplace` needs no other process (not so under SPMD over several hosts, which gather the
    #: sharded tensors together): a failed run puts the module passed to fit back where it was.
    unplaces_alone: bool = True

    @property
    def is_master(self) -> bool:
        """True on the one replica that writes the run's files, logs and progress bar."""
        return self.ranks.is_writer

    def start(self, run_id: str) -> None:
        """Join run ``run_id`` (the id every rank agreed on) before the first step."""

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the step calls (a DDP wrapper, or ``model`` itself)."""
        return model

    def batches(self, loader: Iterable[Any]) -> Iterable[Any]:
        """The loader's batches, on this replica's device."""
        raise NotImplementedError

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def end_step(self) -> None:
        """Finish the step (XLA: compile once, then launch the step's graph)."""

    def sum_over_replicas(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the data-parallel replicas (identity with one)."""
        return t

    def abort(self, reason: str) -> None:
        """This replica failed (``reason``): release peers that would otherwise wait for it forever."""

    def seed(self, seed: int) -> None:
        """Seed the device's own random number generator, where it has one (XLA)."""

    def wait(self) -> None:
        """Block until the device has run everything queued for it."""

    def place(self, model: nn.Module, dtype: torch.dtype | None, plan: TiePlan) -> None:
        """Put ``model`` on this replica's device(s), ties kept, before its optimizer is built:
        a move of the whole model here; sharded strategies shard it too."""
        move(model, self.device, dtype=dtype, plan=plan)

    def unplace(
        self, model: nn.Module, dtype: torch.dtype | None, plan: TiePlan, rebuild: Callable[[], nn.Module]
    ) -> nn.Module:
        """The trained model as a plain module on the CPU, ties kept (``dtype``: cast back to it).
        Collective under the sharded strategies, which gather the shards into ``rebuild()``."""
        move(model, "cpu", dtype=dtype, plan=plan)
        return model

    def counters(self) -> XlaCounters | None:
        """The compiler's counters so far (XLA), else None."""
        return None

    def transfer_mark(self) -> Any:
        """Where to count this replica's device-to-host transfers from (see `transfers_since`)."""
        return None

    def transfers_since(self, mark: Any) -> int:
        """Device-to-host transfers this replica made since ``mark`` (XLA; 0 where they cost
        nothing to count, or where another replica's may be among them)."""
        return 0

    def between_steps(self) -> AbstractContextManager[None]:
        """Around this replica's work between its steps that may fetch from the device (a loss
        check, a save, validation): where replicas share a process, another replica's step does
        not count them as its own (XLA:CPU launch threads)."""
        return nullcontext()

    def steps_done(self) -> None:
        """This replica takes no more steps in this run; what it does next may fetch from the
        device (as `between_steps`)."""


def batch_to(value: Any, device: torch.device, non_blocking: bool) -> Any:
    """``value`` (a tensor, or a dict/list/tuple of them and other values) with its tensors on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, Mapping):
        return {k: batch_to(v, device, non_blocking) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(batch_to(v, device, non_blocking) for v in value)
    return value
