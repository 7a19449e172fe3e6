"""torch's own devices (CPU, CUDA): one process, or one of several torch.distributed processes
(DDP: every process a whole replica; gloo on CPU, nccl on CUDA)."""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not in its __all__
from torch.distributed.constants import default_pg_timeout

from tiekit.backends.base import ALONE, Backend, batch_to
from tiekit.backends.rendezvous import collective_join_by_environment, collective_store_of_this_launch
from tiekit.collective import ranks
from tiekit.errors import TiekitError
from tiekit.tracebacks import drop_library_locals


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
            yield batch_to(batch, self.device, non_blocking=not blocking)

    def sum_over_replicas(self, t: torch.Tensor) -> torch.Tensor:
        if self.replica_count > 1:
            dist.all_reduce(t)
        return t


def process_device(local_rank: int, local_world: int | None, cuda_count: int) -> tuple[torch.device, str]:
    """(device, process-group backend) of the process ``local_rank`` of ``local_world`` on a host
    with ``cuda_count`` GPUs: ``cuda:<local_rank>`` with nccl when every process of the host has
    its own GPU (``cuda_count >= local_world``; local world unknown: ``local_rank < cuda_count``),
    else the CPU with gloo. Pure: the world size and the other hosts play no part, so 2 hosts
    with 1 GPU each train on their GPUs."""
    has_gpu = cuda_count >= local_world if local_world is not None else local_rank < cuda_count
    if has_gpu and cuda_count > 0:
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def local_ranks(rank: int, world: int, env: Mapping[str, str]) -> tuple[int, int | None]:
    """(local rank, local world size) of a process: torchrun's ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` when set, else (``rank``, ``world``): processes spawned here share this host."""
    if "LOCAL_RANK" in env:
        local_world = env.get("LOCAL_WORLD_SIZE")
        return int(env["LOCAL_RANK"]), None if local_world is None else int(local_world)
    return rank, world


