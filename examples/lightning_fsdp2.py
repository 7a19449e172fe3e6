"""Lightning's ModelParallelStrategy (FSDP2) on two CPU processes, a tied model built on the meta device.

    python examples/lightning_fsdp2.py runs/lightning_fsdp2

``configure_model`` shards the model with ``tiekit.shard``, which puts the embedding and the
output layer that share one weight in one FSDP unit (a split tie trains silently wrong before
torch 2.13). ``KeepTies`` checks that ``configure_model`` kept every tie: FSDP units that split
one raise ``tiekit.TieError`` naming them, before the first step. Lightning then materializes
the meta weights (``to_empty`` + ``reset_parameters``): FSDP2's parameters are DTensors, which
``to_empty`` swaps in place, so the tie survives. After training, every rank calls
``tiekit.save_sharded`` (collective), which writes the tied weight once; the folder loads into
a plain model with ``tiekit.load_sharded`` in any process. ``trainer.validate`` after ``fit``
calls ``configure_model`` again, which ``tiekit.shard`` allows: the model stays as it is.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tiekit
from tiekit.integrations.lightning import KeepTies

VOCAB, WIDTH, BATCH = 101, 16, 4  # 101 rows: 2 ranks do not divide the vocabulary


class TiedLM(nn.Module):
    """Embedding, two blocks, and an output layer that is the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = torch.tanh(block(hidden))
        return self.head(hidden)


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TiedLM()

    def configure_model(self) -> None:
        # One unit per block, the tied embedding and head with the root: tiekit.shard's choice.
        # Lightning calls this again for every stage (validate after fit): shard then does nothing.
        tiekit.shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        return F.cross_entropy(self.model(ids).flatten(0, 1), targets.flatten())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class TiesHeld(pl.Callback):
    """Prints, on every rank, whether the head still is the embedding when training starts and ends."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer, pl_module, "starts")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer, pl_module, "ends")

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, when: str) -> None:
        model = pl_module.model
        tied = model.head.weight is model.embed.weight
        count = len(list(model.parameters()))
        print(f"rank {trainer.global_rank}: training {when}, tied {tied}, {count} parameters", flush=True)


def data() -> DataLoader[Any]:
    """32 sequences; Lightning gives each of the 2 processes every other one, 4 per batch."""
    ids = torch.randint(0, VOCAB, (32, 8), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids, ids.roll(-1, dims=1)), batch_size=BATCH)


def trainer(steps: int, callbacks: list[pl.Callback]) -> pl.Trainer:
    """Two CPU processes (gloo), FSDP2 over both, no tensor parallelism."""
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=steps,
        callbacks=callbacks,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def train(out: Path, *, steps: int = 4, empty_init: bool = True, seed: int = 0) -> None:
    """Train ``steps`` steps and save the sharded, tied weights to ``out`` (on every rank)."""
    run = trainer(steps, [KeepTies(), TiesHeld()])
    torch.manual_seed(seed)
    with run.init_module(empty_init=empty_init):  # on the meta device: no weights until setup
        module = Module()
    run.fit(module, data())
    [metrics] = run.validate(module, data(), verbose=False)
    print(f"rank {run.global_rank}: validated, loss {metrics['val_loss']:.4f}", flush=True)
    tiekit.save_sharded(module.model, out)  # collective: every rank writes its shards
    print(f"rank {run.global_rank}: saved {out}", flush=True)


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/lightning_fsdp2")
    train(folder / "weights")
    # The ranks meet before leaving: a process whose peer closed the group under it can abort at exit.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
