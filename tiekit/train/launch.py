"""Starting the replicas of a run, per strategy, and collecting what they report.

* ``"single"``: this process, one device (XLA if configured, else CUDA, else CPU).
* ``"xla"``: one replica per XLA device through ``torch_xla.launch`` (on one host: one process,
  one thread per device). Already inside a replica (your own ``torch_xla.launch``), or with
  one device, it runs right here.
* ``"spmd"``: this process drives every device; the batch is sharded on a ``"data"`` mesh axis.
* ``"ddp"``: ``torch.distributed`` (gloo on CPU, nccl on CUDA), one process per device,
  spawned here, or this process when ``torchrun`` started it.

Spawned replicas report through files in a private folder: each writes its `Outcome` as JSON,
and one replica per host writes the trained weights, which the caller's model then loads with
`tiekit.load_model` (ties included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import socket
import tempfile
from collections.abc import Iterator, Mapping
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import safetensors.torch as safetensors_torch
import torch
import torch.distributed as dist
from torch import nn

from tiekit import devices, load_model
from tiekit.errors import CheckpointError, TieError, TiekitError
from tiekit.train import state
from tiekit.train.config import Job, Outcome
from tiekit.train.loop import run_replica
from tiekit.train.strategies import Backend, TorchBackend, XlaBackend

_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def resolve_strategy(strategy: str, requested: int | str) -> str:
    """The concrete strategy for ``"auto"``: XLA when configured, DDP on several GPUs, else single."""
    if strategy != "auto":
        return strategy
    if isinstance(requested, str) and requested != "auto":
        return "single"  # one named device
    if devices.xla_wanted():
        return "xla"
    if all(k in os.environ for k in _TORCHRUN) or (torch.cuda.is_available() and torch.cuda.device_count() > 1):
        return "ddp"
    return "single"


def run(job: Job) -> tuple[list[Outcome], nn.Module]:
    """Run ``job`` on its strategy; every replica's `Outcome` (rank order) and the trained model."""
    requested = job.config.devices
    if job.strategy == "single":
        return _here(job, _single_backend(requested))
    if job.strategy == "spmd":
        if requested != "auto":
            raise TiekitError(f'strategy="spmd" shards over every device; devices must be "auto", not {requested!r}')
        return _here(job, XlaBackend(spmd=True))
    if job.strategy == "xla":
        return _xla(job, requested)
    if job.strategy == "ddp":
        return _ddp(job, requested)
    raise TiekitError(f"unknown strategy {job.strategy!r}")


def _here(job: Job, backend: Backend) -> tuple[list[Outcome], nn.Module]:
    outcome, model = run_replica(job, backend)
    return [outcome], model


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
        if devices.xla_replica() is not None:
            raise TiekitError('strategy="single" inside a torch_xla.launch replica: use strategy="xla"')
        return XlaBackend()
    return TorchBackend(device)


# -- "xla" ----------------------------------------------------------------------------------------


def _xla(job: Job, requested: int | str) -> tuple[list[Outcome], nn.Module]:
    if isinstance(requested, str) and requested != "auto":
        raise TiekitError(f'strategy="xla" takes devices="auto" or a number of devices, not {requested!r}')
    count = requested if isinstance(requested, int) else None
    if devices.xla_replica() is not None:  # inside the user's own torch_xla.launch
        return _here(job, XlaBackend())
    if devices.xla_runtime_started():
        available = devices.xla_device_count()
        if count == 1 or available == 1:
            return _here(job, XlaBackend())
        raise TiekitError(
            f"torch_xla's runtime already runs in this process ({available} devices), so torch_xla.launch "
            "cannot start one replica per device any more. Call tiekit.fit before using any XLA device, "
            "call it inside your own torch_xla.launch function, or pass devices=1."
        )
    if (count or devices.xla_device_count_hint()) == 1:
        return _here(job, XlaBackend())
    with tempfile.TemporaryDirectory(prefix="tiekit-fit-") as folder:
        spawned = dataclasses.replace(job, result_dir=Path(folder))
        try:
            with _picklable(job.strategy):
                devices.xla_launch(_xla_entry, (spawned,), count)
        except BrokenProcessPool as exc:  # XLA aborts the process on a fatal error (printed above)
            raise TiekitError(
                f"the process running the {count or 'XLA'} replicas died before they finished (XLA prints why above)"
            ) from exc
        return _collect(spawned)


