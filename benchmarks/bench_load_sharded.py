"""``tiekit.load_sharded`` against a plain ``dcp.load`` of the same folder, and what its check of
the records costs.

``load_sharded`` checks, before DCP reads anything into the model, that every record it will read
in place is whole (zip directory, pickle, data header; `tiekit.dcp.damage.damaged_structure`), so
that a record damaged in place leaves the model untouched instead of half loaded. This script
measures that check's share of a load: GPT-2 small from its config (148 records), saved by
``tiekit.save_sharded`` in one process; contenders, interleaved, ``--repeats`` times each, after
a first load that brings the files into the page cache (the check reads a few hundred bytes a
record; a cold read would hide it behind the tensors' bytes):

* ``dcp.load``: DCP's own load of the folder into the model's state dict (the de-duplicated names,
  as stored), no validation;
* ``load_sharded``: tiekit's, validation, the check and the re-tie included;
* the check alone (``damaged_structure`` over every record).

Then, with ``--memory-mib N`` (0 to skip), peak RSS growth (VmHWM reset after the model is
built) of loads in fresh processes of a model whose tied embedding is N MiB (plus a 1024 x 1024
linear layer), saved by ``save_sharded``, in units of the embedding: ``load_sharded`` into a CPU
model and into a meta model, against ``dcp.load`` of the same folder into the CPU model's state
dict, interleaved ``--memory-repeats`` times (median, range).

    .venv-latest/bin/python benchmarks/bench_load_sharded.py [--repeats 9] [--memory-mib 1000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from transformers import GPT2Config, GPT2LMHeadModel

import tiekit
from tiekit.dcp.damage import damaged_structure
from tiekit.dcp.records import dcp_metadata

ROOT = Path(__file__).resolve().parent.parent

PEAK = """
import pathlib, sys, torch, tiekit
import torch.distributed.checkpoint as dcp
from torch import nn

path, into, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
WIDTH = 1024
VOCAB = mib * 2**20 // (4 * WIDTH)

class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mlp = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

def rss(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

if into == "save":
    with torch.device("meta"):
        model = Tied()
    model.to_empty(device="cpu")
    model.head.weight = model.embed.weight
    torch.nn.init.normal_(model.embed.weight)
    tiekit.save_sharded(model, path)
    sys.exit()
warm = nn.Linear(4, 4)  # DCP's and torch.load's imports done: a first load of anything pays them
tiekit.save_sharded(warm, path + "-warm")
tiekit.load_sharded(warm, path + "-warm")
with torch.device("meta"):
    model = Tied()
if into != "meta":
    model.to_empty(device="cpu")
    model.head.weight = model.embed.weight
    for tensor in model.parameters():
        tensor.detach().zero_()  # in memory already: an allocated model's pages are not the load's
before = rss("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM: building the model does not count
import time
started = time.perf_counter()
if into == "dcp.load":
    (save,) = pathlib.Path(path).glob("save-*")
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # as stored: once
    dcp.load(state, storage_reader=dcp.FileSystemReader(save), no_dist=True)
else:
    tiekit.load_sharded(model, path)
    assert model.head.weight is model.embed.weight
print((rss("VmHWM:") - before) / (VOCAB * WIDTH * 4), time.perf_counter() - started)
"""


def peak(path: Path, into: str, mib: int) -> tuple[float, float]:
    """(peak RSS growth in units of the embedding, seconds) of one load in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", PEAK, str(path), into, str(mib)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    ).stdout
    if into == "save":
        return 0.0, 0.0
    growth, seconds = out.strip().splitlines()[-1].split()
    return float(growth), float(seconds)


def memory(mib: int, repeats: int) -> None:
    contenders = ("load_sharded, CPU model", "load_sharded, meta model", "dcp.load, CPU model")
    intos = dict(zip(contenders, ("cpu", "meta", "dcp.load"), strict=True))
    found: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "big"
        peak(path, "save", mib)
        for _ in range(repeats):
            for name in contenders:
                found[name].append(peak(path, intos[name], mib))
    print(f"a {mib} MiB tied embedding, peak RSS growth in units of it ({repeats} fresh processes each, median):")
    for name, runs in found.items():
        growth = [g for g, _ in runs]
        seconds = statistics.median(s for _, s in runs)
        print(
            f"  {name:26} {statistics.median(growth):5.2f}x ({min(growth):.2f}-{max(growth):.2f}), "
            f"{statistics.median(growth) * mib:6.0f} MiB, {seconds:.2f} s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--memory-mib", type=int, default=1000)
    parser.add_argument("--memory-repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "gpt2"
        tiekit.save_sharded(model, path)
        (save,) = path.glob("save-*")
        metadata = dcp_metadata(save)
        stored = set(metadata.state_dict_metadata)
        state = {k: v for k, v in model.state_dict().items() if k in stored}

        def plain() -> None:
            dcp.load(state, storage_reader=dcp.FileSystemReader(save), no_dist=True)

        def tiekits() -> None:
            tiekit.load_sharded(model, path)

        def check() -> None:
            assert damaged_structure(save, metadata, dict.fromkeys(stored)) is None

        contenders = {"dcp.load": plain, "load_sharded": tiekits, "the check alone": check}
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for run in contenders.values():
            run()  # the files into the page cache, torch's lazy imports done
        for _ in range(args.repeats):
            for name, run in contenders.items():
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
    base = statistics.median(times["dcp.load"])
    print(f"GPT-2 small, {len(metadata.storage_data)} records, {args.repeats} interleaved repeats (median, best):")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"  {name:16} {median * 1e3:7.1f} ms  (best {min(seconds) * 1e3:6.1f})  {median / base:5.2f}x dcp.load")
    if args.memory_mib:
        memory(args.memory_mib, args.memory_repeats)


if __name__ == "__main__":
    main()
