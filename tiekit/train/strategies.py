"""How one replica talks to its devices and peers, per strategy.

A backend answers the few questions the training loop asks: which device, which slice of the
data, how batches reach the device, how gradients are combined, how a step ends. Everything
torch_xla-specific goes through `tiekit.devices`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tiekit import devices
from tiekit.collective import Ranks, ranks

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
    ``compiles``: steps run as compiled graphs (XLA), so batches keep one shape, and compilations
    and host transfers are watched.
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
    compiles: bool = False

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

    def counters(self) -> devices.XlaCounters | None:
        """The compiler's counters so far (XLA), else None."""
        return None

    def host_transfers(self) -> int:
        """Device-to-host transfers so far (XLA; 0 where they cost nothing to count)."""
        return 0


class TorchBackend(Backend):
    """CPU or CUDA: one process, or one of ``world`` torch.distributed (DDP) processes."""

    def __init__(self, device: torch.device, rank: int = 0, world: int = 1) -> None:
        self.name = "ddp" if world > 1 else "single"
        self.device = device
        self.ranks = ranks() if world > 1 else ALONE  # torch.distributed's, once its group is up
        self.replica_rank = self.data_rank = rank
        self.replica_count = self.data_replicas = self.devices_in_run = world

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.replica_count == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        blocking = self.device.type != "cuda"
        for batch in loader:
            yield _to(batch, self.device, non_blocking=not blocking)

    def sum_over_replicas(self, t: torch.Tensor) -> torch.Tensor:
        if self.replica_count > 1:
            dist.all_reduce(t)
        return t


class XlaBackend(Backend):
    """An XLA device: the process's only one, one ``torch_xla.launch`` replica, or SPMD over all."""

    def __init__(self, *, spmd: bool = False) -> None:
        self.spmd = spmd
        self.run_id = ""
        self._sharding: Any = None
        self._sync: Callable[[], None] | None = None
        if spmd:
            self.name = "spmd"
            self.device, self._mesh, host, hosts = devices.spmd_mesh()
            self.data_rank, self.data_replicas = host, hosts
            self.batch_scale = devices.spmd_local_device_count()
            self.devices_in_run = devices.xla_device_count()
        else:
            self.device = devices.resolve_device("xla") or torch.device("xla")
            replica = devices.xla_replica()
            rank, world = replica if replica is not None else (0, 1)
            self.name = "xla"
            self.replica_rank = self.data_rank = rank
            self.replica_count = self.data_replicas = self.devices_in_run = world
        # Launch replicas, or SPMD hosts (process index 0 writes: every host is replica 0 there).
        self.ranks = ranks() if spmd or self.replica_count > 1 else ALONE
        # autocast's cast cache is process-wide: one launch thread leaving autocast clears the
        # casts another thread is still using, which then traces a different graph from its
        # peers (one more cast), whose all-reduce never meets theirs. So no cache for threads.
        self.autocast_cache = not devices.xla_cpu_threads()
        self.compiles = True

    def start(self, run_id: str) -> None:
        self.run_id = run_id
        self._sync = devices.xla_step_sync(run_id)

    def batches(self, loader: Iterable[Any]) -> Iterable[Any]:
        if self.spmd and self._sharding is None:
            example = next(iter(loader))
            self._sharding = devices.spmd_input_sharding(self._mesh, example, self.data_replicas > 1)
        return devices.xla_loader(loader, self.device, self._sharding)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.spmd or self.replica_count == 1:
            optimizer.step()  # one program sees the whole batch: its gradients are global already
        else:
            devices.xla_optimizer_step(optimizer)  # all-reduce in the step's graph, then step

    def end_step(self) -> None:
        if self._sync is None:
            raise RuntimeError("XlaBackend.start(run_id) must come before the first step")
        self._sync()

    def sum_over_replicas(self, t: torch.Tensor) -> torch.Tensor:
        if not self.spmd and self.replica_count > 1:
            t = devices.xla_all_reduce_sum(t)
        self.end_step()
        return t

    def abort(self, reason: str) -> None:
        if self.run_id:
            devices.xla_abort_step_sync(self.run_id, f"replica {self.replica_rank}: {reason}")

    def seed(self, seed: int) -> None:
        devices.xla_set_rng_state(seed + self.replica_rank)

    def wait(self) -> None:
        devices.xla_wait()

    def counters(self) -> devices.XlaCounters | None:
        return devices.xla_counters()

    def host_transfers(self) -> int:
        return devices.xla_host_transfers()


def _to(value: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, Mapping):
        return {k: _to(v, device, non_blocking) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_to(v, device, non_blocking) for v in value)
    return value
