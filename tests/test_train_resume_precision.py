"""A fit checkpoint resumes in another precision: bf16-true into 32-true and back, on the CPU and
on one XLA device. Loads cast to the model's dtypes, as ``load_state_dict`` does."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import WeightSharingModule
from safetensors import safe_open
from torch.utils.data import TensorDataset

import tiekit

ADAMW = functools.partial(torch.optim.AdamW, lr=3e-2)
DTYPES = {"bf16-true": torch.bfloat16, "32-true": torch.float32}


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=generator)
    return TensorDataset(x, x @ torch.randn(32, 10, generator=generator) / 32**0.5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("xla", marks=pytest.mark.xla)])
@pytest.mark.parametrize(("saved", "resumed"), [("bf16-true", "32-true"), ("32-true", "bf16-true")])
def test_a_checkpoint_resumes_in_another_precision(tmp_path: Path, device: str, saved: str, resumed: str) -> None:
    kw: dict[str, Any] = {"loss_fn": F.mse_loss, "batch_size": 16, "progress": False, "optimizer": ADAMW}
    kw["devices"] = device
    first = tiekit.fit(WeightSharingModule, data(), max_steps=20, precision=saved, checkpoint_dir=tmp_path, **kw)
    path = tmp_path / "step-00000020.safetensors"
    with safe_open(str(path), "pt") as f:
        stored = f.get_tensor("layer_1.weight")
    assert stored.dtype == DTYPES[saved]

    # No step after the resume: the weights are the file's, in the new precision (handed back in
    # the model's own float32, as every fit does).
    loaded = tiekit.fit(WeightSharingModule, data(), max_steps=20, precision=resumed, resume=path, **kw)
    assert (loaded.steps, loaded.losses) == (20, ())
    weight = loaded.model.layer_1.weight
    assert weight.dtype == torch.float32 and loaded.model.layer_3.weight is weight
    assert torch.equal(weight, stored.to(DTYPES[resumed]).float())

    # Training on: optimizer state and position come back too, so the loss goes on from where
    # the first run stood instead of starting over.
    fresh = tiekit.fit(WeightSharingModule, data(), max_steps=1, precision=resumed, **kw)
    resumed_run = tiekit.fit(WeightSharingModule, data(), max_steps=26, precision=resumed, resume=path, **kw)
    assert (resumed_run.steps, len(resumed_run.losses)) == (26, 6)
    assert first.losses[-1] < 0.5 * first.losses[0]  # (measured: 0.95 -> 0.26)
    assert max(resumed_run.losses) < 0.5 * fresh.losses[0]  # (measured: at most 0.33 against 0.95)
    assert resumed_run.ties_kept and resumed_run.model.layer_3.weight is resumed_run.model.layer_1.weight
