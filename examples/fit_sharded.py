"""The tied LM of tied_lm.py trained sharded by `tiekit.fit`, its tie kept on every device.

    .venv/bin/python examples/fit_sharded.py                                        # FSDP2, 2 CPU processes
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv/bin/python examples/fit_sharded.py spmd_fsdp   # XLA SPMD, 4 devices

``"fsdp"``: fit spawns 2 processes (gloo), each holding half of every unit's weights, the
embedding and the output layer in one FSDP unit. ``"spmd_fsdp"``: one process drives every XLA
device, each parameter (the tied one once) sharded on its first dimension over the devices.
Either way the trained model comes back whole, with its tie.
"""

from __future__ import annotations

import sys

import tied_lm

import tiekit


def main(strategy: str) -> None:
    devices = 2 if strategy == "fsdp" else "auto"
    result = tiekit.fit(
        tied_lm.build, tied_lm.corpus(), strategy=strategy, devices=devices, max_steps=20, batch_size=8, progress=False
    )
    model = result.model
    print(f"{result.strategy} on {result.world_size} devices: loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}")
    tied = model.head.weight is model.embed.weight
    print(f"ties kept on every device: {result.ties_kept}; head.weight is embed.weight: {tied}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fsdp")
