"""torch's own devices (CPU, CUDA): one process, or one of several torch.distributed processes
(DDP: every process a whole replica; gloo on CPU, nccl on CUDA)."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]  # not in its __all__
from torch.distributed.constants import default_pg_timeout

from tiekit.backends.base import ALONE, Backend, batch_to
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


JOIN_TIMEOUT = "TIEKIT_JOIN_TIMEOUT"  # seconds processes started without a launcher wait for each other
_FIRST_NOTICE = 30.0  # seconds before a waiting rank says what it waits for (at most half the bound)
_NOTICE_EVERY = 60.0  # and then how often it says it again
_ARRIVALS = "tiekit/env-join/arrivals"


def join_timeout(env: Mapping[str, str]) -> float:
    """Local: seconds the processes of a run started without a launcher wait for each other to
    join (`collective_join_by_environment`): ``TIEKIT_JOIN_TIMEOUT`` when set, else torch's
    default process-group timeout (30 minutes)."""
    text = env.get(JOIN_TIMEOUT)
    if text is None:
        return default_pg_timeout.total_seconds()
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise TiekitError(f"{JOIN_TIMEOUT}={text!r} in the environment must be a positive number of seconds")
    return seconds


def collective_join_by_environment(rank: int, world: int, env: Mapping[str, str]) -> Store:
    """Collective: the store of a run whose processes were started without a launcher (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set by hand, as torch's ``env://`` reads
    them), once every rank has arrived in it: rank 0 hosts it at ``MASTER_PORT``, the others
    connect to ``MASTER_ADDR:MASTER_PORT``. Waits for every rank for at most `join_timeout`
    seconds, saying on stderr (after 30 s, then every minute) which ranks it waits for; then
    `TiekitError`. torch's ``env://`` waited silently for 30 minutes, so variables left over in
    a shell from another run made a lone process hang with nothing said.

    `TiekitError` when ``MASTER_ADDR`` or ``MASTER_PORT`` is missing or not an address, or when
    rank 0 cannot listen on ``MASTER_PORT``."""
    seen = ", ".join(f"{name}={env[name]}" for name in _LAUNCH_VARIABLES if name in env)
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]
    if missing:
        raise TiekitError(
            f"{seen} in the environment, without {' or '.join(missing)}: processes started without a launcher "
            "(no torchrun) meet at MASTER_ADDR:MASTER_PORT, so set both on every process; or, if no launcher "
            "started this one, these are leftovers from another run: unset them"
        )
    host = env["MASTER_ADDR"]
    try:
        port = int(env["MASTER_PORT"])
    except ValueError:
        port = -1
    if not 0 < port < 2**16:
        raise TiekitError(f"MASTER_PORT={env['MASTER_PORT']!r} in the environment must be a port number (1 to 65535)")
    bound = join_timeout(env)
    waiting = _JoinWait(rank, world, f"{host}:{port}", seen, bound)
    if rank == 0:
        try:
            # Hosted as torch's env:// hosts it (multi-tenant), but not waiting for the workers
            # to connect inside the constructor, where nothing could say what it waits for.
            store = TCPStore(
                host, port, is_master=True, wait_for_workers=False, multi_tenant=True, timeout=timedelta(seconds=bound)
            )
        except RuntimeError as exc:
            raise TiekitError(
                f"rank 0 of {world} cannot listen on MASTER_PORT={port} ({seen} in the environment): {exc}. "
                "Another process uses the port (another run's rank 0?): choose another MASTER_PORT"
            ) from exc
    else:
        store = waiting.connect(host, port)
    try:
        # Arrivals count up across joins in one store (a store kept alive in this process
        # since an earlier fit): this join's generation is the world-sized block this rank fell in.
        generation = (store.add(_ARRIVALS, 1) - 1) // world
        store.set(f"{_ARRIVALS}/{generation}/{rank}", "")
        while store.add(_ARRIVALS, 0) < (generation + 1) * world:
            waiting.tick(
                lambda: _name_ranks([r for r in range(world) if not store.check([f"{_ARRIVALS}/{generation}/{r}"])])
            )
            time.sleep(0.1)
    except RuntimeError as exc:  # rank 0, hosting the store, has gone
        raise TiekitError(f"{waiting.who}: the store at {host}:{port} failed while the ranks met: {exc}") from exc
    # The group's waits in it (gloo's, tiekit's collectives') are bounded as env://'s, not by what was left of the join.
    store.set_timeout(default_pg_timeout)
    return store


_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class _JoinWait:
    """The clock of one rank waiting for the others in `collective_join_by_environment`: what it
    says on stderr while it waits, and the `TiekitError` once the bound is past."""

    def __init__(self, rank: int, world: int, where: str, seen: str, bound: float) -> None:
        self.who = f"rank {rank} of {world}"
        self.where, self.seen, self.bound = where, seen, bound
        self.start = time.monotonic()
        self.next_notice = self.start + min(_FIRST_NOTICE, bound / 2)

    def remaining(self) -> float:
        return self.start + self.bound - time.monotonic()

    def describe(self, missing: str, waited: str) -> str:
        return (
            f"{self.who} {waited} at {self.where} for {missing} to join. "
            f"{self.seen} came from the environment, set by hand or by a launcher other than torchrun: start "
            "the other processes with the same MASTER_ADDR and MASTER_PORT, or, if none is coming, these are leftovers "
            f"from another run: unset them. Bound: {self.bound:g} s ({JOIN_TIMEOUT} in the environment sets it)"
        )

    def tick(self, missing: Callable[[], str]) -> None:
        """Say what this rank waits for when it is time to (``missing`` names the ranks still
        absent); `TiekitError` once the bound is past."""
        now = time.monotonic()
        if now - self.start >= self.bound:
            raise TiekitError(self.describe(missing(), f"gave up after waiting {now - self.start:.0f} s"))
        if now >= self.next_notice:
            print(
                f"tiekit: {self.describe(missing(), f'has waited {now - self.start:.0f} s')}",
                file=sys.stderr,
                flush=True,
            )
            self.next_notice = now + _NOTICE_EVERY

    def connect(self, host: str, port: int) -> TCPStore:
        """A client of rank 0's store, once rank 0 listens at ``host:port``."""
        while True:
            try:
                # TCPStore would retry a refused connection itself, silently or logging every attempt.
                socket.create_connection((host, port), timeout=min(2.0, max(0.1, self.remaining()))).close()
                break
            except OSError:
                self.tick(lambda: "rank 0 (nothing listens there yet)")
                time.sleep(0.2)
        try:
            return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=max(1.0, self.remaining())))
        except RuntimeError as exc:
            raise TiekitError(
                f"{self.who}: what listens at {self.where} (MASTER_ADDR:MASTER_PORT) is not rank 0's store: {exc}"
            ) from exc


