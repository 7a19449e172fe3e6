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

    .venv-latest/bin/python benchmarks/bench_load_sharded.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from transformers import GPT2Config, GPT2LMHeadModel

import tiekit
from tiekit.dcp.damage import damaged_structure
from tiekit.dcp.records import dcp_metadata


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
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


if __name__ == "__main__":
    main()
