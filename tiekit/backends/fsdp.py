"""FSDP2 over torch.distributed processes: every process holds a shard of each parameter, the
units from `tiekit.shard` (the owners of every tie group in one unit), the data split as in DDP."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tiekit.backends.torch_distributed import TorchBackend
from tiekit.moving import move
from tiekit.plan import TiePlan

BROADCAST_BUCKET_BYTES = 250 * 2**20  # DDP's bucket for the same broadcast


class FsdpBackend(TorchBackend):
    """One of ``world`` processes training an FSDP2-sharded model (``fit(strategy="fsdp")``)."""

    copies_model = True  # fully_shard turns the module itself into a sharded one: never the caller's
    sharded_checkpoints = True

    def __init__(self, device: torch.device, rank: int, world: int) -> None:
        super().__init__(device, rank, world)
        self.name = "fsdp"

    def place(self, model: nn.Module, dtype: torch.dtype | None, plan: TiePlan) -> None:
        """Collective: moved, rank 0's parameters and buffers broadcast to every process (as DDP
        does when it wraps a model; FSDP2 would shard each process's own values, so a model
        initialised differently on each rank trained as a mixture of them), then sharded."""
        import torch.distributed as dist
        from torch.distributed.utils import _sync_module_states

        from tiekit.sharding import shard

        move(model, self.device, dtype=dtype, plan=plan)
        # named_parameters names each tie group once: one broadcast per shared tensor, ties kept.
        world = dist.group.WORLD
        assert world is not None  # joined in the backend's set-up
        _sync_module_states(model, world, BROADCAST_BUCKET_BYTES, 0, ())
        shard(model)

    def wrap(self, model: nn.Module) -> nn.Module:
        return model  # FSDP2 reduce-scatters the gradients in backward: no wrapper

    def unplace(
        self, model: nn.Module, dtype: torch.dtype | None, plan: TiePlan, rebuild: Callable[[], nn.Module]
    ) -> nn.Module:
        """Collective: the full weights gathered on every process, copied into a plain model from
        ``rebuild`` (its own ties kept: the copies go into its tensors in place)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
        plain = rebuild()
        with torch.no_grad():
            plain.load_state_dict({name: t.detach().cpu() for name, t in full.items() if isinstance(t, torch.Tensor)})
        return plain
