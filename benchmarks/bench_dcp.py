"""Sharded tied checkpoints against plain torch.distributed.checkpoint, issue 12 targets:

* ``tiekit.save_sharded`` at most 1.05x a plain DCP save of the same state at 2 ranks (and
  smaller on disk): GPT-2 small from its config, FSDP2-sharded by ``tiekit.shard`` on 2 gloo
  processes; the plain save is ``dcp.save(model.state_dict())`` (both tied names, as DCP users
  write it), and, for the overhead alone, ``dcp.save`` of the de-duplicated state (same bytes);
* ``tiekit.convert`` of GPT-2 small (a ``save_sharded`` folder to one tied safetensors file) at
  most 1.2x a plain read + write of its bytes (every file of the folder read, the same bytes
  written to one file, fsynced as convert fsyncs): a folder saved by one process (each tensor
  one chunk, read directly) and the one the 2 ranks saved (two chunks per tensor, assembled by
  DCP's reader).
* ``tiekit.convert`` streams: its peak memory (RSS growth of a fresh process) about the largest
  tensor, not the model, both ways (folder to file, file to folder), against a plain conversion
  that holds the state (``dcp.load`` + ``safetensors.torch.save_file``, and back).

Every contender runs in the same processes, interleaved (each takes every position in turn),
``--repeats`` times, after an ``os.sync()`` so no contender pays for another's writes; best and
median are shown, and the load average (the machine may be shared).

    .venv/bin/python benchmarks/bench_dcp.py [--repeats 9] [--small] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import tiekit

WORLD = 2


def gpt2_small(small: bool) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    size = dict(n_layer=2, n_embd=128, n_head=2) if small else dict(n_layer=12, n_embd=768, n_head=12)
    return GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=1024, use_cache=False, **size))


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save_worker(rank: int, port: int, small: bool, repeats: int, out: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    time_saves(rank, small, repeats, out)  # its sharded model gone on return: it keeps the group,
    tiekit.clear_dtensor_caches()  # and so do torch 2.14's DTensor caches (gloo can abort at exit)
    dist.barrier()
    dist.destroy_process_group()


def time_saves(rank: int, small: bool, repeats: int, out: Path) -> None:
    """Collective: each contender saves GPT-2 sharded ``repeats`` times; rank 0 writes save.json."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    torch.manual_seed(0)
    model = tiekit.shard(gpt2_small(small))
    plan = tiekit.find_ties(model)

    # Each contender reads the model's state at save time, as a training loop saving every N
    # steps does (model.state_dict() is part of a plain DCP save's cost, as reading the model is
    # part of save_sharded's).
    def unique() -> dict[str, torch.Tensor]:
        return {k: v for k, v in model.state_dict().items() if plan.source_of(k) == k}

    contenders = {
        "save_sharded": lambda path: tiekit.save_sharded(model, path),
        "dcp.save": lambda path: save(model.state_dict(), storage_writer=FileSystemWriter(path)),
        "dcp.save dedup": lambda path: save(unique(), storage_writer=FileSystemWriter(path)),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for repeat in range(repeats):
        for name in names[repeat % 3 :] + names[: repeat % 3]:  # each contender first, second, third in turn
            path = out / name.replace(" ", "-")
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)  # each save into an empty folder, untimed
            os.sync()  # the previous contender's dirty pages reach the disk before this one starts
            dist.barrier()
            start = time.perf_counter()
            contenders[name](path)
            dist.barrier()  # the time of a save is its slowest rank's
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        sizes = {name: disk_bytes(out / name.replace(" ", "-")) for name in contenders}
        (out / "save.json").write_text(json.dumps({"times": times, "bytes": sizes}))


def bench_save(args: argparse.Namespace, root: Path) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = root / "save"
    out.mkdir()
    mp.spawn(save_worker, args=(port, args.small, args.repeats, out), nprocs=WORLD, join=True)
    result: dict = json.loads((out / "save.json").read_text())
    (out / "save_sharded").rename(root / "gpt2-2-ranks")  # converted below: two chunks per tensor
    shutil.rmtree(out, ignore_errors=True)
    return result


def plain_copy(src: Path, dst: Path) -> None:
    """Read every file of ``src`` and write the bytes to one file ``dst``, fsynced: the floor."""
    with open(dst, "wb") as out:
        for file in sorted(src.rglob("*")):
            if file.is_file():
                with open(file, "rb") as f:
                    while block := f.read(64 << 20):
                        out.write(block)
        out.flush()
        os.fsync(out.fileno())


def bench_convert(args: argparse.Namespace, root: Path) -> dict:
    torch.manual_seed(0)
    model = gpt2_small(args.small)
    source = root / "gpt2"
    tiekit.save_sharded(model, source)
    del model  # the process still holds transformers and torch, as a user's would
    sharded = root / "gpt2-2-ranks"
    target = root / "out"
    contenders = {
        "tiekit.convert": lambda: tiekit.convert(source, target.with_suffix(".safetensors")),
        "read + write": lambda: plain_copy(source, target),
        "tiekit.convert 2 ranks": lambda: tiekit.convert(sharded, target.with_suffix(".safetensors")),
        "read + write 2 ranks": lambda: plain_copy(sharded, target),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for repeat in range(args.repeats):
        for name in names[repeat % 4 :] + names[: repeat % 4]:
            target.unlink(missing_ok=True)
            target.with_suffix(".safetensors").unlink(missing_ok=True)
            os.sync()
            start = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - start)
    target.unlink(missing_ok=True)
    target.with_suffix(".safetensors").unlink(missing_ok=True)
    return {"times": times, "bytes": disk_bytes(source)}


