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

import dataclasses
import json
import os
import pickle
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import safetensors.torch as safetensors_torch
import torch
import torch.distributed as dist
from torch import nn

from tiekit import devices
from tiekit.checkpoint import load_model
from tiekit.errors import TiekitError
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
        return _here(job, _single_backend(job.run_id, requested))
    if job.strategy == "spmd":
        if requested != "auto":
            raise TiekitError(f'strategy="spmd" shards over every device; devices must be "auto", not {requested!r}')
        return _here(job, XlaBackend(job.run_id, spmd=True))
    if job.strategy == "xla":
        return _xla(job, requested)
    if job.strategy == "ddp":
        return _ddp(job, requested)
    raise TiekitError(f"unknown strategy {job.strategy!r}")


def _here(job: Job, backend: Backend) -> tuple[list[Outcome], nn.Module]:
    outcome, model = run_replica(job, backend)
    return [outcome], model


def _single_backend(run_id: str, requested: int | str) -> Backend:
    if isinstance(requested, int) and requested != 1:
        raise TiekitError(f'strategy="single" trains on one device; devices={requested} asks for more')
    if isinstance(requested, str) and requested != "auto":
        device = torch.device(requested)
    elif devices.xla_wanted():
        device = torch.device("xla")
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "xla":
        if devices.xla_replica() is not None:
            raise TiekitError('strategy="single" inside a torch_xla.launch replica: use strategy="xla"')
        return XlaBackend(run_id)
    return TorchBackend(device)


# -- "xla" ----------------------------------------------------------------------------------------


def _xla(job: Job, requested: int | str) -> tuple[list[Outcome], nn.Module]:
    if isinstance(requested, str) and requested != "auto":
        raise TiekitError(f'strategy="xla" takes devices="auto" or a number of devices, not {requested!r}')
    count = requested if isinstance(requested, int) else None
    if devices.xla_replica() is not None:  # inside the user's own torch_xla.launch
        return _here(job, XlaBackend(job.run_id))
    if devices.xla_runtime_started():
        available = devices.xla_device_count()
        if count == 1 or available == 1:
            return _here(job, XlaBackend(job.run_id))
        raise TiekitError(
            f"torch_xla's runtime already runs in this process ({available} devices), so torch_xla.launch "
            "cannot start one replica per device any more. Call tiekit.fit before using any XLA device, "
            "call it inside your own torch_xla.launch function, or pass devices=1."
        )
    if (count or devices.xla_device_count_hint()) == 1:
        return _here(job, XlaBackend(job.run_id))
    with tempfile.TemporaryDirectory(prefix="tiekit-fit-") as folder:
        spawned = dataclasses.replace(job, result_dir=Path(folder))
        with _picklable(job.strategy):
            devices.xla_launch(_xla_entry, (spawned,), count)
        return _collect(spawned)


def _xla_entry(ordinal: int, job: Job) -> None:
    backend = XlaBackend(job.run_id)
    wanted = job.config.devices
    if isinstance(wanted, int) and wanted != backend.replica_count:  # a TPU launches on every core
        raise TiekitError(f"devices={wanted}, but torch_xla.launch started {backend.replica_count} replicas")
    outcome, model = run_replica(job, backend)
    _report(job, outcome, model, host_leader=devices.xla_local_ordinal() == 0)


# -- "ddp" ----------------------------------------------------------------------------------------


def _ddp(job: Job, requested: int | str) -> tuple[list[Outcome], nn.Module]:
    if all(k in os.environ for k in _TORCHRUN):  # started by torchrun: this process is one rank
        return _here(job, _ddp_backend(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None))
    if isinstance(requested, str) and requested != "auto":
        raise TiekitError(f'strategy="ddp" takes devices="auto" or a number of processes, not {requested!r}')
    world = requested if isinstance(requested, int) else max(1, torch.cuda.device_count())
    if world == 1:
        return _here(job, TorchBackend(torch.device("cuda" if torch.cuda.is_available() else "cpu")))
    from torch.multiprocessing.spawn import start_processes

    with tempfile.TemporaryDirectory(prefix="tiekit-fit-") as folder:
        spawned = dataclasses.replace(job, result_dir=Path(folder))
        with _picklable(job.strategy):
            start_processes(_ddp_entry, args=(spawned, world, _free_port()), nprocs=world, start_method="spawn")
        return _collect(spawned)


def _ddp_entry(rank: int, job: Job, world: int, port: int) -> None:
    backend = _ddp_backend(rank, world, port)
    try:
        outcome, model = run_replica(job, backend)
        _report(job, outcome, model, host_leader=rank == 0)  # spawned here: all on this host
    finally:
        dist.destroy_process_group()


def _ddp_backend(rank: int, world: int, port: int | None) -> TorchBackend:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        # As torchrun does: processes sharing a host's cores should not each use all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if not dist.is_initialized():
        init = "env://" if port is None else f"tcp://127.0.0.1:{port}"
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
    return TorchBackend(device, rank, world)


def _free_port() -> int:
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
