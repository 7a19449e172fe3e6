"""The torchrun example's four save patterns, in processes started by torch.multiprocessing.spawn.

    python examples/launch_spawn.py runs/launch-spawn

The script starts two processes itself (gloo on 127.0.0.1, the CPU); each joins the group and
runs `launch_torchrun.save_patterns`: one writer plus a barrier, a collective save to one path,
per-rank paths, and a failing writer reported on every rank.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from launch_torchrun import TiedLM, save_patterns

WORLD = 2


def worker(rank: int, port: int, out: Path) -> None:
    """One spawned process: join the group, save every way, leave the group."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)  # the same weights in every process
    try:
        save_patterns(TiedLM(), out)
        dist.barrier()  # every rank done with the group before one leaves it (gloo may abort at exit)
    finally:
        dist.destroy_process_group()


def main(out: Path) -> None:
    """Pick a free port, spawn the processes, wait for both (an error in one is raised here)."""
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, out), nprocs=WORLD)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/launch-spawn"))
