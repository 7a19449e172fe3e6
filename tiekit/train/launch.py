"""Starting the replicas of a run, per strategy, and collecting what they report.

* ``"single"``: this process, one device (XLA if configured, else CUDA, else CPU).
* ``"xla"``: one replica per XLA device through ``torch_xla.launch`` (on one host: one process,
  one thread per device). Already inside a replica (your own ``torch_xla.launch``), or with
  one device, it runs right here.
* ``"spmd"``: this process drives every device; the batch is sharded on a ``"data"`` mesh axis.
* ``"spmd_fsdp"``: as ``"spmd"``, with every parameter sharded too, on an ``"fsdp"`` mesh axis.
* ``"ddp"``: ``torch.distributed`` (gloo on CPU, nccl on CUDA), one process per device,
  spawned here, or this process when ``torchrun`` started it.
* ``"fsdp"``: as ``"ddp"``, with the model sharded by FSDP2 (`tiekit.shard`'s units).

The runtimes themselves live in `tiekit.backends`; this module only starts them.

Spawned replicas report through files in a private folder (`tiekit.train.reports`) and relay
the warnings they gave (`tiekit.train.relayed_warnings`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import tempfile
import warnings
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tiekit import devices
from tiekit.backends import xla as xla_runtime
from tiekit.backends.base import Backend
from tiekit.backends.fsdp import FsdpBackend
from tiekit.backends.rendezvous import rendezvous_store
from tiekit.backends.torch_distributed import (
    TorchBackend,
    clear_dtensor_caches,
    collective_close_process_group,
    join_process_group,
    launched_rank,
)
from tiekit.backends.xla_replicas import XlaReplicaBackend, xla_launch
from tiekit.backends.xla_spmd import SpmdBackend
from tiekit.collective import collective_gather
from tiekit.errors import TiekitError
from tiekit.tracebacks import drop_library_locals
from tiekit.train import coordinate, relayed_warnings, reports
from tiekit.train.config import Job, Outcome
from tiekit.train.loop import run_replica


def resolve_strategy(strategy: str, requested: int | str) -> str:
    """The concrete strategy for ``"auto"``: XLA when configured, DDP on several GPUs, else single."""
    if strategy != "auto":
        return strategy
    if isinstance(requested, str) and requested != "auto":
        return "single"  # one named device
    if devices.xla_wanted():
        return "xla"
    if launched_rank(os.environ) is not None or (torch.cuda.is_available() and torch.cuda.device_count() > 1):
        return "ddp"
    return "single"


def run(job: Job) -> tuple[list[Outcome], nn.Module]:
    """Run ``job`` on its strategy; every replica's `Outcome` (rank order) and the trained model."""
    requested = job.config.devices
    if job.strategy == "single":
        return _here(job, _single_backend(requested))
    if job.strategy in ("spmd", "spmd_fsdp"):
        return _here(job, _spmd_backend(job.strategy, requested))
    if job.strategy == "xla":
        return _xla(job, requested)
    if job.strategy in ("ddp", "fsdp"):
        return _processes(job, requested)
    raise TiekitError(f"unknown strategy {job.strategy!r}")


def _here(job: Job, backend: Backend) -> tuple[list[Outcome], nn.Module]:
    """This process's replica, trained here, and every replica's outcome in rank order: with
    several processes (torchrun, your own ``torch_xla.launch``, SPMD hosts), collective (each
    sends its outcome once trained), so that every rank's result holds every replica's digest
    and rank 0's losses (only rank 0 logs them)."""
    try:
        outcome, model = run_replica(job, backend)
        if backend.ranks.world == 1:
            return [outcome], model
        return collective_gather(outcome), model
    finally:
        coordinate.end(backend)  # launch threads: what follows in your launch is after this fit


def _single_backend(requested: int | str) -> Backend:
    if isinstance(requested, int) and requested != 1:
        raise TiekitError(f'strategy="single" trains on one device; devices={requested} asks for more')
    if isinstance(requested, str) and requested != "auto":
        device = torch.device(requested)
    elif devices.xla_wanted():
        device = torch.device("xla")
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if devices.is_xla(device):
        if xla_runtime.xla_replica() is not None:
            raise TiekitError('strategy="single" inside a torch_xla.launch replica: use strategy="xla"')
        return XlaReplicaBackend()
    return TorchBackend(device)


def _spmd_backend(strategy: str, requested: int | str) -> Backend:
    """SPMD over every XLA device of the run; ``requested`` must be "auto" or their number."""
    if isinstance(requested, str) and requested != "auto":
        raise TiekitError(
            f'strategy="{strategy}" runs on every XLA device: devices="auto" or their number, not {requested!r}'
        )
    backend = SpmdBackend(shard_parameters=strategy == "spmd_fsdp")
    count = backend.devices_in_run
    if isinstance(requested, int) and requested != count:
        raise TiekitError(
            f'strategy="{strategy}" shards over every XLA device of the run, and there are {count}, not '
            f'devices={requested}: pass devices="auto" or {count}, or set the device count (CPU_NUM_DEVICES on '
            "XLA:CPU) before the XLA runtime starts"
        )
    return backend


