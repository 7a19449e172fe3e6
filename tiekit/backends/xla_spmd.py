"""XLA SPMD: one process per host drives every device as one program; the batch is sharded over
the mesh, and (``"spmd_fsdp"``) so are the parameters."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from tiekit.backends.xla import XlaBackend, xla_device_count, xla_module, xla_wait
from tiekit.collective import ranks
from tiekit.devices import xla
from tiekit.errors import TiekitError
from tiekit.moving import move
from tiekit.plan import TiePlan


def spmd_mesh(axis: str) -> tuple[torch.device, Any, int, int]:
    """Turn SPMD on; (device, a 1-D mesh over every device with its axis named ``axis``, host
    index, host count)."""
    torch_xla = xla()
    import numpy as np

    xr = xla_module("torch_xla.runtime")
    spmd = xla_module("torch_xla.distributed.spmd")

    xr.use_spmd()
    count = int(xr.global_runtime_device_count())
    mesh = spmd.Mesh(np.arange(count), (count,), (axis,))
    return torch_xla.device(), mesh, int(xr.process_index()), int(xr.process_count())


def spmd_local_device_count() -> int:
    """Devices this host drives under SPMD."""
    xr = xla_module("torch_xla.runtime")

    return int(xr.addressable_runtime_device_count())


def spmd_input_sharding(mesh: Any, example: Any, multi_host: bool) -> Any:
    """A ``ShardingSpec`` that splits the batch dimension over the mesh's (only) axis.

    Built from the first tensor of ``example`` (a tensor, a tuple/list, or a dict of tensors,
    one spec per key). Tensors of another rank stay replicated: still correct, only slower.
    """
    spmd = xla_module("torch_xla.distributed.spmd")

    def spec(t: torch.Tensor) -> Any:
        return spmd.ShardingSpec(mesh, (mesh.axis_names[0],) + (None,) * (t.dim() - 1), minibatch=multi_host)

    if isinstance(example, dict):
        return {k: spec(v) for k, v in example.items() if isinstance(v, torch.Tensor)}
    first = example if isinstance(example, torch.Tensor) else next(t for t in example if isinstance(t, torch.Tensor))
    return spec(first)


def shard_parameters(model: nn.Module, mesh: Any) -> int:
    """Shard every unique parameter of ``model`` on dimension 0 over the mesh's (only) axis with
    ``mark_sharding``, FSDPv2 style; scalars stay replicated. A tie group is one parameter, so it
    gets one annotation and one sharded buffer; a parameter without elements stays replicated
    (torch_xla's save planner writes nothing for a sharded one). Returns the number annotated.

    ``model`` must be on the XLA device already (`tiekit.move`, which keeps its ties) and ``mesh``
    one-dimensional (`spmd_mesh`'s): a parameter elsewhere, or a mesh of several axes (which one
    would split the rows is yours to say, with ``mark_sharding``), is a `TiekitError` before any
    parameter is annotated."""
    spmd = xla_module("torch_xla.distributed.spmd")
    shape = getattr(mesh, "mesh_shape", None)
    if shape is None:
        raise TiekitError(f"shard_parameters: mesh must be a torch_xla Mesh (spmd_mesh's), not a {type(mesh).__name__}")
    if len(shape) != 1:
        raise TiekitError(
            f"shard_parameters shards over a 1-D mesh, and this mesh has {len(shape)} axes (shape {tuple(shape)}, "
            f"names {mesh.axis_names}): annotate the parameters with mark_sharding to split them over a chosen axis"
        )
    for name, p in model.named_parameters():
        if p.device.type != "xla":
            raise TiekitError(
                f"shard_parameters: parameter {name!r} is on {p.device}, not on the XLA device: move the whole "
                "model there first, ties kept (tiekit.move(model, 'xla')); no parameter was annotated"
            )
    axis = mesh.axis_names[0] if mesh.axis_names else 0  # a mesh without names: its axis by index
    annotated = 0
    for p in model.parameters():  # unique by identity: each tie group once
        if p.dim() == 0 or p.numel() == 0:
            continue
        spmd.mark_sharding(p, mesh, (axis,) + (None,) * (p.dim() - 1))
        annotated += 1
    return annotated


def spmd_tensors(tensors: Iterable[torch.Tensor]) -> bool:
    """True when SPMD is on in this process and any of ``tensors`` is one of its XLA tensors:
    torch.distributed.checkpoint then needs torch_xla's SPMD planners, which write and read each
    device's shard (DCP's default planners know nothing of XLA shardings). Never imports torch_xla:
    a process that has not imported it holds no XLA tensor."""
    if "torch_xla" not in sys.modules:
        return False
    xr = xla_module("torch_xla.runtime")
    return bool(xr.is_spmd()) and any(t.device.type == "xla" for t in tensors)


def spmd_settle() -> None:
    """Run every pending XLA computation of this process and wait for it to finish: torch_xla's
    planners read the tensors' device data, which a tensor still being computed (an optimizer
    step not yet synced, or synced and still in flight) does not have yet."""
    xla().sync()
    xla_wait()


def spmd_save_planner() -> Any:
    """torch_xla's ``SPMDSavePlanner``: each host writes the shards its devices hold (a replicated
    or unsharded tensor once, through DCP's default planning)."""
    checkpoint = xla_module("torch_xla.experimental.distributed_checkpoint")
    return checkpoint.SPMDSavePlanner()


