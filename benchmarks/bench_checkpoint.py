"""Tied checkpoints against plain safetensors, GPT-2 small (124M parameters, tied), issue 4 targets:

* ``tiekit.save_model`` at least 0.9x the throughput of ``safetensors.torch.save_file`` on the
  de-duplicated state dict, compared at equal guarantees: ``durable=False`` (page cache, atomic
  rename) against ``save_file``, the default (fsync before the rename) against ``save_file`` +
  ``fsync``;
* ``tiekit.load_model`` at most 1.1x the time of ``safetensors.torch.load_model`` into a tied model;
* peak resident memory while loading at most model bytes + 20% (measured in fresh subprocesses,
  VmHWM reset after the model is built, against the RSS before the model existed).

    .venv/bin/python benchmarks/bench_checkpoint.py [--repeats 7] [--small] [--dir DIR]

The files go to ``--dir`` (default: a temporary folder next to this script, on the same disk
as a user's checkpoints would be, not tmpfs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import best_times

import tiekit
import tiekit.checkpoint


def gpt2_small(small: bool) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    size = dict(n_layer=2, n_embd=128, n_head=2) if small else dict(n_layer=12, n_embd=768, n_head=12)
    config = GPT2Config(vocab_size=50257, n_positions=1024, use_cache=False, **size)
    return GPT2LMHeadModel(config).eval()


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def synced_times(
    fns: dict[str, Callable[[], object]], repeats: int, cpu: dict[str, list[float]] | None = None
) -> dict[str, list[float]]:
    """Wall times of interleaved repeats; every timed call starts with no dirty pages pending
    (``os.sync()`` before the clock starts), otherwise a writer pays for the previous one's
    writeback. GC is paused while timing. ``cpu`` receives each call's CPU seconds (this
    process's, user + system: the kernel's page-cache work for its writes is billed here)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for name, fn in fns.items():
                os.sync()
                start, used = time.perf_counter(), _cpu_seconds()
                fn()
                times[name].append(time.perf_counter() - start)
                if cpu is not None:
                    cpu.setdefault(name, []).append(_cpu_seconds() - used)
    finally:
        gc.enable()
    return times


def time_save_and_load(folder: Path, repeats: int, small: bool) -> None:
    from safetensors.torch import load_model, save_file

    model = gpt2_small(small)
    size = model_bytes(model)
    print(f"GPT-2 {'(reduced)' if small else 'small'}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M")
    print(f"unique parameters, {size / 1e6:.0f} MB, tied wte/lm_head; files in {folder}")
    dedup = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    plain, ours = folder / "plain.safetensors", folder / "tiekit.safetensors"

    def save_file_fsync() -> None:
        save_file(dedup, plain)
        fsync(plain)

    cpu: dict[str, list[float]] = {}
    save = synced_times(
        {
            "safetensors.save_file (dedup)": lambda: save_file(dedup, plain),
            "tiekit.save_model(durable=False)": lambda: tiekit.save_model(model, ours, durable=False),
            "safetensors.save_file + fsync": save_file_fsync,
            "tiekit.save_model (durable)": lambda: tiekit.save_model(model, ours),
        },
        repeats,
        cpu,
    )
    assert os.path.getsize(ours) - os.path.getsize(plain) < 64 * 1024, "tiekit's file should be the dedup size"
    print("  save (best / median of the runs; throughput = save_file's time / this time):")
    best = {name: min(t) for name, t in save.items()}
    median = {name: statistics.median(t) for name, t in save.items()}
    plain_name, synced_name = "safetensors.save_file (dedup)", "safetensors.save_file + fsync"
    for name in save:
        vs_plain = f"{best[plain_name] / best[name]:4.2f}x / {median[plain_name] / median[name]:4.2f}x"
        vs_synced = f"{best[synced_name] / best[name]:4.2f}x / {median[synced_name] / median[name]:4.2f}x"
        print(
            f"  {name:38s} {best[name] * 1e3:6.0f} / {median[name] * 1e3:6.0f} ms  "
            f"{size / best[name] / 1e9:5.2f} GB/s  throughput vs save_file {vs_plain}, vs save_file + fsync {vs_synced}"
        )

    print("  CPU seconds of this process per save (median; a background save takes them from training):")
    for name, values in cpu.items():
        print(f"  {name:38s} {statistics.median(values) * 1e3:6.0f} ms")

    fast = median[plain_name] / median["tiekit.save_model(durable=False)"]
    durable = median[synced_name] / median["tiekit.save_model (durable)"]
    print(
        f"  targets (medians, equal guarantees): durable=False vs save_file {fast:.2f}x >= 0.9: "
        f"{'met' if fast >= 0.9 else 'MISSED'}; durable vs save_file + fsync {durable:.2f}x >= 0.9: "
        f"{'met' if durable >= 0.9 else 'MISSED'}"
    )

    target = gpt2_small(small)
    load = best_times(
        {
            "safetensors.load_model (tied)": lambda: load_model(target, ours),
            "tiekit.load_model (tied)": lambda: tiekit.load_model(target, ours),
        },
        repeats,
    )
    assert target.lm_head.weight is target.transformer.wte.weight
    base = load["safetensors.load_model (tied)"]
    for name, t in load.items():
        print(f"  {name:34s} {t * 1e3:8.1f} ms  {t / base:4.2f}x safetensors.load_model time")


MEMORY_PROBE = r"""
import gc, json, sys, torch
sys.path.insert(0, {bench!r})
from bench_checkpoint import gpt2_small, model_bytes
import tiekit
from safetensors.torch import load_model

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

mode, path, small = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
import transformers.models.gpt2  # imported before the baseline: its own memory is not the load's
gpt2_small(True)
gc.collect()
before = status("VmRSS:")
if mode == "tiekit meta":
    with torch.device("meta"):
        model = gpt2_small(small)
else:
    model = gpt2_small(small)
size = model_bytes(model) if mode != "tiekit meta" else sum(p.numel() * p.element_size() for p in model.parameters())
gc.collect()
built = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM: the peak of building the model does not count
if mode == "safetensors":
    load_model(model, path)
else:
    tiekit.load_model(model, path)
peak = status("VmHWM:")
assert model.lm_head.weight is model.transformer.wte.weight
print(json.dumps({{"before": before, "built": built, "peak": peak, "size": size}}))
"""


def measure_memory(folder: Path, small: bool) -> None:
    path = folder / "tiekit.safetensors"
    if not path.exists():
        tiekit.save_model(gpt2_small(small), path)
    probe = MEMORY_PROBE.format(bench=str(Path(__file__).resolve().parent))
    print("peak resident memory while loading (RSS before the model existed subtracted):")
    for mode in ("tiekit (tied CPU model)", "tiekit meta", "safetensors"):
        out = subprocess.run(
            [sys.executable, "-c", probe, mode, str(path), "1" if small else "0"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        r = json.loads(out.strip().splitlines()[-1])
        used = r["peak"] - r["before"]
        print(
            f"  {mode:26s} {used / 1e6:7.0f} MB for {r['size'] / 1e6:.0f} MB of model: "
            f"model bytes + {100 * (used / r['size'] - 1):5.1f}% "
            f"(the load itself added {(r['peak'] - r['built']) / 1e6:.0f} MB over the built model)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--small", action="store_true", help="a reduced model, for a quick check")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the files")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    folder = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir or Path(__file__).resolve().parent))
    try:
        start = time.perf_counter()
        time_save_and_load(folder, args.repeats, args.small)
        gc.collect()
        if not args.skip_memory:
            measure_memory(folder, args.small)
        print(f"({time.perf_counter() - start:.0f} s)")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
