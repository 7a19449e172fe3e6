"""`tiekit.load_sharded` into a model on XLA (issue 13): tensors larger than a staging buffer are
located in the DCP shard files and written in place on the device in pieces, the rest go through
DCP's reader. Peak host memory of the same path is measured in tests/test_xla_transfers.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from models import gpt2
from torch import nn

import tiekit
import tiekit.dcp.loading
from tiekit.checkpoint import streaming

pytestmark = pytest.mark.xla

BUDGET = 1 << 14  # staging in proportion to this small model, as 16 MiB is to GPT-2's 475 MB


@pytest.fixture
def small_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiekit.dcp.loading, "STAGING_BYTES", BUDGET)
    monkeypatch.setattr(streaming, "STAGING_BYTES", BUDGET)
    monkeypatch.setattr(streaming, "_PIECES_COST", 0)  # the 48 KB embedding crosses in pieces


def model_on(device: torch.device, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = gpt2(vocab_size=375)  # the embedding: 375 x 32 fp32, 48 KB, 3 staging buffers
    tiekit.move(model, device)
    return model


def located_keys(monkeypatch: pytest.MonkeyPatch, after: Any = None) -> list[str]:
    """Records the keys load_sharded locates for streaming (the real `locate_rows` runs);
    ``after(located)`` runs once they are located, before any is read."""
    seen: list[str] = []
    real = tiekit.dcp.loading.locate_rows

    def spying(folder: Path, *args: Any) -> Any:
        located, identities = real(folder, *args)
        seen.extend(located)
        if after is not None:
            after(located)
        return located, identities

    monkeypatch.setattr(tiekit.dcp.loading, "locate_rows", spying)
    return seen


def test_a_sharded_load_writes_large_tensors_into_a_model_on_xla_in_place(
    tmp_path: Path, xla_device: torch.device, small_staging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = model_on(torch.device("cpu"), seed=0)
    tiekit.save_sharded(saved, tmp_path / "ckpt")
    model = model_on(xla_device, seed=1)
    embedding = model.transformer.wte.weight
    assert not torch.equal(embedding.cpu(), saved.transformer.wte.weight)
    streamed = located_keys(monkeypatch)
    tiekit.load_sharded(model, tmp_path / "ckpt")
    assert "transformer.wte.weight" in streamed  # it went the streaming way, not through DCP
    assert model.transformer.wte.weight is embedding and model.lm_head.weight is embedding
    for name, value in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name].cpu(), value), name


def test_a_shard_file_replaced_after_it_was_located_is_refused(
    tmp_path: Path, xla_device: torch.device, small_staging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The offsets found in a shard file hold for that file only: one a save replaces between the
    locating and the reading is a `CheckpointError` naming it, never read as if it were the same."""
    tiekit.save_sharded(model_on(torch.device("cpu"), seed=0), tmp_path / "ckpt")
    replaced: list[Path] = []

    def replace_shards(located: dict[str, list[tuple[str, Any, int]]]) -> None:
        for path, entry, _ in located["transformer.wte.weight"]:
            data = bytearray(Path(path).read_bytes())
            data[entry.start : entry.start + 64] = bytes(64)  # same size, other values: only its identity tells
            Path(path + ".new").write_bytes(data)
            os.replace(path + ".new", path)
            replaced.append(Path(path))

    located_keys(monkeypatch, after=replace_shards)
    model = model_on(xla_device, seed=1)
    with pytest.raises(tiekit.CheckpointError, match=r"\.distcp") as caught:
        tiekit.load_sharded(model, tmp_path / "ckpt")
    assert replaced and any(str(shard) in str(caught.value) for shard in replaced)
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survives the failed load
