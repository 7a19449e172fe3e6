"""A process that commits a sharded checkpoint, then dies by SIGKILL in the middle of the next save.

    python tests/dcp_kill_worker.py PATH MODE WHEN

MODE is ``blocking`` or ``async``. WHEN is where the second save is killed: ``partial`` (a
thread watching the shard file kills the process once part of it is on disk), ``metadata`` (as
DCP opens its ``.metadata``: every shard written), or ``marker`` (as tiekit opens its new marker:
everything written but the commit). The first save's weights go to ``PATH.reference.safetensors``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tiekit

ROWS, DIM = 4096, 4096  # a 64 MiB embedding: its write takes long enough to be caught half way


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(ROWS, DIM)
        self.mlp = nn.Linear(DIM, 8)
        self.head = nn.Linear(DIM, ROWS, bias=False)
        self.head.weight = self.embed.weight


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_on_open(name: str) -> None:
    """SIGKILL this process as it opens a file called ``name`` (or ``name``.tmp...) for writing."""

    def hook(event: str, args: tuple) -> None:
        writing = event == "open" and isinstance(args[0], str | os.PathLike) and "w" in str(args[1] or "")
        if writing and Path(os.fsdecode(args[0])).name.startswith(name):
            die()

    sys.addaudithook(hook)


def kill_when_partly_written(root: Path, first_folder: str) -> None:
    """SIGKILL this process once a shard file of a new save holds some bytes but not all."""
    full = ROWS * DIM * 4

    def watch() -> None:
        while True:
            for shard in root.glob("save-*/*.distcp"):
                if shard.parent.name != first_folder and 0 < shard.stat().st_size < full:
                    die()
            time.sleep(0.0005)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    path, mode, when = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    model = Tied()
    tiekit.save_sharded(model, path)
    tiekit.save_model(model, path.with_name(path.name + ".reference.safetensors"))
    first = next(path.glob("save-*")).name
    with torch.no_grad():
        model.embed.weight.add_(1.0)  # the second save holds other values
    if when == "partial":
        kill_when_partly_written(path, first)
    else:
        kill_on_open({"metadata": ".metadata", "marker": tiekit.dcp.MARKER_NAME}[when])
    print("second save starts", flush=True)
    handle = tiekit.save_sharded(model, path, blocking=mode == "blocking")
    for _ in range(200):  # "training" goes on while an asynchronous save writes
        torch.mm(torch.ones(64, 64), torch.ones(64, 64))
    handle.wait(timeout=120)
    print("second save finished: the kill came too late", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    main()
