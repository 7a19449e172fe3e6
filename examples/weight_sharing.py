"""The seeds' WeightSharingModule, trained on every core with `tiekit.fit`, tie intact.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 .venv/bin/python examples/weight_sharing.py

Lightning's TPU guide trains this module with ``Trainer(accelerator="tpu", devices=8)`` and
promises the shared weight stays shared after the move to the XLA device. Here the same module
(a plain ``nn.Module``) goes to `tiekit.fit`: one replica per XLA device, a DistributedSampler
per replica, gradients averaged over the replicas, the tie kept on every device.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import tiekit


class WeightSharingModule(nn.Module):
    """The seeds' example, verbatim apart from the base class."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_1 = nn.Linear(32, 10, bias=False)
        self.layer_2 = nn.Linear(10, 32, bias=False)
        self.layer_3 = nn.Linear(32, 10, bias=False)
        # tiekit keeps this after every move, so all you need is to write it as on any device.
        self.layer_3.weight = self.layer_1.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_1(x)
        x = self.layer_2(x)
        x = self.layer_3(x)
        return x


def dataset(size: int = 512, seed: int = 0) -> TensorDataset:
    """Inputs and targets of a noisy linear map the module can learn."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 32, generator=generator)
    true_map = torch.randn(32, 10, generator=generator) / 32**0.5
    return TensorDataset(x, x @ true_map + 0.01 * torch.randn(size, 10, generator=generator))


def main() -> None:
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-2)
    result = tiekit.fit(
        WeightSharingModule, dataset(), loss_fn=F.mse_loss, optimizer=optimizer, epochs=5, batch_size=16, progress=False
    )
    model = result.model
    print(f"strategy {result.strategy!r} on {result.world_size} {result.device_type} device(s), {result.steps} steps")
    print(f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}")
    print(f"replicas bit-identical: {result.replicas_identical}; tie kept on every device: {result.ties_kept}")
    print(f"layer_3.weight is layer_1.weight: {model.layer_3.weight is model.layer_1.weight}")


if __name__ == "__main__":
    main()