# -- "xla" ----------------------------------------------------------------------------------------


def _xla(job: Job, requested: int | str) -> tuple[list[Outcome], nn.Module]:
    if isinstance(requested, str) and requested != "auto":
        raise TiekitError(f'strategy="xla" takes devices="auto" or a number of devices, not {requested!r}')
    count = requested if isinstance(requested, int) else None
    if xla_runtime.xla_replica() is not None:  # inside the user's own torch_xla.launch
        return _here(job, XlaReplicaBackend())
    if xla_runtime.xla_runtime_started():
        available = xla_runtime.xla_device_count()
        if count == 1 or available == 1:
            return _here(job, XlaReplicaBackend())
        raise TiekitError(
            f"torch_xla's runtime already runs in this process ({available} devices), so torch_xla.launch "
            "cannot start one replica per device any more. Call tiekit.fit before using any XLA device, "
            "call it inside your own torch_xla.launch function, or pass devices=1."
        )
    if (count or xla_runtime.xla_device_count_hint()) == 1:
        return _here(job, XlaReplicaBackend())
    with tempfile.TemporaryDirectory(prefix="tiekit-fit-") as folder:
        spawned = dataclasses.replace(job, result_dir=Path(folder))
        try:
            with _picklable(job.strategy):
                xla_launch(_xla_entry, (spawned,), count)
        except BrokenProcessPool as exc:  # the process ended: nothing of it reports how
            with contextlib.suppress(Warning):
                relayed_warnings.relay(Path(folder))
            raise TiekitError(
                f"the process running the {count or 'XLA'} replicas ended before they finished: killed (by a "
                "signal, or the out-of-memory killer), or aborted by XLA, which then prints why above"
                f"{reports.last_checkpoint_note(spawned)}"
            ) from exc
        except BaseException:
            with contextlib.suppress(Warning):  # a warning made an error (-W error) must not hide the failure
                relayed_warnings.relay(Path(folder))
            raise
        relayed_warnings.relay(Path(folder))
        return reports.collect(spawned)


def _xla_entry(ordinal: int, job: Job) -> None:
    assert job.result_dir is not None
    with relayed_warnings.recorded_in_threads(job.result_dir / f"warnings-{ordinal}.json"):  # the caller shows them
        _xla_replica(ordinal, job)


def _xla_replica(ordinal: int, job: Job) -> None:
    backend = XlaReplicaBackend()
    wanted = job.config.devices
    if isinstance(wanted, int) and wanted != backend.replica_count:  # a TPU launches on every core
        raise TiekitError(f"devices={wanted}, but torch_xla.launch started {backend.replica_count} replicas")
    outcome, model = run_replica(job, backend)
    reports.report(job, outcome, model, host_leader=xla_runtime.xla_local_ordinal() == 0)


# -- "ddp" ----------------------------------------------------------------------------------------


def _processes(job: Job, requested: int | str) -> tuple[list[Outcome], nn.Module]:
    """``"ddp"`` or ``"fsdp"``: one torch.distributed process per device, spawned here, or this
    process when torchrun started it."""
    launched = launched_rank(os.environ)
    if launched is not None:  # torchrun, or your own group: this process is one rank
        local_world = os.environ.get("LOCAL_WORLD_SIZE")
        if isinstance(requested, int) and str(requested) not in (str(launched[1]), local_world):
            raise TiekitError(
                f"devices={requested}, but this run has {launched[1]} process{'es' if launched[1] != 1 else ''}, "
                f'started by torchrun or your script: pass devices="auto" or {launched[1]} (the number of processes)'
            )
        created = not dist.is_initialized()
        try:
            outcomes = _here(job, _process_backend(job.strategy, *launched, None))
        except BaseException as exc:
            if created and dist.is_initialized():
                collective_close_process_group(exc)
            else:  # your group: it goes when you destroy it, not with this traceback
                drop_library_locals(exc)
                clear_dtensor_caches()  # nor with torch 2.14's DTensor caches (FSDP2's meshes)
            raise
        if created and dist.is_initialized():
            collective_close_process_group()
        else:
            clear_dtensor_caches()
        return outcomes
    if isinstance(requested, str) and requested != "auto":
        raise TiekitError(f'strategy="{job.strategy}" takes devices="auto" or a number of processes, not {requested!r}')
    world = requested if isinstance(requested, int) else max(1, torch.cuda.device_count())
    if world == 1 and job.strategy == "ddp":
        return _here(job, TorchBackend(torch.device("cuda" if torch.cuda.is_available() else "cpu")))
    from torch.multiprocessing.spawn import ProcessException, start_processes

    with tempfile.TemporaryDirectory(prefix="tiekit-fit-") as folder:
        spawned = dataclasses.replace(job, result_dir=Path(folder))
        try:
            with _picklable(job.strategy), _generators_sent_by_value():
                store = rendezvous_store()  # held here until the processes are done
                start_processes(_process_entry, args=(spawned, world, store.port), nprocs=world, start_method="spawn")
        # torch stopped the other processes when this one failed; it reads the failed one's error
        # file after that, and a file cut short (a full disk) fails to unpickle.
        except (ProcessException, pickle.UnpicklingError, EOFError) as exc:
            if not reports.died_after_reporting(spawned, world, exc):
                with contextlib.suppress(Warning):  # a warning made an error (-W error) must not hide the failure
                    relayed_warnings.relay(Path(folder))
                raise reports.failure(spawned, world, exc) from exc
            index, signal = getattr(exc, "error_index", "?"), getattr(exc, "signal_name", "?")
            warnings.warn(
                f"replica {index} was killed by signal {signal} while exiting, "
                "after every replica had reported its result: the run is complete. (torch's gloo process groups "
                "can abort a process at interpreter exit: pytorch/pytorch#179291)",
                RuntimeWarning,
                stacklevel=4,
            )
        relayed_warnings.relay(Path(folder))
        return reports.collect(spawned)


