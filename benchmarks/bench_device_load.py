"""Moves and loads onto XLA at the memory floor (issue 13): transfers, time and peak RSS growth.

Each case runs in a fresh process (XLA:CPU; device buffers are host memory there, so RSS counts
them too), with a GPT-2 small built from its config (124M parameters, tied embedding):

* ``.to(xla)`` vs ``tiekit.move``: host-to-device transfers (torch_xla metrics) against the
  unique tensors, and time;
* loading a 498 MB tied checkpoint into a meta model on XLA: ``tiekit.load_model(device="xla")``
  against a plain safetensors ``load_file`` + ``load_state_dict(assign=True)`` + ``.to(xla)``:
  peak RSS growth over the file's bytes, and time.

    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_device_load.py [--layers 12]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

CASE = textwrap.dedent(
    """
    import json, os, sys, time, warnings
    warnings.filterwarnings("ignore")
    import torch, torch_xla, transformers
    import torch_xla.debug.metrics as met
    import safetensors.torch
    import tiekit

    case, path, layers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = transformers.GPT2Config(n_layer=layers)
    device = torch_xla.device()

    def peak_kb():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))

    def transfers():
        data = met.metric_data("TransferToDeviceTime")
        return 0 if data is None else int(data[0])

    if case in ("to", "move"):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        unique = len({id(t) for t in [*model.parameters(), *model.buffers()]})
    else:
        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(config)
        unique = None
    torch_xla.sync()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current RSS
    base, before, start = peak_kb(), transfers(), time.perf_counter()
    if case == "to":
        model.to(device)
    elif case == "move":
        tiekit.move(model, device)
    elif case == "tiekit.load_model":
        tiekit.load_model(model, path, device=device)
    else:
        state = safetensors.torch.load_file(path)
        model.load_state_dict(state, strict=False, assign=True)
        model.tie_weights()
        model.to(device)
        del state
    torch_xla.sync()
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "rss_growth_mb": (peak_kb() - base) / 1024,
                      "transfers": transfers() - before, "unique": unique,
                      "tied": model.lm_head.weight is model.transformer.wte.weight}))
    """
)


def run(case: str, path: Path, layers: int) -> dict[str, float]:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CASE, case, str(path), str(layers)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{case} failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    import torch
    import transformers

    import tiekit

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.safetensors"
        torch.manual_seed(0)
        tiekit.save_model(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=args.layers)), path)
        file_mb = path.stat().st_size / 2**20
        print(f"GPT-2 with {args.layers} layers: checkpoint {file_mb:.0f} MiB")
        to, move = run("to", path, args.layers), run("move", path, args.layers)
        print(
            f"  .to(xla)      {to['transfers']:4d} transfers for {to['unique']} unique tensors, {to['seconds']:.2f} s"
        )
        print(
            f"  tiekit.move   {move['transfers']:4d} transfers for {move['unique']} unique tensors, "
            f"{move['seconds']:.2f} s ({move['seconds'] / to['seconds']:.2f}x .to)"
        )
        plain, ours = run("safetensors", path, args.layers), run("tiekit.load_model", path, args.layers)
        for name, r in (("safetensors + load_state_dict + .to", plain), ("tiekit.load_model(device=xla)", ours)):
            print(
                f"  {name:37s} peak RSS +{r['rss_growth_mb']:.0f} MiB ({r['rss_growth_mb'] / file_mb:.2f}x the file), "
                f"{r['seconds']:.2f} s, tied: {r['tied']}"
            )
        print(
            f"  tiekit / plain: time {ours['seconds'] / plain['seconds']:.2f}x, RSS growth "
            f"{ours['rss_growth_mb'] / plain['rss_growth_mb']:.2f}x"
        )


if __name__ == "__main__":
    main()
