"""JSON metadata nested deeper than Python's stack: every reader of a tiekit file raises tiekit's
own error naming the file and the metadata key (json.loads raised a bare RecursionError)."""

from __future__ import annotations

from pathlib import Path

import pytest
from models import WeightSharingModule, assert_unchanged, snapshot
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import tiekit
from tiekit import CheckpointError, TieError
from tiekit.inspection import inspect_file

# Far deeper than any recursion limit, and still a small file (200 kB).
DEEP = "[" * 100_000 + "]" * 100_000


def with_metadata(path: Path, key: str, value: str) -> None:
    """Rewrite the safetensors file ``path`` with metadata ``key`` set to ``value``."""
    with safe_open(path, "pt") as f:
        metadata = dict(f.metadata())
    save_file(load_file(path), path, metadata={**metadata, key: value})


def test_from_json_refuses_deep_json() -> None:
    with pytest.raises(TieError, match="tie plan is not valid JSON"):
        tiekit.TiePlan.from_json(DEEP)


def test_a_deep_plan_in_a_model_file(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    tiekit.save_model(WeightSharingModule(), path)
    with_metadata(path, "tiekit.plan", DEEP)
    model = WeightSharingModule()
    before = snapshot(model)
    message = r"m\.safetensors: invalid tie plan in 'tiekit.plan': tie plan is not valid JSON"
    with pytest.raises(CheckpointError, match=message):
        tiekit.load_model(model, path)
    assert_unchanged(model, before)
    with pytest.raises(CheckpointError, match=message):
        inspect_file(path)


def test_a_deep_training_record_in_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    tiekit.save_checkpoint(path, model=WeightSharingModule(), step=1)
    with_metadata(path, "tiekit.checkpoint", DEEP)
    model = WeightSharingModule()
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=r"c\.safetensors: corrupted 'tiekit.checkpoint' metadata"):
        tiekit.load_checkpoint(path, model=model)
    assert_unchanged(model, before)
    with pytest.raises(CheckpointError, match=r"c\.safetensors: corrupted 'tiekit.checkpoint' metadata"):
        inspect_file(path)