def refuse_a_replica_importing_main() -> None:
    """Local: raise `TiekitError` when this process is a replica being started (Python's spawn
    imports the caller's main module in it before it runs anything) and that import called fit:
    a script calling fit at its top level, without ``if __name__ == '__main__':``."""
    import multiprocessing

    # The flag Python's spawn sets while it prepares a child (multiprocessing.spawn checks it too).
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise TiekitError(
            "tiekit.fit was called while a new replica process imported your script: every replica (and "
            "every XLA launch process) imports the main module, so a script that calls fit at its top level "
            "starts it again in each of them. Call fit under if __name__ == '__main__':"
        )


def _process_entry(rank: int, job: Job, world: int, port: int) -> None:
    assert job.result_dir is not None
    with relayed_warnings.recorded(job.result_dir / f"warnings-{rank}.json"):  # the caller shows them
        _process_replica(rank, job, world, port)


def _process_replica(rank: int, job: Job, world: int, port: int) -> None:
    backend = _process_backend(job.strategy, rank, world, port)
    try:
        outcome, model = run_replica(job, backend)
        reports.report(job, outcome, model, host_leader=rank == 0)  # spawned here: all on this host
    except BaseException as exc:
        reports.report_error(job, rank, exc)
        drop_library_locals(exc)  # the group goes with the model holding it (see collective_close_process_group)
        clear_dtensor_caches()
        dist.destroy_process_group()  # peers may be gone: no meeting
        raise
    # The ranks meet before leaving: a process whose peer closed the group under it could abort
    # at exit ("terminate called without an active exception", seen in CI under load).
    collective_close_process_group()


def _process_backend(strategy: str, rank: int, world: int, port: int | None) -> TorchBackend:
    device = join_process_group(rank, world, port)
    return FsdpBackend(device, rank, world) if strategy == "fsdp" else TorchBackend(device, rank, world)


@contextmanager
def _generators_sent_by_value() -> Iterator[None]:
    """Inside: a ``torch.Generator`` (a DataLoader's, a sampler's) reaches spawned processes as
    its state, in the pickle itself. torch's shared-memory pickling sends its state tensor by a
    file descriptor the new process fails to map (pytorch/pytorch#146828): the replica died
    unpickling the job, before it could report why."""
    reducers: dict[type, Any] = ForkingPickler._extra_reducers  # type: ignore[attr-defined]  # register writes it
    before = reducers.get(torch.Generator)
    ForkingPickler.register(torch.Generator, _generator_by_value)
    try:
        yield
    finally:
        if before is None:
            reducers.pop(torch.Generator, None)
        else:
            reducers[torch.Generator] = before


def _generator_by_value(generator: torch.Generator) -> tuple[Any, tuple[str, bytes]]:
    return _generator_from_state, (str(generator.device), generator.get_state().numpy().tobytes())


def _generator_from_state(device: str, state: bytes) -> torch.Generator:
    """A generator in the state sent (its initial seed included)."""
    generator = torch.Generator(device=device)
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return generator


@contextmanager
def _picklable(strategy: str) -> Iterator[None]:
    try:
        yield
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        if "pickle" not in str(exc):
            raise
        raise TiekitError(
            f"strategy={strategy!r} starts new processes, which receive the model (or its factory), the data, "
            f"loss_fn and the optimizer factory by pickling, and this failed: {exc}. Define them at the top "
            "level of an importable file (no lambdas or local functions), and call fit under "
            "if __name__ == '__main__':"
        ) from exc