def launched_rank(env: Mapping[str, str]) -> tuple[int, int] | None:
    """Local: (rank, world size) of this process when something else started the run's
    processes: the process group your script made (``init_process_group`` with several ranks),
    else torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``, or a launcher's ``RANK``,
    ``WORLD_SIZE`` and ``MASTER_ADDR`` (``env://``'s); None when nothing did, and `fit` starts
    the processes. `TiekitError` for a rank outside the world size."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    # torchrun sets LOCAL_RANK; a launcher of its own sets where rank 0 listens (env://).
    if "RANK" in env and "WORLD_SIZE" in env and ("LOCAL_RANK" in env or "MASTER_ADDR" in env):
        shown = f"RANK={env['RANK']!r} and WORLD_SIZE={env['WORLD_SIZE']!r} in the environment"
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        except ValueError as exc:
            raise TiekitError(f"{shown} must be numbers") from exc
        if not 0 <= rank < world:
            raise TiekitError(f"{shown}: the rank must be at least 0 and less than the world size")
        return rank, world
    return None


def join_process_group(rank: int, world: int, port: int | None) -> torch.device:
    """Collective: this process's device, after joining the run's process group (under torchrun:
    its store, see `collective_store_of_this_launch`; spawned by fit: the caller's
    `rendezvous_store` on ``port``; else `collective_join_by_environment`, bounded and saying what
    it waits for) unless one is up already; waits for every process. A process spawned here
    (``port`` given) without ``OMP_NUM_THREADS`` uses its share of the host's cores for torch's
    threads."""
    # A process fit spawned (``port``) is rank ``rank`` of this host whatever LOCAL_RANK it
    # inherited from the caller's environment (both replicas would take that GPU and core share);
    # its environment says so as torchrun's would, for code of yours that reads it.
    local_rank, local_world = local_ranks(rank, world, os.environ if port is None else {})
    if port is not None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device, group_backend = process_device(local_rank, local_world, cuda_count)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif port is not None and "OMP_NUM_THREADS" not in os.environ:
        # Processes fit spawned share this host's cores: each takes its share, not all of them.
        # Under torchrun the threads stay as torchrun (OMP_NUM_THREADS) or the script set them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (local_world or 1)))
    if dist.is_initialized():
        return device
    if port is not None:  # the caller's `rendezvous_store`
        caller = TCPStore("127.0.0.1", port, is_master=False, timeout=default_pg_timeout)
        dist.init_process_group(group_backend, store=caller, rank=rank, world_size=world)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store, witness = collective_store_of_this_launch(rank, default_pg_timeout)
        dist.init_process_group(group_backend, store=store, rank=rank, world_size=world)
        dist.barrier()  # nccl joins lazily: past this, every rank has read the witness
        del witness
    else:
        store = collective_join_by_environment(rank, world, os.environ)
        dist.init_process_group(group_backend, store=store, rank=rank, world_size=world)
    return device


def collective_close_process_group(failure: BaseException | None = None) -> None:
    """Collective: close the process group fit made (under torchrun, or in the processes it spawned;
    a group you made stays yours). ``failure``: the exception fit is raising, if any.

    Left open, torch 2.14's processes abort at exit ("terminate called without an active
    exception"), and so do they when one closes the group while a peer still uses its store: the
    ranks first meet (for at most 10 s on every rank: a rank that died, or that waits in a
    collective the failing rank will never join, is the launcher's to stop). Closing is
    not enough while something still holds the group: its gloo threads live on, and one that
    releases a collective's tensors during interpreter exit needs the GIL and aborts the process.
    A failure's traceback holds the wrapped model (DDP keeps its group), so the locals of
    tiekit's and torch's frames in it are dropped first (yours keep theirs, for post-mortem
    debugging): the group then goes, its threads joined, here."""
    closing = f"tiekit/closing/{next(_closings)}"
    if failure is not None:
        drop_library_locals(failure)
        _note_first_failure(f"{closing}/first-failure", failure)
    _collective_meet(f"{closing}/ranks", timeout=10.0)
    clear_dtensor_caches()
    dist.destroy_process_group()


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (an FSDP2 parameter: each rank holds its shard). Local;
    never imports torch.distributed.tensor (no DTensor exists before it is imported)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # torch < 2.5: elsewhere
    return dtensor is not None and isinstance(tensor, dtensor)


def shard_like(like: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """Local: a DTensor laid out as the DTensor ``like`` (its mesh and placements) holding
    ``whole``, the full tensor (the same on every rank), in ``whole``'s dtype: each rank keeps
    its own shard of it, as torch's ``distribute_tensor`` cuts it (uneven and empty shards too),
    with no collective (``src_data_rank=None``: every rank uses its own copy)."""
    from torch.distributed.tensor import distribute_tensor

    mesh, placements = like.device_mesh, like.placements  # type: ignore[attr-defined]
    with torch.no_grad():
        try:
            return distribute_tensor(whole.detach(), mesh, placements, src_data_rank=None)
        except TypeError:  # torch < 2.6 has no src_data_rank: a replicated value split locally
            from torch.distributed.tensor.experimental import implicit_replication

            out = torch.empty_like(like, dtype=whole.dtype, requires_grad=False)
            with implicit_replication():
                out.copy_(whole.to(out.device))
            return out


def copy_whole_into_dtensor(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Local: copy ``whole``, the full tensor (the same on every rank), into the DTensor
    ``target``, each rank keeping its own shard of it (`shard_like`; checked: one rank alone
    copies while the other does not)."""
    copy_rows_into_dtensor(target, shard_like(target, whole).to_local())  # type: ignore[attr-defined]


def dtensor_local_rows(tensor: torch.Tensor) -> tuple[int, int] | None:
    """Local: for a DTensor whose shard on this rank is whole rows of the full tensor (FSDP2's
    ``Shard(0)``, replicated over other mesh dimensions as in HSDP), ``(first row, row count)``;
    None for any other layout (another dimension, a strided or custom shard)."""
    from torch.distributed.tensor import Replicate, Shard

    placements = tensor.placements  # type: ignore[attr-defined]
    if not all(type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in placements):
        return None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # private: where a torch moves it, the whole tensor is read instead
        return None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, placements)  # type: ignore[attr-defined]
    local = tensor.to_local()  # type: ignore[attr-defined]
    if tuple(local.shape) != tuple(shape) or tuple(shape[1:]) != tuple(tensor.shape[1:]) or any(offset[1:]):
        return None
    return int(offset[0]), int(shape[0])


