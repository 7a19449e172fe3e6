"""Sharded tied checkpoints: two processes save, one process loads.

    .venv/bin/python examples/sharded_checkpoint.py [OUT_DIR]        (default runs/sharded-checkpoint)

Two gloo processes (started here by torch.multiprocessing.spawn) shard tied_lm's model with
FSDP2 (`tiekit.shard`), take one AdamW step on the same batch and save with
`tiekit.save_sharded`: each process writes its half of every tensor, the tied embedding once.
Then this process, without any process group, loads the folder into a fresh model with
`tiekit.load_sharded` (the tie restored, the optimizer state back) and converts it to one tied
safetensors file with `tiekit.convert`.
"""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from tied_lm import build

import tiekit

WORLD = 2


def trained(model: torch.nn.Module) -> torch.optim.Optimizer:
    """One AdamW step on a fixed batch (the same in every process, so FSDP2's averaged gradient
    is this process's own: the result equals one process training the same step)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(64).remainder(40).view(2, 32)
    loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    optimizer.step()
    return optimizer


def worker(rank: int, port: int, out: Path) -> None:
    """One spawned process: join the group, shard, train a step, save its shards, leave."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)  # the same weights in every process
        model = tiekit.shard(build())
        optimizer = trained(model)
        tiekit.save_sharded(model, out / "ckpt", optimizer=optimizer, extra={"step": 1})  # collective
        del model, optimizer  # a sharded model keeps its process group, and so do torch 2.14's DTensor
        tiekit.clear_dtensor_caches()  # caches: left to interpreter exit, gloo's threads can abort it
        dist.barrier()  # every rank done with the group before one leaves it (gloo may abort at exit)
    finally:
        dist.destroy_process_group()


def main(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, out), nprocs=WORLD)

    files = sorted(p.name for p in (out / "ckpt").glob("save-*/*.distcp"))
    print(f"1. saved by {WORLD} processes: {', '.join(files)}")

    torch.manual_seed(0)
    reference = build()
    trained(reference)  # one process, the same step: what the checkpoint should hold
    torch.manual_seed(1)
    model = build()  # other weights, to be replaced
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    result = tiekit.load_sharded(model, out / "ckpt", optimizer=optimizer)  # no process group needed
    pairs = zip(model.state_dict().values(), reference.state_dict().values(), strict=True)
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in pairs)
    print(f"2. loaded in 1 process: head.weight is embed.weight: {model.head.weight is model.embed.weight}, "
          f"same weights as training in one process: {same}, extra: {result.extra}, "
          f"optimizer state for {len(optimizer.state)} parameters")  # fmt: skip

    converted = tiekit.convert(out / "ckpt", out / "model.safetensors")
    stored = load_file(out / "model.safetensors")
    embed, head = "embed.weight" in stored, "head.weight" in stored
    print(f"3. converted to {Path(converted.files[0]).name}: {len(stored)} tensors, "
          f"embed.weight stored: {embed}, head.weight stored: {head}")  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/sharded-checkpoint"))
