"""Peak memory of `tiekit.load_model` when the file's dtype is not the model's (float32 <-> bfloat16).

A tied model of plain torch modules (an embedding of ``--vocab`` x ``--width``, 90% of the model
at the defaults, tied to the output layer, and ``--layers`` square linear layers) is saved in
float32 and in bfloat16, then loaded in a fresh process per case into a model of the other dtype:
on the meta device (new tensors) and already allocated (filled in place, all or nothing). Each
case prints peak RSS growth (VmHWM reset after the model is built) against the model's bytes and
against a plain loop run in the same round: read one tensor into a buffer of the file's dtype
(``preadv``, no mmap), cast it, drop the buffer (``load_state_dict(assign=True)`` for a meta
model, ``copy_`` into an allocated one, which is not all or nothing).
``--baseline DIR`` adds ``load_model`` from another tiekit source tree (a folder holding a
``tiekit`` package, e.g. ``git archive HEAD~1 tiekit | tar -x -C DIR``).

    .venv/bin/python benchmarks/bench_cast_load.py [--vocab 128000] [--width 512] [--layers 4]
        [--repeats 1] [--baseline DIR]
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CASE = textwrap.dedent(
    """
    import json, os, struct, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from torch import nn

    who, target, path, vocab, width, layers = sys.argv[1:7]
    vocab, width, layers = int(vocab), int(width), int(layers)
    device, model_dtype = target.split("-")
    model_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[model_dtype]

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
            self.head = nn.Linear(width, vocab, bias=False)
            self.head.weight = self.embed.weight

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

    if who == "save":
        torch.manual_seed(0)
        import tiekit
        model = Tied()
        tiekit.save_model(model, path + ".fp32.safetensors")
        tiekit.save_model(model.to(torch.bfloat16), path + ".bf16.safetensors")
        sys.exit()
    if who != "plain":
        import tiekit
    if device == "meta":
        with torch.device("meta"):
            model = Tied().to(model_dtype)
    else:
        model = Tied().to(model_dtype)
    size = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])  # tied: once
    before = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM: building the model does not count
    if who == "plain":
        dtypes = {"F32": torch.float32, "BF16": torch.bfloat16}
        fd = os.open(path, os.O_RDONLY)
        n = struct.unpack("<Q", os.pread(fd, 8, 0))[0]
        header = json.loads(os.pread(fd, n, 8))
        header.pop("__metadata__", None)
        params = dict(model.named_parameters())
        loaded = {}
        for key, e in header.items():
            buffer = torch.empty(e["shape"], dtype=dtypes[e["dtype"]])
            os.preadv(fd, [memoryview(buffer.view(torch.uint8).reshape(-1).numpy())], 8 + n + e["data_offsets"][0])
            if device == "meta":
                loaded[key] = buffer.to(model_dtype)
            else:
                with torch.no_grad():
                    params[key].copy_(buffer)
            del buffer
        if device == "meta":
            model.load_state_dict(loaded, strict=False, assign=True)
            model.head.weight = model.embed.weight
        os.close(fd)
    else:
        tiekit.load_model(model, path)
    peak = status("VmHWM")
    assert model.head.weight is model.embed.weight and model.embed.weight.dtype == model_dtype
    print(json.dumps({"growth": peak - before, "size": size}))
    """
)

CASES = ("meta-bf16 from fp32", "meta-fp32 from bf16", "cpu-bf16 from fp32", "cpu-fp32 from bf16")


def run(who: str, case: str, stem: str, args: argparse.Namespace, tree: Path) -> dict[str, int]:
    target, _, file_dtype = case.split()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-c", CASE, who, target, f"{stem}.{file_dtype}.safetensors"]
    out = subprocess.run(
        [*cmd, str(args.vocab), str(args.width), str(args.layers)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=tree.parent if tree == ROOT else tree,  # python -c puts the working folder first on sys.path
        timeout=300,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128000)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--baseline", type=Path, action="append", default=[])
    args = parser.parse_args()
    contenders = {"plain loop": ("plain", ROOT), "tiekit": ("tiekit", ROOT)}
    contenders.update({f"tiekit {d.name}": ("tiekit", d) for d in args.baseline})
    mib = 1 << 20
    with tempfile.TemporaryDirectory(prefix="bench-cast-", dir=HERE) as folder:
        stem = str(Path(folder) / "m")
        subprocess.run(
            [sys.executable, "-c", CASE, "save", "cpu-fp32", stem, str(args.vocab), str(args.width), str(args.layers)],
            check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=300,
        )
        for case in CASES:
            growth: dict[str, list[int]] = {name: [] for name in contenders}
            size = 0
            for _ in range(args.repeats):
                for name, (who, tree) in contenders.items():
                    r = run(who, case, stem, args, tree)
                    growth[name].append(r["growth"])
                    size = r["size"]
            plain = statistics.median(growth["plain loop"])
            print(f"{case}: model {size / mib:.0f} MiB, peak RSS growth (median of {args.repeats}):")
            for name, values in growth.items():
                g = statistics.median(values)
                print(f"  {name:28s} {g / mib:7.0f} MiB  {g / size:5.2f}x the model  {g / plain:5.2f}x the plain loop")


if __name__ == "__main__":
    main()
