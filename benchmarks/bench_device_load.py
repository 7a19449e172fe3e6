"""Moves and loads onto XLA at the memory floor (issue 13): transfers, bytes, time, peak RSS growth.

Each case runs in a fresh process (XLA:CPU; device buffers are host memory there, so RSS counts
them too), with a GPT-2 small built from its config (124M parameters, tied embedding):

* ``.to(xla)`` vs ``tiekit.move`` of a model with real weights;
* loading a 498 MB tied checkpoint into a meta model on XLA: ``tiekit.load_model(device="xla")``
  against a plain safetensors ``load_file`` + ``load_state_dict(assign=True)`` + ``.to(xla)``;
* with ``--in-place``, loading it into a model already on XLA (its tensors overwritten in place),
  from the file and from a `tiekit.save_sharded` folder of the same weights (``load_sharded``).

Every case reports host-to-device transfers and bytes (torch_xla's ``TransferToDeviceTime`` and
``OutboundData`` metrics), time until every device buffer is ready (``_on_ready_callback``: XLA:CPU
fills buffers on its own threads after the transfer call returns), and peak RSS growth (``VmHWM``
reset just before the case).
``--repeats`` rounds run every case once each, interleaved, each round starting one case later;
ratios are taken within a round.
``--baseline DIR`` adds ``load_model`` from another tiekit source tree (a folder holding a
``tiekit`` package, e.g. ``git archive caba64f tiekit | tar -x -C DIR``), run in the same rounds.

    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_device_load.py [--layers 12] [--repeats 5]
        [--vocab 50257] [--width 768] [--in-place]
        [--baseline DIR ...] [--staging-mib N] [--loads-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

CASE = textwrap.dedent(
    """
    import ctypes, json, os, sys, threading, time, warnings
    warnings.filterwarnings("ignore")
    import torch, torch_xla, transformers
    import torch_xla.debug.metrics as met
    import safetensors.torch
    import tiekit

    case, path, layers, staging = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    vocab, width = int(sys.argv[5]), int(sys.argv[6])
    if staging:
        from tiekit.checkpoint import streaming
        streaming.STAGING_BYTES = staging
    config = transformers.GPT2Config(n_layer=layers, vocab_size=vocab, n_embd=width)
    device = torch_xla.device()

    def peak_kb():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))

    def metric(name, field):
        data = met.metric_data(name)
        return 0 if data is None else int(data[field])

    if case in ("to", "move", "in_place", "sharded"):
        torch.manual_seed(1)
        model = transformers.GPT2LMHeadModel(config)
        unique = len({id(t) for t in [*model.parameters(), *model.buffers()]})
        if case in ("in_place", "sharded"):
            tiekit.move(model, device)
            (torch.ones(3, device=device) * 2).cpu()  # the compiler started, as in a training process
    else:
        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(config)
        unique = None
    torch_xla.sync()

    def wait_ready(tensors):
        left, ready, lock = [len(tensors)], threading.Event(), threading.Lock()

        def one_ready():
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    ready.set()

        for tensor in tensors:
            torch_xla._XLAC._on_ready_callback(tensor, one_ready)
        if tensors:
            ready.wait()

    # The setup's own transfers (a move) finish on XLA:CPU's threads after their calls return,
    # holding host copies until then: wait for them and hand freed memory back, so that the peak
    # measured from here is the case's own.
    setup = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    wait_ready([t for t in setup.values() if t.device.type == "xla"])
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current RSS
    base, start = peak_kb(), time.perf_counter()
    before = metric("TransferToDeviceTime", 0), metric("OutboundData", 1)
    if case == "to":
        model.to(device)
    elif case == "move":
        tiekit.move(model, device)
    elif case == "load_model":
        tiekit.load_model(model, path, device=device)
    elif case == "in_place":
        tiekit.load_model(model, path)  # into the model's own tensors on XLA
    elif case == "sharded":
        tiekit.load_sharded(model, path.removesuffix(".safetensors"))  # the same weights, save_sharded's folder
    else:
        state = safetensors.torch.load_file(path)
        model.load_state_dict(state, strict=False, assign=True)
        model.tie_weights()
        model.to(device)
        del state
    torch_xla.sync()
    returned = time.perf_counter() - start
    # XLA:CPU fills device buffers on its own threads after the call returns (a one-batch load
    # went on for 0.2 s more, measured by the process's CPU time): wait until every buffer is ready.
    wait_ready(list({id(t): t for t in [*model.parameters(), *model.buffers()]}.values()))
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "returned": returned, "rss_growth_mb": (peak_kb() - base) / 1024,
                      "transfers": metric("TransferToDeviceTime", 0) - before[0],
                      "bytes_mb": (metric("OutboundData", 1) - before[1]) / 2**20, "unique": unique,
                      "tied": model.lm_head.weight is model.transformer.wte.weight,
                      "tiekit": tiekit.__file__}), flush=True)
    # No interpreter teardown: torch_xla's threads may still hold the ready callbacks, and ending
    # the interpreter under them aborted one process in 20 ("terminate called without an active
    # exception"), after its result was printed.
    os._exit(0)
    """
)


def run(case: str, path: Path, model: tuple[int, int, int], tree: Path, staging: int) -> dict[str, float]:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", CASE, case, str(path), *map(str, model[:1]), str(staging), *map(str, model[1:])],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,  # `-c` puts the working folder first on sys.path
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{case} ({tree}) failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(str(result["tiekit"])).resolve().is_relative_to(tree):
        raise SystemExit(f"{case} imported {result['tiekit']}, not the tiekit in {tree}")
    return result


def spread(values: list[float], unit: str = "") -> str:
    """Median and range: the machine is shared, one figure alone says little."""
    return f"{statistics.median(values):.2f}{unit} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257, help="128000: the embedding is most of the model")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every case (default 3)")
    parser.add_argument("--baseline", type=Path, action="append", default=[], help="another tiekit tree")
    parser.add_argument("--staging-mib", type=float, default=0, help="set streaming.STAGING_BYTES (this tree)")
    parser.add_argument("--loads-only", action="store_true", help="skip .to and tiekit.move")
    parser.add_argument("--in-place", action="store_true", help="also load into a model already on XLA")
    args = parser.parse_args()
    here = Path(__file__).resolve().parent.parent  # the tree this script belongs to, not an installed tiekit
    sys.path.insert(0, str(here))
    import torch
    import transformers

    import tiekit

    staging = int(args.staging_mib * 2**20)
    cases: list[tuple[str, str, Path, int]] = (
        []
        if args.loads_only
        else [
            (".to(xla)", "to", here, 0),
            ("tiekit.move", "move", here, 0),
        ]
    )
    cases += [
        ("safetensors + load_state_dict + .to", "safetensors", here, 0),
        ("tiekit.load_model(device=xla)", "load_model", here, staging),
    ]
    cases += [(f"load_model at {tree.name}", "load_model", tree.resolve(), 0) for tree in args.baseline]
    if args.in_place:
        cases += [("load_model into a model on XLA", "in_place", here, staging)]
        cases += [(f"the same at {tree.name}", "in_place", tree.resolve(), 0) for tree in args.baseline]
        cases += [("load_sharded into a model on XLA", "sharded", here, staging)]
        cases += [(f"load_sharded at {tree.name}", "sharded", tree.resolve(), 0) for tree in args.baseline]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.safetensors"
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=args.layers, vocab_size=args.vocab, n_embd=args.width)
        saved = transformers.GPT2LMHeadModel(config)
        tiekit.save_model(saved, path)
        if args.in_place:
            tiekit.save_sharded(saved, path.with_suffix(""))  # RSS growth is given over the file's bytes
        del saved
        file_mb = path.stat().st_size / 2**20
        embedding = args.vocab * args.width * 4 / 2**20
        print(
            f"GPT-2 with {args.layers} layers, width {args.width}, vocabulary {args.vocab}:"
            f" checkpoint {file_mb:.0f} MiB, embedding {embedding / file_mb:.0%} of it; {args.repeats} rounds",
            flush=True,
        )
        model = (args.layers, args.vocab, args.width)
        rounds = []
        for index in range(args.repeats):
            # Each round starts one case later: a case run right after one that used 2.6x the model
            # can pay for the memory the kernel is still reclaiming, so no case always follows the same.
            order = cases[index % len(cases) :] + cases[: index % len(cases)]
            rounds.append({label: run(case, path, model, tree, st) for label, case, tree, st in order})
            load = os.getloadavg()[0]
            print(f"  round {index + 1}: load average {load:.1f}", flush=True)
        print(
            f"{'case':38s} {'transfers':>9s} {'MiB sent':>8s}  s to ready, median (range)  returned  RSS growth / file"
        )
        for label, _, _, _ in cases:
            results = [r[label] for r in rounds]
            first = results[0]
            unique = f" /{first['unique']}" if first["unique"] else ""
            print(
                f"{label:38s} {first['transfers']:>5d}{unique:4s} {first['bytes_mb']:8.0f}  "
                f"{spread([r['seconds'] for r in results]):27s} "
                f"{statistics.median([r['returned'] for r in results]):6.2f} s  "
                f"{spread([r['rss_growth_mb'] / file_mb for r in results], 'x')}  tied: {first['tied']}"
            )

        def ratio(a: str, b: str, key: str) -> str:
            return spread([r[a][key] / r[b][key] for r in rounds], "x")

        ours, plain = "tiekit.load_model(device=xla)", "safetensors + load_state_dict + .to"
        print("ratios within a round, median (range):")
        if not args.loads_only:
            print(f"  tiekit.move / .to(xla): time {ratio('tiekit.move', '.to(xla)', 'seconds')}")
        print(
            f"  load_model / plain: time {ratio(ours, plain, 'seconds')} "
            f"(to return: {ratio(ours, plain, 'returned')}), RSS {ratio(ours, plain, 'rss_growth_mb')}"
        )
        baselines = [c for c in cases if c[1] == "load_model" and c[2] != here]
        if args.in_place:
            for tree in args.baseline:
                for mine, theirs in (
                    ("load_model into a model on XLA", f"the same at {tree.name}"),
                    ("load_sharded into a model on XLA", f"load_sharded at {tree.name}"),
                ):
                    print(
                        f"  {mine} / at {tree.name}: time {ratio(mine, theirs, 'seconds')}, "
                        f"RSS {ratio(mine, theirs, 'rss_growth_mb')}"
                    )
        for label, _, tree, _ in baselines:
            print(
                f"  load_model / load_model at {tree.name}: time {ratio(ours, label, 'seconds')} "
                f"(to return: {ratio(ours, label, 'returned')}), RSS {ratio(ours, label, 'rss_growth_mb')}"
            )


if __name__ == "__main__":
    main()
