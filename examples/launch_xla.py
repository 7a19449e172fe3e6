"""torch_xla.launch: one replica per XLA device, each saving the tied model the two ways.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 python examples/launch_xla.py runs/xla     # XLA:CPU, 2 devices
    python examples/launch_xla.py runs/xla                                       # on a TPU VM

On XLA:CPU the replicas are threads of one process; on a TPU host, processes. tiekit tells
them apart either way (``tiekit.is_writer()`` is true on global ordinal 0), and its
collectives meet the replicas without compiling an XLA collective (on XLA:CPU, two threads
compiling the same collective at once abort; see docs/launching.md).

* one writer: ``if tiekit.is_writer(): tiekit.save_model(...)``, then
  ``collective_barrier()`` before the other replicas read the file;
* every replica calls ``tiekit.collective_save_model``: one shared path is written once, and
  per-replica paths each by their replica.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch_xla
import torch_xla.runtime as xr
from torch import nn

import tiekit
from tiekit.collective import collective_barrier


class TiedLM(nn.Module):
    """An embedding whose matrix is also the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight


def build() -> TiedLM:
    """The same weights in every replica: the launch threads share torch's global RNG, so the
    weights come from a generator of their own, never from racing ``torch.manual_seed`` calls."""
    model = TiedLM()
    with torch.no_grad():
        model.embed.weight.copy_(torch.randn(32, 8, generator=torch.Generator().manual_seed(0)))
    return model


def replica(index: int, out: Path) -> None:
    """One replica (``index``: its ordinal on this host): move the model to its device, tie kept;
    save; read the files back on the host."""
    ordinal = xr.global_ordinal()
    model = build()
    tiekit.move(model, torch_xla.device())
    assert model.head.weight is model.embed.weight

    if tiekit.is_writer():
        tiekit.save_model(model, out / "writer.safetensors")
    collective_barrier()
    tiekit.collective_save_model(model, out / "shared.safetensors")
    tiekit.collective_save_model(model, out / f"replica{ordinal}.safetensors")
    collective_barrier()

    for name in ("writer.safetensors", "shared.safetensors", *(f"replica{r}.safetensors" for r in range(2))):
        if not (out / name).exists():
            continue  # a one-device run has no replica1
        fresh = TiedLM()
        fresh.head.weight = nn.Parameter(torch.zeros(32, 8))  # a broken tie
        tiekit.load_model(fresh, out / name)
        assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.embed.weight, build().embed.weight)
    print(f"replica {ordinal} of {xr.world_size()}: saved and reloaded tied", flush=True)


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/xla")
    target.mkdir(parents=True, exist_ok=True)
    torch_xla.launch(replica, args=(target,))
