"""Saving a tied model from a torchrun job: one writer, or every rank through a collective.

    # one machine, two processes
    torchrun --standalone --nproc-per-node=2 examples/launch_torchrun.py runs/launch
    # two nodes (here two agents on one machine; on real nodes, each node's own --node-rank)
    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=0 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 examples/launch_torchrun.py runs/launch
    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 examples/launch_torchrun.py runs/launch

Every tiekit save writes in the process that calls it and never waits for the others;
the functions named ``collective_*`` are the ones every rank must call. The four patterns:

1. one writer: ``if tiekit.is_writer(): tiekit.save_model(...)``, then ``dist.barrier()``
   before other ranks read the file;
2. every rank calls ``tiekit.collective_save_model(model, path)`` with the same path: the file
   is written once, by rank 0, and every rank returns once it exists;
3. per-rank paths: ``collective_save_model`` writes each rank's own file (so does a plain
   ``save_model`` on every rank, with no waiting at all);
4. a writer that fails: ``collective_save_model`` raises ``tiekit.CheckpointError`` on every
   rank, naming the rank that failed, so no rank waits forever for a file that never comes.

The output folder must be on a filesystem every rank sees (one machine here).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import tiekit


class TiedLM(nn.Module):
    """An embedding whose matrix is also the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def load_tied(path: Path) -> TiedLM:
    """A fresh model with its tie broken, loaded from ``path``: the file's plan re-ties it."""
    model = TiedLM()
    model.head.weight = nn.Parameter(torch.zeros(32, 8))
    tiekit.load_model(model, path)
    assert model.head.weight is model.embed.weight
    return model


def save_patterns(model: nn.Module, out: Path) -> None:
    """The four ways to save from every rank of a torch.distributed job (call on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()

    # 1. One writer, then a barrier of your own before anyone reads the file.
    if tiekit.is_writer():
        tiekit.save_model(model, out / "writer.safetensors")
    dist.barrier()
    assert torch.equal(load_tied(out / "writer.safetensors").embed.weight, model.embed.weight)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # the group still works after the save
    assert total.item() == world * (world + 1) / 2
    print(f"rank {rank}: writer pattern: saved by rank 0, all_reduce {total.item():g}", flush=True)

    # 2. Every rank calls the collective with one path: written once, there when it returns.
    tiekit.collective_save_model(model, out / "shared.safetensors")
    assert (out / "shared.safetensors").is_file()
    print(f"rank {rank}: shared path: written once, present on return", flush=True)

    # 3. Per-rank paths: the collective writes each rank's file; a local save needs no collective.
    tiekit.collective_save_model(model, out / f"rank{rank}.safetensors")
    tiekit.save_model(model, out / f"local{rank}.safetensors")
    dist.barrier()
    for r in range(world):
        load_tied(out / f"rank{r}.safetensors")
        load_tied(out / f"local{r}.safetensors")
    print(f"rank {rank}: per-rank paths: {world} collective and {world} local files", flush=True)

    # 4. A writer that fails (here: the path's parent is a regular file) fails every rank.
    blocked = out / "blocked"
    if tiekit.is_writer():
        blocked.write_text("a file, not a folder")
    dist.barrier()
    for failing, path in [(0, blocked / "shared.safetensors"), (world - 1, out / f"again{rank}.safetensors")]:
        if failing == world - 1 and rank == world - 1:
            path = blocked / f"rank{rank}.safetensors"  # only the last rank's own path is bad
        try:
            tiekit.collective_save_model(model, path)
        except tiekit.CheckpointError as error:
            assert f"rank {failing} (" in str(error), error  # "rank 0 (<its path>): CheckpointError: ..."
            print(f"rank {rank}: writer failure seen: {error}", flush=True)
        else:
            raise AssertionError(f"rank {rank}: the failure of rank {failing} was not raised here")


def main(out: Path) -> None:
    """Join the group torchrun describes (gloo: CPU), save every way, leave the group."""
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same weights on every rank, as after DDP's broadcast
    out.mkdir(parents=True, exist_ok=True)
    try:
        save_patterns(TiedLM(), out)
        dist.barrier()  # every rank done with the group before one leaves it (gloo may abort at exit)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/launch"))
