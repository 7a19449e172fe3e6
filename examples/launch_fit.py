"""tiekit.fit starts (or joins) the replicas itself and writes tied checkpoints from the master.

    python examples/launch_fit.py runs/fit                                        # fit spawns 2 CPU processes
    torchrun --standalone --nproc-per-node=2 examples/launch_fit.py runs/fit-torchrun   # fit joins torchrun's
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 python examples/launch_fit.py runs/fit-xla --xla   # 2 XLA:CPU replicas

Each is a fresh run, so each gets a folder of its own: fit refuses to start one in a folder
holding another run's checkpoints (it would write its step-<n> files over them).

``strategy="ddp"`` runs one gloo process per device (CPU) and, under torchrun, uses the
processes torchrun started; ``"xla"`` one replica per XLA device. The master replica writes
``step-<n>.safetensors`` every ``checkpoint_every`` steps: nothing to coordinate in your code.
The model is a zero-argument factory at module level, so spawned processes can build it.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import tiekit


class TiedLM(nn.Module):
    """An embedding whose matrix is also the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids)).flatten(0, 1)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every position (module level: spawned processes import it)."""
    return F.cross_entropy(logits, targets.flatten())


def main(out: Path, strategy: str) -> None:
    """Train 4 steps on 2 replicas with a checkpoint every 2; reload the last one, tied."""
    ids = torch.randint(0, 32, (32, 6), generator=torch.Generator().manual_seed(0))
    result = tiekit.fit(
        TiedLM,
        TensorDataset(ids, ids),
        loss_fn=loss_fn,
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
        strategy=strategy,
        devices=2,
        batch_size=4,
        max_steps=4,
        checkpoint_dir=out,
        checkpoint_every=2,
        progress=False,
    )
    # Every process that called fit gets the result (under torchrun: both; else this one).
    assert result.world_size == 2 and result.ties_kept and result.replicas_identical
    assert result.checkpoint is not None and result.checkpoint.name == "step-00000004.safetensors"
    fresh = TiedLM()
    fresh.head.weight = nn.Parameter(torch.zeros(32, 8))  # a broken tie
    tiekit.load_model(fresh, result.checkpoint)
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, result.model.embed.weight)
    print(f"{result.strategy} on {result.world_size}: {sorted(p.name for p in out.glob('step-*'))}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/fit"), "xla" if "--xla" in sys.argv else "ddp")