def spmd_load_planner() -> Any:
    """torch_xla's ``SPMDLoadPlanner``: reads into the live sharded XLA tensors in place (each
    device gets its rows), so a parameter keeps its identity (hence its ties) and its sharding."""
    checkpoint = xla_module("torch_xla.experimental.distributed_checkpoint")
    return checkpoint.SPMDLoadPlanner()


def spmd_empty_like(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """A new XLA tensor of ``like``'s shape, on its device and sharded as it is, for
    ``SPMDLoadPlanner`` to read each device's rows into (an optimizer state of a sharded
    parameter stays sharded after a load); None when ``like`` carries no sharding."""
    torch_xla = xla()
    if not torch_xla._XLAC._get_xla_sharding_spec(like):
        return None
    # Device data, as a moved parameter is: the planner asks for its shards' indices, which a
    # tensor still only a graph node (torch.zeros on the device) does not have yet.
    made = torch.zeros(like.shape, dtype=dtype).to(like.device)
    torch_xla._XLAC._xla_mark_sharding(made, torch_xla._XLAC._get_xla_op_sharding(like))
    return made


def spmd_writable(state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``state`` as torch_xla's ``SPMDSavePlanner`` writes it whole: a tensor sharded over part of
    the mesh and replicated over the rest (a norm weight sharded on one axis of a 2-D mesh) as
    the host copies of its shards' first replicas. Given the device tensor, torch_xla 2.9 plans
    every replica of each shard and DCP then stores none of the tensor, without an error. A
    sharded tensor without elements, which that planner leaves out too, as an empty host tensor.
    Other tensors are left as they are, on the device."""
    torch_xla = xla()
    on_device = {k: t for k, t in state.items() if t.device.type == "xla"}
    empty = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in on_device.items() if t.numel() == 0}
    partial = [k for k, t in on_device.items() if k not in empty and _replicated_shards(torch_xla, t)]
    if not partial:
        return {**state, **empty}
    helpers = xla_module("torch_xla.experimental.distributed_checkpoint._helpers")
    copied = helpers._sharded_cpu_state_dict({k: state[k] for k in partial})
    return {**state, **empty, **{k: _first_replicas(helpers, copied[k]) for k in partial}}


def _replicated_shards(torch_xla: Any, t: torch.Tensor) -> bool:
    """Whether some shard of ``t`` is held by more than one device (a replica id other than 0)."""
    if not torch_xla._XLAC._get_xla_sharding_spec(t):
        return False
    return any(replica != 0 for replica, _ in torch_xla._XLAC._get_local_shard_replica_and_indices([t])[0])


def _first_replicas(helpers: Any, shards: Any) -> Any:
    """torch_xla's host shards of one tensor, each shard once (replica 0: exactly one device of the
    whole mesh holds it, so across hosts every shard is written once)."""
    if not isinstance(shards, helpers._CpuShards):
        return shards
    return helpers._CpuShards(shards=[s for s in shards.shards if s.replica_id == 0], global_shape=shards.global_shape)


def spmd_host_copy(state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``state`` copied to host memory for a background save: a sharded tensor as its devices'
    shards (torch_xla's ``_CpuShards``, which ``SPMDSavePlanner`` writes without touching the
    device again), any other XLA tensor whole, a host tensor cloned (training may change it
    meanwhile). Waits for the device; the copy is what is saved.

    torch_xla's own ``CheckpointManager.save_async`` stages with the same private helper; there
    is no public one in torch_xla 2.9."""
    helpers = xla_module("torch_xla.experimental.distributed_checkpoint._helpers")
    on_device = {k: t for k, t in state.items() if t.device.type == "xla" and t.numel()}
    copied = {k: _first_replicas(helpers, v) for k, v in helpers._sharded_cpu_state_dict(on_device).items()}
    # A tensor without elements as an empty host tensor: the planner leaves a sharded one out.
    return {k: copied[k] if k in copied else t.detach().cpu().clone() for k, t in state.items()}


class SpmdBackend(XlaBackend):
    """This process drives every XLA device of its host as one program (one process per host):
    the batch is sharded over the mesh; ``shard_parameters`` (``"spmd_fsdp"``) shards the
    parameters over it too, else every device holds them whole (``"spmd"``)."""

    def __init__(self, *, shard_parameters: bool = False) -> None:
        self.sharded = shard_parameters
        self.sharded_checkpoints = shard_parameters  # save_sharded reads the XLA shards in place
        axis = "fsdp" if shard_parameters else "data"
        device, self.mesh, host, hosts = spmd_mesh(axis)
        super().__init__(device)
        self.name = "spmd_fsdp" if shard_parameters else "spmd"
        self.data_rank, self.data_replicas = host, hosts
        self.unplaces_alone = hosts == 1
        self.batch_scale = spmd_local_device_count()
        self.devices_in_run = xla_device_count()
        self.ranks = ranks()  # SPMD hosts (process index 0 writes: every host is replica 0 there)
        self._sharding: Any = None

    def place(self, model: nn.Module, dtype: torch.dtype | None, plan: TiePlan) -> None:
        move(model, self.device, dtype=dtype, plan=plan)
        if self.sharded:
            shard_parameters(model, self.mesh)

    def input_sharding(self, loader: Iterable[Any]) -> Any:
        if self._sharding is None:
            example = next(iter(loader))
            self._sharding = spmd_input_sharding(self.mesh, example, self.data_replicas > 1)
        return self._sharding