def _xla_entry(ordinal: int, job: Job) -> None:
    backend = XlaBackend()
    wanted = job.config.devices
    if isinstance(wanted, int) and wanted != backend.replica_count:  # a TPU launches on every core
        raise TiekitError(f"devices={wanted}, but torch_xla.launch started {backend.replica_count} replicas")
    outcome, model = run_replica(job, backend)
    _report(job, outcome, model, host_leader=devices.xla_local_ordinal() == 0)


# -- "ddp" ----------------------------------------------------------------------------------------


def _ddp(job: Job, requested: int | str) -> tuple[list[Outcome], nn.Module]:
    if all(k in os.environ for k in _TORCHRUN):  # started by torchrun: this process is one rank
        created = not dist.is_initialized()
        try:
            return _here(job, _ddp_backend(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None))
        finally:
            if created and dist.is_initialized():
                _close_group()
    if isinstance(requested, str) and requested != "auto":
        raise TiekitError(f'strategy="ddp" takes devices="auto" or a number of processes, not {requested!r}')
    world = requested if isinstance(requested, int) else max(1, torch.cuda.device_count())
    if world == 1:
        return _here(job, TorchBackend(torch.device("cuda" if torch.cuda.is_available() else "cpu")))
    from torch.multiprocessing.spawn import ProcessException, start_processes

    with tempfile.TemporaryDirectory(prefix="tiekit-fit-") as folder:
        spawned = dataclasses.replace(job, result_dir=Path(folder))
        try:
            with _picklable(job.strategy):
                start_processes(_ddp_entry, args=(spawned, world, free_port()), nprocs=world, start_method="spawn")
        except ProcessException as exc:  # torch stopped the other processes when this one failed
            raise _failure(spawned, exc) from exc
        return _collect(spawned)


def _close_group() -> None:
    """Close the process group fit made under torchrun (a group you made stays yours). Left open,
    torch 2.14's processes abort at exit ("terminate called without an active exception"), and
    so do they when one closes the group while a peer still uses its store: the ranks first meet
    (for at most 10 s: a rank that died is the launcher's to report)."""
    if dist.get_backend() == "gloo":
        with contextlib.suppress(RuntimeError):
            dist.monitored_barrier(timeout=timedelta(seconds=10), wait_all_ranks=True)
    dist.destroy_process_group()


def _ddp_entry(rank: int, job: Job, world: int, port: int) -> None:
    backend = _ddp_backend(rank, world, port)
    try:
        outcome, model = run_replica(job, backend)
        _report(job, outcome, model, host_leader=rank == 0)  # spawned here: all on this host
    except BaseException as exc:
        assert job.result_dir is not None
        error = {"type": type(exc).__name__, "message": str(exc)}
        (job.result_dir / f"error-{rank}.json").write_text(json.dumps(error), encoding="utf-8")
        raise
    finally:
        dist.destroy_process_group()


def ddp_device(local_rank: int, local_world: int | None, cuda_count: int) -> tuple[torch.device, str]:
    """(device, process-group backend) of the DDP process ``local_rank`` of ``local_world`` on a host
    with ``cuda_count`` GPUs: ``cuda:<local_rank>`` with nccl when every process of the host has
    its own GPU (``cuda_count >= local_world``; local world unknown: ``local_rank < cuda_count``),
    else the CPU with gloo. Pure: the world size and the other hosts play no part, so 2 hosts
    with 1 GPU each train on their GPUs."""
    has_gpu = cuda_count >= local_world if local_world is not None else local_rank < cuda_count
    if has_gpu and cuda_count > 0:
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def local_ranks(rank: int, world: int, env: Mapping[str, str]) -> tuple[int, int | None]:
    """(local rank, local world size) of a DDP process: torchrun's ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` when set, else (``rank``, ``world``): processes spawned here share this host."""
    if "LOCAL_RANK" in env:
        local_world = env.get("LOCAL_WORLD_SIZE")
        return int(env["LOCAL_RANK"]), None if local_world is None else int(local_world)
    return rank, world


