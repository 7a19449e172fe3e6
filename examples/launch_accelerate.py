"""accelerate launch on two CPU processes: train a tied model a few steps, save it both ways.

    USE_TORCH_XLA=0 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
        --mixed_precision no --dynamo_backend no examples/launch_accelerate.py runs/accelerate

(``--multi_gpu`` is accelerate's torchrun launcher; ``Accelerator(cpu=True)`` below puts the two
processes in a gloo group on the CPU. ``--num_processes 2 --cpu`` would start one process: see
docs/launching.md. With torch_xla installed, accelerate picks the XLA device even with
``cpu=True``; ``USE_TORCH_XLA=0`` keeps it on the CPU.) ``prepare_tied`` wraps the model in DDP
with its tie kept. Then:

* the main process saves: ``if accelerator.is_main_process: tiekit.save_model(...)`` and
  ``accelerator.wait_for_everyone()`` before anyone reads the file;
* or every process calls ``tiekit.collective_save_model``: written once, by rank 0.

Every process loads both files back into a model whose tie is broken: the files re-tie it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

import tiekit
from tiekit.integrations.accelerate import prepare_tied


class TiedLM(nn.Module):
    """An embedding whose matrix is also the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def main(out: Path) -> None:
    """Train 3 steps on each process's own batches, save, load back, check the tie and values."""
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)  # prepare's DDP wrapper broadcasts rank 0's weights anyway
    model = prepare_tied(accelerator, TiedLM())
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    generator = torch.Generator().manual_seed(accelerator.process_index)
    for _ in range(3):
        ids = torch.randint(0, 32, (4, 6), generator=generator)
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    trained = accelerator.unwrap_model(model)
    assert trained.head.weight is trained.embed.weight

    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        tiekit.save_model(trained, out / "main.safetensors")
    accelerator.wait_for_everyone()
    tiekit.collective_save_model(trained, out / "collective.safetensors")

    for name in ("main.safetensors", "collective.safetensors"):
        fresh = TiedLM()
        fresh.head.weight = nn.Parameter(torch.zeros(32, 8))  # a broken tie
        tiekit.load_model(fresh, out / name)
        assert fresh.head.weight is fresh.embed.weight
        assert torch.equal(fresh.embed.weight, trained.embed.weight)
    print(f"process {accelerator.process_index}: saved and reloaded tied ({accelerator.num_processes} processes)")
    # Without it gloo's threads may still run at interpreter exit and abort the process.
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/accelerate"))