def _name_ranks(ranks: list[int]) -> str:
    """How a message names ``ranks``: rank 1; ranks 1, 2 and 5; ranks 1, 2, 3, 4, 5, 6, ... (100 ranks)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 8:
        return f"ranks {', '.join(map(str, ranks[:6]))}, ... ({len(ranks)} ranks)"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


LAUNCH_KEY = "tiekit/launch"  # in torchrun's store: "<witness port> <nonce>" of the latest launch's rank 0


def collective_store_of_this_launch(rank: int, timeout: timedelta) -> tuple[Store, TCPStore | None]:
    """Collective (waits for rank 0): torchrun's store, under a prefix no earlier launch of these
    workers used, and on rank 0 the witness store to keep until every rank has joined the group.

    torchrun keeps its store through the restarts of ``--max-restarts``, and torch's ``env://``
    (2.9 to 2.14 at least) joins the default group in it without a prefix per restart, so a
    restarted rank could read the gloo address a rank of the failed launch published, its process
    gone, and fail ("Connection refused") or leave the others waiting. ``TORCHELASTIC_RESTART_COUNT``
    is not the same on every node (pytorch issue 108158), so the prefix is a nonce rank 0 draws;
    a rank tells this launch's nonce from one an earlier launch left by reading it back from a
    store rank 0 hosts meanwhile (the witness): the rank 0 of an earlier launch is dead.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = TCPStore(host, port, is_master=False, timeout=timeout)
    if rank == 0:
        nonce = uuid.uuid4().hex
        witness = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        witness.set("nonce", nonce)
        agent.set(LAUNCH_KEY, f"{witness.port} {nonce}")
        return PrefixStore(f"tiekit/{nonce}", agent), witness
    deadline = time.monotonic() + timeout.total_seconds()
    published = ""
    while time.monotonic() < deadline:
        published = agent.get(LAUNCH_KEY).decode()  # waits for the first launch's rank 0
        witness_port, nonce = published.split()
        if _witness_confirms(host, int(witness_port), nonce):
            return PrefixStore(f"tiekit/{nonce}", agent), None
        time.sleep(0.05)  # an earlier launch's announcement: wait for this launch's rank 0
    raise TiekitError(
        f"rank {rank}: rank 0 of this launch did not announce itself in torchrun's store at {host}:{port} "
        f"within {timeout.total_seconds():g} s (the last announcement there, {published!r}, is not confirmed "
        "by a live rank 0: an earlier launch's)"
    )


def _witness_confirms(host: str, port: int, nonce: str) -> bool:
    try:
        # A dead rank 0's port refuses at once; TCPStore would retry it, logging every attempt.
        socket.create_connection((host, port), timeout=2).close()
        witness = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=2))
        return bool(witness.get("nonce").decode() == nonce)
    except (OSError, RuntimeError):  # refused (its process is gone), or not a store holding a nonce
        return False


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


def rendezvous_store() -> TCPStore:
    """A store on 127.0.0.1 for the processes `fit` spawns to meet in, on a port the system chose
    and this process holds: keep it until they are done (they connect to ``store.port``). A
    port found free and handed to rank 0 to listen on could be taken meanwhile (by another run
    spawning its processes: seen in CI, "EADDRINUSE"). Local."""
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=default_pg_timeout)
