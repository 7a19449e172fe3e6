"""Sharded training (FSDP2) that keeps a tie: `tiekit.shard` on 2 CPU processes.

    python examples/shard_fsdp2.py

Starts 2 processes (gloo on 127.0.0.1). Each builds the same tied language model (a vocabulary
of 101 rows, which 2 processes do not divide evenly), shards it with `tiekit.shard` and trains 5
steps on its half of every batch; rank 0 compares the weights with the same 5 steps taken in one
process on whole batches. Then the same with the tie split across FSDP units by hand
(``fully_shard(model.embed); fully_shard(model.head); fully_shard(model)``): `tiekit.check_sharding`
refuses it before the first step, and training it anyway drifts from the reference without a word
on torch before 2.13 (2.13 and later refuse it at the first forward).
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import tiekit

VOCAB, DIM, STEPS, WORLD = 101, 16, 5, 2


class Block(nn.Module):
    """A residual MLP block: the repeated unit FSDP shards one by one."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.mlp(self.norm(h)))


class TiedLM(nn.Module):
    """Embedding, two blocks, and an output layer whose weight is the embedding matrix."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # the tie

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def batches(steps: int = STEPS) -> list[torch.Tensor]:
    """The same global batches in every process: 4 sequences of 9 tokens per step."""
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(0, VOCAB, (4, 9), generator=generator) for _ in range(steps)]


def train(model: nn.Module, rank: int = 0, world: int = 1, steps: int = STEPS) -> list[float]:
    """``steps`` AdamW steps, each process on its share of every global batch; the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in batches(steps):
        ids = batch.chunk(world)[rank]
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def collective_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight whole (sharded DTensors gathered): collective, every rank must call it."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def largest_difference(state: dict[str, torch.Tensor], reference: nn.Module) -> float:
    """The largest absolute difference from ``reference``'s weights."""
    expected = reference.state_dict()
    return max((state[k] - expected[k]).abs().max().item() for k in expected)


def worker(rank: int, port: int) -> None:
    """One process: the tiekit run, then the split one; rank 0 prints."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    say = print if rank == 0 else (lambda *args: None)
    try:
        torch.manual_seed(0)
        reference = TiedLM()  # the same 5 steps in this one process, whole batches
        train(reference)

        torch.manual_seed(0)  # the same weights in every process: fully_shard does not broadcast
        model = TiedLM()
        tiekit.collective_check_same_model(model)  # a rank built otherwise is named here, not in FSDP2's collectives
        model = tiekit.shard(model)
        say(f"tiekit.shard: head.weight is embed.weight: {model.head.weight is model.embed.weight}")
        train(model, rank, WORLD)
        difference = largest_difference(collective_full_state(model), reference)
        say(f"after {STEPS} steps on {WORLD} processes, largest difference from one process: {difference:.1e}")

        torch.manual_seed(0)
        split = TiedLM()
        plan = tiekit.find_ties(split)  # before wrapping: afterwards the split tie is two tensors
        from torch.distributed.fsdp import fully_shard

        fully_shard(split.embed)
        fully_shard(split.head)
        fully_shard(split)
        try:
            tiekit.check_sharding(split, plan)
        except tiekit.TieError as exc:
            say(f"split units, check_sharding: {str(exc).splitlines()[1].strip()}")
        try:
            train(split, rank, WORLD)
        except ValueError as exc:  # torch 2.13 and later
            say(f"split units, torch {torch.__version__} refused them at the first forward: {exc}")
        else:
            difference = largest_difference(collective_full_state(split), reference)
            say(f"split units, torch {torch.__version__} trained them: largest difference {difference:.1e}")
        del model, split  # a sharded model keeps its process group, and so do torch 2.14's DTensor
        tiekit.clear_dtensor_caches()  # caches: left to interpreter exit, gloo's threads can abort it
        dist.barrier()  # every rank done with the group before one leaves it (gloo may abort at exit)
    finally:
        dist.destroy_process_group()


def main() -> None:
    """Pick a free port and run both processes (an error in one is raised here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port,), nprocs=WORLD)


if __name__ == "__main__":
    main()