# Runs in a fresh process: the peak RSS growth (VmHWM after a reset) of one conversion.
MEMORY = """
import pathlib, sys
import torch
import tiekit

def peak():
    status = pathlib.Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024

how, src, dst = sys.argv[1:4]
if how.startswith("plain"):
    import safetensors.torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
pathlib.Path("/proc/self/clear_refs").write_text("5")
before = peak()
if how.startswith("tiekit"):
    tiekit.convert(src, dst)
elif how == "plain to file":  # the whole state read, then written
    folder = next(pathlib.Path(src).glob("save-*"))
    meta = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    tensors = {k: m for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in tensors.items()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    safetensors.torch.save_file(state, dst)
else:
    dcp.save(safetensors.torch.load_file(src), storage_writer=dcp.FileSystemWriter(dst), no_dist=True)
print(peak() - before)
"""


def bench_convert_memory(root: Path) -> dict[str, int]:
    """Peak RSS growth of each conversion of the GPT-2 folder ``root / "gpt2"``, each in a fresh process."""
    folder, file = root / "gpt2", root / "memory.safetensors"
    growth = {}
    for how, src, dst in (
        ("tiekit folder to file", folder, file),
        ("tiekit file to folder", file, root / "memory-back"),
        ("plain to file", folder, root / "plain.safetensors"),
        ("plain to folder", file, root / "plain-back"),
    ):
        done = subprocess.run(
            [sys.executable, "-c", MEMORY, how, str(src), str(dst)], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{how}: {done.stderr[-2000:]}")
        growth[how] = int(done.stdout.split()[-1])
    return growth


def summary(times: list[float]) -> str:
    return f"best {min(times):.3f} s, median {statistics.median(times):.3f} s"


def ratios(a: list[float], b: list[float]) -> str:
    return f"{min(a) / min(b):.2f}x best, {statistics.median(a) / statistics.median(b):.2f}x median"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--small", action="store_true", help="a 2-layer GPT-2 (a quick check of the script)")
    parser.add_argument("--dir", help="where the checkpoints go (default: a folder beside this script)")
    args = parser.parse_args()
    base = Path(args.dir) if args.dir else Path(__file__).resolve().parent
    root = Path(tempfile.mkdtemp(prefix="bench-dcp-", dir=base))
    loads = [os.getloadavg()[0]]
    try:
        started = time.perf_counter()
        save = bench_save(args, root)
        loads.append(os.getloadavg()[0])
        times, sizes = save["times"], save["bytes"]
        name = "(2 layers)" if args.small else "small"
        print(f"GPT-2 {name}, FSDP2 on {WORLD} gloo processes, {args.repeats} saves each, interleaved")
        for contender, label in (
            ("save_sharded", "tiekit.save_sharded"),
            ("dcp.save", "dcp.save(model.state_dict())"),
            ("dcp.save dedup", "dcp.save of the de-duplicated state"),
        ):
            print(f"  {label}: {summary(times[contender])}, {sizes[contender] / 1e6:.1f} MB on disk")
        print(
            f"  save_sharded / dcp.save: {ratios(times['save_sharded'], times['dcp.save'])} (target <= 1.05x); "
            f"bytes {sizes['save_sharded'] / sizes['dcp.save']:.2f}x"
        )
        print(f"  save_sharded / dcp.save of the same bytes: {ratios(times['save_sharded'], times['dcp.save dedup'])}")
        conv = bench_convert(args, root)
        loads.append(os.getloadavg()[0])
        times = conv["times"]
        print(f"convert, {conv['bytes'] / 1e6:.1f} MB save_sharded folder -> one tied safetensors file")
        for suffix, what in (("", "saved by 1 process (one chunk per tensor)"), (" 2 ranks", "saved by the 2 ranks")):
            print(f"  {what}: tiekit.convert {summary(times['tiekit.convert' + suffix])}; read + write of the "
                  f"same bytes (fsynced) {summary(times['read + write' + suffix])}")  # fmt: skip
            ratio = ratios(times["tiekit.convert" + suffix], times["read + write" + suffix])
            print(f"    convert / read + write: {ratio} (target <= 1.2x)")
        memory = bench_convert_memory(root)
        model = gpt2_small(args.small)
        largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
        print(f"convert, peak RSS growth (fresh process; largest tensor {largest / 2**20:.0f} MiB, "
              f"checkpoint {conv['bytes'] / 2**20:.0f} MiB)")  # fmt: skip
        for way, plain in (("folder to file", "plain to file"), ("file to folder", "plain to folder")):
            ours, theirs = memory["tiekit " + way], memory[plain]
            print(f"  {way}: tiekit.convert {ours / 2**20:.0f} MiB ({ours / largest:.2f}x the largest tensor), "
                  f"plain {theirs / 2**20:.0f} MiB ({theirs / largest:.2f}x); ratio {ours / theirs:.2f}x")  # fmt: skip
        shown = ", ".join(f"{x:.1f}" for x in loads)
        print(f"({time.perf_counter() - started:.0f} s in all; 1-minute load average at start, after save, end: {shown}"
              f" on {os.cpu_count()} CPUs)")  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
