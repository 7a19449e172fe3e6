"""An evaluator process reading the checkpoint folder a training process keeps saving into.

    .venv/bin/python examples/evaluate_beside_training.py [OUT_DIR]     (default runs/evaluate)

This process trains tied_lm's model and saves it every few steps into one folder with
`tiekit.save_sharded(..., blocking=False)` (training goes on while the files are written). A
second process, started here, loads the folder with `tiekit.load_sharded` in a loop and
evaluates every save it finds. A save committed while the evaluator reads the previous one
removes that one's files; the load then starts again from the new save by itself, so the
evaluator never fails on a half-replaced folder and never sees a mix of two saves.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from tied_lm import build, corpus

import tiekit

STEPS, EVERY = 40, 4


def train(folder: Path) -> None:
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.utils.data.DataLoader(corpus(stride=7), batch_size=8, shuffle=True)
    batches = iter(data)
    handle = None
    for step in range(1, STEPS + 1):
        ids, targets = next(batches)
        model(ids, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % EVERY == 0:
            if handle is not None:
                handle.wait()  # the previous save's failure, if any, is raised here
            handle = tiekit.save_sharded(model, folder, optimizer=optimizer, extra={"step": step}, blocking=False)
    assert handle is not None
    handle.wait()


def evaluate(folder: Path, last: int) -> None:
    """Load whatever save the folder holds now, evaluate it, until the last step is seen."""
    ids, targets = next(iter(torch.utils.data.DataLoader(corpus(stride=101), batch_size=16)))
    seen: list[int] = []
    deadline = time.monotonic() + 300
    while (not seen or seen[-1] < last) and time.monotonic() < deadline:
        if not tiekit.dcp.is_sharded_checkpoint(folder):
            time.sleep(0.05)  # nothing committed yet
            continue
        with torch.device("meta"):
            model = build()  # no memory: load_sharded gives it the saved tensors
        step = tiekit.load_sharded(model, folder).extra["step"]
        if seen and step == seen[-1]:
            time.sleep(0.05)
            continue
        with torch.no_grad():
            loss = float(model(ids, targets))
        seen.append(step)
        tied = model.head.weight is model.embed.weight
        print(f"evaluated step {step}: loss {loss:.3f}, head.weight is embed.weight: {tied}", flush=True)
    print(f"evaluator: {len(seen)} saves evaluated, steps in order: {seen == sorted(seen)}, last step {seen[-1]}")


def main(out: Path) -> None:
    folder = out / "ckpt"
    shutil.rmtree(folder, ignore_errors=True)  # the evaluator must not find an earlier run's saves
    out.mkdir(parents=True, exist_ok=True)
    evaluator = subprocess.Popen([sys.executable, __file__, "--evaluate", str(folder)])
    try:
        train(folder)
        print(f"trainer: {STEPS} steps, a save every {EVERY} into {folder}", flush=True)
        code = evaluator.wait(timeout=300)
    finally:
        if evaluator.poll() is None:
            evaluator.kill()  # training failed, or the evaluator is stuck
    if code != 0:
        raise SystemExit(f"the evaluator failed (exit code {code})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--evaluate"]:
        evaluate(Path(sys.argv[2]), STEPS)
    else:
        main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/evaluate"))
