"""A load reads what it loads: `load_checkpoint` without an optimizer leaves the optimizer's
state (twice the model for Adam) on disk, counted by the bytes this process read (Linux's
/proc/self/io, which counts every read of the process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import gpt2

from tiekit import load_checkpoint, save_checkpoint

IO = Path("/proc/self/io")


def bytes_read() -> int:
    line = next(line for line in IO.read_text().splitlines() if line.startswith("rchar:"))
    return int(line.split()[1])


@pytest.mark.skipif(not IO.exists(), reason="needs Linux's /proc/self/io")
def test_load_checkpoint_reads_the_optimizer_state_only_for_an_optimizer(tmp_path: Path) -> None:
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=optimizer, step=1)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    load_checkpoint(tmp_path / "ckpt", model=gpt2())  # the first load imports modules: not counted

    bare, fresh = gpt2(), gpt2()
    before = bytes_read()
    load_checkpoint(tmp_path / "ckpt", model=bare)
    without = bytes_read() - before
    before = bytes_read()
    load_checkpoint(tmp_path / "ckpt", model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()))
    with_optimizer = bytes_read() - before

    # The weights and the header (the record of step, extra and optimizer options): all of the
    # optimizer's state was read too before, 3.2x the weights here.
    assert weights <= without < 1.5 * weights, (without, weights)
    assert with_optimizer - without > 1.9 * weights, (with_optimizer, without, weights)  # the two moments