def _ddp_backend(rank: int, world: int, port: int | None) -> TorchBackend:
    local_rank, local_world = local_ranks(rank, world, os.environ)
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device, group_backend = ddp_device(local_rank, local_world, cuda_count)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # As torchrun does: processes sharing a host's cores should not each use all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (local_world or 1)))
    if not dist.is_initialized():
        init = "env://" if port is None else f"tcp://127.0.0.1:{port}"
        dist.init_process_group(group_backend, init_method=init, rank=rank, world_size=world)
    return TorchBackend(device, rank, world)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a spawned run's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


# -- results of spawned replicas --------------------------------------------------------------------


def _report(job: Job, outcome: Outcome, model: nn.Module, host_leader: bool) -> None:
    assert job.result_dir is not None
    if host_leader:
        # The replicas are identical; one per host writes, because on a pod slice every host's
        # caller collects from its own folder. safetensors' save_model stores a tie once and
        # records it; tiekit.load_model reads that record.
        safetensors_torch.save_model(model, str(job.result_dir / "model.safetensors"))
    text = json.dumps(dataclasses.asdict(outcome))
    (job.result_dir / f"outcome-{outcome.rank}.json").write_text(text, encoding="utf-8")


def _collect(job: Job) -> tuple[list[Outcome], nn.Module]:
    assert job.result_dir is not None
    files = sorted(job.result_dir.glob("outcome-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    if not files:
        raise TiekitError(f"the {job.strategy!r} replicas exited without reporting (see their output above)")
    outcomes = []
    for path in files:
        fields: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
        outcomes.append(Outcome(**values))
    if isinstance(job.model, nn.Module):
        model = job.model
    else:
        torch.manual_seed(job.config.seed)
        model = job.model()
    load_model(model, job.result_dir / "model.safetensors")
    return outcomes, model


def _replica_error(job: Job, rank: int) -> tuple[str, str]:
    """(error class name, message) replica ``rank`` reported before it raised (its error file)."""
    assert job.result_dir is not None
    path = job.result_dir / f"error-{rank}.json"
    if not path.is_file():
        return "", "see its traceback above"
    error: dict[str, str] = json.loads(path.read_text(encoding="utf-8"))
    return error["type"], f"{error['type']}: {error['message']}"


def _failure(job: Job, exc: Exception) -> TiekitError:
    """The error `fit` raises when a spawned replica failed (``exc``: torch's report) and torch
    stopped the others: which replica, how (its error, the signal that killed it), and the last
    checkpoint. A tiekit error of the replica keeps its class (`CheckpointError`...)."""
    from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

    assert isinstance(exc, ProcessException)
    kind = TiekitError
    if isinstance(exc, ProcessExitedException) and exc.signal_name:
        how = f"was killed by signal {exc.signal_name}"
    elif isinstance(exc, ProcessExitedException):
        how = f"exited with code {exc.exit_code}"
    else:
        name, message = _replica_error(job, exc.error_index)
        kind = _TIEKIT_ERRORS.get(name, TiekitError)
        how = f"failed: {message}"
    folder = job.config.checkpoint_dir
    last = None if folder is None or not folder.is_dir() else state.last_checkpoint(folder)
    saved = "" if folder is None else f"; the last checkpoint: {last or 'none written'}"
    pid = getattr(exc, "error_pid", getattr(exc, "pid", "?"))  # torch renamed pid to error_pid (2.10+)
    return kind(f"replica {exc.error_index} (process {pid}) {how}; the run stopped its other replicas{saved}")


_TIEKIT_ERRORS: dict[str, type[TiekitError]] = {e.__name__: e for e in (TiekitError, CheckpointError, TieError)}