def copy_rows_into_dtensor(target: torch.Tensor, rows: torch.Tensor) -> None:
    """Local: copy ``rows``, this rank's shard (as `dtensor_local_rows` or `shard_like` cut it), into
    the DTensor ``target``."""
    with torch.no_grad():
        target.to_local().copy_(rows)  # type: ignore[attr-defined]


def dtensor_from_rows(like: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Local: a DTensor laid out as the DTensor ``like`` whose shard on this rank is ``rows`` (as
    `dtensor_local_rows` names them), no copy, no collective."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        rows,
        like.device_mesh,  # type: ignore[attr-defined]
        like.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def clear_dtensor_caches() -> None:
    """Local: empty torch's process-wide DTensor caches (sharding propagation, redistribution
    plans and transforms, mesh topology); later DTensor work refills them.

    On torch 2.14 they keep every device mesh FSDP2 used, and through it its process groups,
    alive after ``destroy_process_group()`` until the process ends, where gloo's threads can abort
    it ("terminate called without an active exception"; a launcher then reports a run that
    finished as failed). Call it after the last sharded step, before destroying the group.
    Each cache is cleared only where this torch has it (2.9 has two of the four)."""
    try:
        from torch.distributed.tensor import _collective_utils, _redistribute, debug
    except ImportError:  # torch before 2.5 keeps them in torch.distributed._tensor: not cleared (untested)
        return
    clears = [
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
        getattr(_collective_utils.MeshTopoInfo.build_from_mesh, "cache_clear", None),
        getattr(debug, "_clear_sharding_prop_cache", None),  # the Python and the C++ fast-path caches
    ]
    for clear in clears:
        if clear is not None:
            clear()


_closings = itertools.count()  # every rank closes the same groups in the same order: keys agree


def _note_first_failure(key: str, failure: BaseException) -> None:
    """Local: record this rank's failure at ``key`` of the group's store unless another rank's is
    there; if one is, add a note naming it to ``failure``. When one rank fails, the others fail
    after it with the process group's own errors ("Connection closed by peer" in the gradient
    all-reduce), which say nothing of the cause, and torchrun may name any of them as the root
    cause (the ranks exit together)."""
    mine = f"rank {dist.get_rank()}: {type(failure).__name__}: {failure}"[:1000]
    with contextlib.suppress(RuntimeError, OSError, NotImplementedError):  # the store's host is gone
        first = dist.distributed_c10d._get_default_store().compare_set(key, "", mine).decode(errors="replace")
        if first != mine:
            who, what = first.split(": ", 1)
            failure.add_note(f"tiekit: {who} failed before this rank (this failure may follow from it): {what}")


def _collective_meet(key: str, timeout: float) -> None:
    """Collective, bounded: every rank of the default group counts itself in at ``key`` of the
    group's store and waits until all have, or ``timeout`` seconds. gloo's ``monitored_barrier``
    bounds only rank 0's wait: a failing rank other than 0 waited in it for the group's timeout
    (30 minutes) while rank 0 waited in the gradient all-reduce that rank would never join, so
    torchrun, which stops the job when a rank exits, never saw the failure."""
    store = dist.distributed_c10d._get_default_store()
    world = dist.get_world_size()
    deadline = time.monotonic() + timeout
    with contextlib.suppress(RuntimeError, OSError):  # the store's host (a spawned rank 0) has gone
        arrived = store.add(key, 1)
        while arrived < world and time.monotonic() < deadline:
            time.sleep(0.01)
            arrived = store.add(key, 0)
