"""What the ``tiekit`` command costs, against the floors measured in the same run.

    .venv/bin/python benchmarks/bench_cli.py [--repeats 5] [--small]

GPT-2 small from a config (124M parameters, 498 MB fp32, wte/lm_head tied):

* ``tiekit inspect module:factory`` builds on the meta device: its peak resident memory above a
  process that only imports torch, tiekit and the model's module should be a small fraction of
  the model's bytes (target < 5%), where building on the CPU costs them all (fresh subprocesses,
  VmHWM);
* ``tiekit inspect PATH`` reads headers only, so its time does not grow with the data: against
  ``safe_open`` reading the same header (the floor; target < 5x, tiekit validates every entry in
  Python) and against reading the file's bytes once (target < 2% of that);
* ``tiekit verify`` = build on meta + ``tiekit.load_model`` + checks: its time against build on
  meta + ``load_model`` alone (the floor; target < 1.2x);
* ``tiekit inspect FOLDER --check-values`` of a plain ``dcp.save`` folder of the model's state dict
  (the tie stored under both names): peak resident memory above the imports, against the largest
  tensor (it reads one tensor at a time); ``--baseline DIR`` runs it with another tiekit source tree
  too (a folder holding a ``tiekit`` package, e.g. ``git archive HEAD~1 tiekit | tar -x -C DIR``).

Every process imports the tiekit of this script's tree.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _timing import best_times
from safetensors import safe_open
from safetensors.torch import load_file

import tiekit
from tiekit import inspection

FACTORY = """
from transformers import GPT2Config, GPT2LMHeadModel


def gpt2():
    config = GPT2Config({config})
    return GPT2LMHeadModel(config)
"""
SMALL = "n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64, bos_token_id=0, eos_token_id=0"
FULL = "n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, bos_token_id=0, eos_token_id=0"

PEAK = """
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        print(int(line.split()[1]) * 1024)
"""


ROOT = Path(__file__).resolve().parent.parent


def peak_rss(body: str, cwd: Path, tree: Path = ROOT) -> tuple[int, float]:
    """Peak resident bytes and wall time of a fresh interpreter running ``body`` with the tiekit of ``tree``."""
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": os.pathsep.join([str(tree), str(cwd)])}
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", body + "\n" + PEAK],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        check=True,
    )
    return int(out.stdout.split()[-1]), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="a tiny GPT-2, to check the script quickly")
    parser.add_argument("--baseline", type=Path, action="append", default=[], help="another tiekit tree")
    parser.add_argument("--check-values-only", action="store_true", help="only the --check-values case")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "bench_factories.py").write_text(FACTORY.format(config=SMALL if args.small else FULL))
        sys.path.insert(0, str(folder))
        from bench_factories import gpt2  # type: ignore[import-not-found]

        model = gpt2()
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        path = folder / "model.safetensors"
        tiekit.save_model(model, path)
        del model
        print(f"GPT-2 {'tiny' if args.small else 'small'}: {model_bytes / 1e6:.0f} MB of unique fp32 parameters")

        # 4 first (the quick one to run alone): inspect --check-values of a plain DCP folder.
        check_values(gpt2, folder, args.baseline)
        if args.check_values_only:
            return

        # 1. Memory of inspecting a factory: meta against the CPU, above the imports alone.
        imports = "import torch, tiekit.inspection\nfrom transformers import GPT2Config, GPT2LMHeadModel"
        floor, _ = peak_rss(imports, folder)
        meta, meta_time = peak_rss(
            imports + "\nfrom tiekit.cli import main\nmain(['inspect', 'bench_factories:gpt2', '--json'])", folder
        )
        cpu, cpu_time = peak_rss(imports + "\nfrom bench_factories import gpt2\ngpt2()", folder)
        print("\ninspect module:factory, peak RSS above importing torch, tiekit and GPT-2 (fresh processes):")
        for name, peak in (("tiekit inspect (meta)", meta), ("factory on the CPU", cpu)):
            print(f"  {name:24s} {(peak - floor) / 1e6:7.1f} MB = {(peak - floor) / model_bytes:6.1%} of the model")
        print(f"  wall time, whole process: meta {meta_time:.1f} s, CPU {cpu_time:.1f} s")

        # 2. inspect PATH reads headers only.
        def header_floor() -> None:
            with safe_open(path, "pt") as f:
                f.keys()
                f.metadata()

        times = best_times(
            {
                "safe_open header (floor)": header_floor,
                "tiekit inspect_file": lambda: inspection.inspect_file(path),
                "safetensors load_file (mmap)": lambda: load_file(path),
                "read the file's bytes": path.read_bytes,
            },
            repeats=args.repeats,
        )
        floor_t = times["safe_open header (floor)"]
        print(f"\ninspect PATH ({path.stat().st_size / 1e6:.0f} MB file, best of {args.repeats}):")
        for name, t in times.items():
            print(f"  {name:30s} {t * 1e3:8.2f} ms  {t / floor_t:7.2f}x the floor")

        # 3. verify = build on meta + load + checks, against build on meta + load.
        def load_floor() -> None:
            with torch.device("meta"):
                fresh = gpt2()
            tiekit.load_model(fresh, path)

        times = best_times(
            {
                "meta build + load_model (floor)": load_floor,
                "verify_checkpoint": lambda: inspection.verify_checkpoint(path, "bench_factories:gpt2"),
            },
            repeats=args.repeats,
        )
        floor_t = times["meta build + load_model (floor)"]
        print(f"\nverify (best of {args.repeats}):")
        for name, t in times.items():
            print(f"  {name:32s} {t * 1e3:8.1f} ms  {t / floor_t:5.2f}x the floor")


def check_values(gpt2: Callable[[], torch.nn.Module], folder: Path, baselines: list[Path]) -> None:
    """Peak RSS of ``tiekit inspect FOLDER --check-values`` on a plain ``dcp.save`` folder."""
    import warnings

    from torch.distributed.checkpoint import save

    state = gpt2().state_dict()
    largest = max(t.nbytes for t in state.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "torch.distributed is disabled ... single process"
        save(state, checkpoint_id=folder / "plain", no_dist=True)
    del state
    imports = "import torch, tiekit.cli, tiekit.dcp.report, torch.distributed.checkpoint"
    run = imports + f"\ntiekit.cli.main(['inspect', {str(folder / 'plain')!r}, '--check-values', '--json'])"
    print("\ninspect FOLDER --check-values (plain dcp.save folder), peak RSS above the imports:")
    for name, tree in [("tiekit", ROOT), *((f"tiekit {d.name}", d) for d in baselines)]:
        floor, _ = peak_rss(imports, folder, tree)
        peak, seconds = peak_rss(run, folder, tree)
        growth = peak - floor
        print(f"  {name:24s} {growth / 1e6:7.1f} MB = {growth / largest:5.2f}x the largest tensor, {seconds:.1f} s")


if __name__ == "__main__":
    main()
