"""Lightning on two CPU processes with tied weights: checkpoint every 4 steps, then resume.

    python examples/launch_lightning.py ddp runs/lightning         # Lightning starts the 2nd process
    python examples/launch_lightning.py ddp_spawn runs/lightning   # Lightning spawns 2 processes

``KeepTies`` keeps the tie (and the view buffer) through the strategy's setup;
``TiedCheckpointIO`` makes ``ModelCheckpoint`` write tied safetensors. Lightning calls a
``CheckpointIO`` on global rank 0 only, and with ``ddp_spawn`` hands the trained weights back to
the main process through it: both work because tiekit's saves are local (they never wait for
the other ranks). The script trains 8 steps (checkpoints at steps 4 and 8), resumes a fresh
module from the step-4 checkpoint, checks that it continues at step 4 and ends with the same
weights as the uninterrupted run, and loads the last checkpoint with ``tiekit.load_model``.
"""

from __future__ import annotations

import atexit
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tiekit
from tiekit.integrations.lightning import KeepTies, TiedCheckpointIO

VOCAB, WIDTH = 32, 8

# Lightning leaves its gloo process group open when a training process ends. On torch 2.14, a gloo
# thread can then drop its last reference to a finished collective while the interpreter shuts
# down, and the process aborts ("terminate called without an active exception": 4 runs in 38 of
# tests/test_lightning_ddp.py's ddp_spawn probe). Closing the group at exit joins those threads
# first. At module level, so that the processes ddp_spawn starts (which import this file) do it too.
atexit.register(lambda: torch.distributed.is_initialized() and torch.distributed.destroy_process_group())


class TiedLM(pl.LightningModule):
    """An embedding that is also the output layer, plus a buffer that is a view of it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("embed_t", self.embed.weight.detach().t())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids = batch[0]
        hidden = self.embed(ids)
        logits = self.head(hidden) + hidden @ self.embed_t
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Steps(pl.Callback):
    """Fails the run unless training starts at step ``start`` and ends at ``end``, tied, in the
    processes that train (with ddp_spawn the main process only gets the weights back)."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert trainer.global_step == self.start, f"started at step {trainer.global_step}, not {self.start}"
        assert pl_module.head.weight is pl_module.embed.weight
        assert pl_module.embed_t.data_ptr() == pl_module.embed.weight.data_ptr(), "the view buffer is a copy"
        print(f"rank {trainer.global_rank}: training starts at step {trainer.global_step}", flush=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert trainer.global_step == self.end, f"ended at step {trainer.global_step}, not {self.end}"
        assert pl_module.head.weight is pl_module.embed.weight
        assert pl_module.embed_t.data_ptr() == pl_module.embed.weight.data_ptr(), "the view buffer is a copy"


def data() -> DataLoader[Any]:
    """16 sequences in batches of 2: 4 steps per epoch on each of 2 processes."""
    ids = torch.randint(0, VOCAB, (16, 6), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids), batch_size=2)


def trainer(strategy: str, out: Path, start: int, plan: tiekit.TiePlan) -> pl.Trainer:
    """Two CPU processes, 8 steps, a tied checkpoint every 4."""
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=8,
        plugins=[TiedCheckpointIO()],
        callbacks=[
            KeepTies(plan=plan),
            Steps(start, end=8),
            pl.callbacks.ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=4, save_top_k=-1),
        ],
        default_root_dir=out,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def main(strategy: str, out: Path) -> None:
    """Train, resume from the middle, compare; the checks run where the trained module lives."""
    pl.seed_everything(0, verbose=False)
    model = TiedLM()
    # The plan is made here, in the main process: with ddp_spawn on the CPU, Lightning copies every
    # buffer in the workers before any callback runs, and the view buffer would arrive as a copy.
    plan = tiekit.find_ties(model)
    first = trainer(strategy, out / "first", start=0, plan=plan)
    first.fit(model, data())
    checkpoints = out / "first" / "checkpoints"
    print(f"rank {first.global_rank}: checkpoints {sorted(p.name for p in checkpoints.iterdir())}", flush=True)

    torch.manual_seed(1)  # other initial weights: all must come from the file (seed_everything(1)
    resumed = TiedLM()  # would also reseed Lightning's DistributedSampler, hence another data order)
    second = trainer(strategy, out / "resumed", start=4, plan=plan)
    second.fit(resumed, data(), ckpt_path=checkpoints / "epoch=0-step=4.ckpt")
    # ddp: every process runs this with its trained replica; ddp_spawn: the main process, with
    # the weights the workers handed back through TiedCheckpointIO.
    assert resumed.head.weight is resumed.embed.weight
    assert resumed.embed_t.data_ptr() == resumed.embed.weight.data_ptr()  # still a view
    assert torch.equal(resumed.embed.weight, model.embed.weight), "resuming did not reproduce the run"

    fresh = TiedLM()
    fresh.head.weight = nn.Parameter(torch.zeros(VOCAB, WIDTH))  # a broken tie
    tiekit.load_model(fresh, checkpoints / "epoch=1-step=8.ckpt")
    assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.embed.weight, model.embed.weight)
    print(f"rank {second.global_rank}: {strategy}: resumed at step 4, ties held, weights match", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ddp", Path(sys.argv[2] if len(sys.argv) > 2 else "runs/lightning"))
