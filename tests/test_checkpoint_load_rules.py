"""Two load rules: values are cast to the model's dtypes (as load_state_dict casts them) unless
dtype="file", and a load that fails at any stage leaves the model exactly as it was, ties too."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from models import WeightSharingModule, assert_unchanged, broken_tie, gpt2, snapshot
from torch import nn

from tiekit import CheckpointError, load_checkpoint, load_model, save_checkpoint, save_model
from tiekit.checkpoint import loading, reads

# -- dtypes -------------------------------------------------------------------------------------


def test_a_bfloat16_file_loads_into_a_float32_model_cast_and_tied(tmp_path: Path) -> None:
    trained = WeightSharingModule().to(torch.bfloat16)  # what a precision="bf16-true" run saves
    save_model(trained, tmp_path / "m.safetensors")
    for model in (WeightSharingModule(), broken_tie()):
        result = load_model(model, tmp_path / "m.safetensors")
        assert [g.source for g in result.retied] == ["layer_1.weight"]
        assert model.layer_1.weight.dtype == torch.float32
        assert model.layer_3.weight is model.layer_1.weight
        assert torch.equal(model.layer_1.weight, trained.layer_1.weight.float())
        assert torch.equal(model.layer_2.weight, trained.layer_2.weight.float())


def test_cast_matches_load_state_dict(tmp_path: Path) -> None:
    source = WeightSharingModule()
    save_model(source, tmp_path / "m.safetensors")
    ours, theirs = WeightSharingModule().to(torch.float64), WeightSharingModule().to(torch.float64)
    load_model(ours, tmp_path / "m.safetensors")
    theirs.load_state_dict(source.state_dict())
    for name, value in theirs.state_dict().items():
        assert ours.state_dict()[name].dtype == torch.float64
        assert torch.equal(ours.state_dict()[name], value), name


@pytest.mark.parametrize("budget", [100, 3000])
def test_a_float32_file_cast_in_pieces_gives_a_plain_casts_values(
    tmp_path: Path, budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tensor that changes dtype is read through one small buffer and cast into its tensor: with
    # 100 bytes each 1280-byte weight is cut in pieces, with 3000 two weights share the buffer.
    monkeypatch.setattr(loading, "CAST_BATCH_BYTES", budget)
    trained = WeightSharingModule()
    save_model(trained, tmp_path / "m.safetensors")
    with torch.device("meta"):
        meta = WeightSharingModule().to(torch.bfloat16)
    for model in (meta, WeightSharingModule().to(torch.bfloat16), broken_tie().to(torch.bfloat16)):
        load_model(model, tmp_path / "m.safetensors")
        assert model.layer_3.weight is model.layer_1.weight
        for name, value in trained.state_dict().items():
            assert model.state_dict()[name].dtype == torch.bfloat16, name
            assert torch.equal(model.state_dict()[name], value.to(torch.bfloat16)), name
    with torch.device("meta"):
        wide = WeightSharingModule().to(torch.float64)  # and widening, into new tensors
    load_model(wide, tmp_path / "m.safetensors")
    assert wide.layer_3.weight is wide.layer_1.weight
    assert all(torch.equal(wide.state_dict()[n], v.double()) for n, v in trained.state_dict().items())


def test_dtype_file_gives_a_meta_model_the_files_dtypes(tmp_path: Path) -> None:
    trained = WeightSharingModule().to(torch.bfloat16)
    save_model(trained, tmp_path / "m.safetensors")
    with torch.device("meta"):
        model = WeightSharingModule()
    load_model(model, tmp_path / "m.safetensors", dtype="file")
    assert model.layer_1.weight.dtype == torch.bfloat16 and not model.layer_1.weight.is_meta
    assert model.layer_3.weight is model.layer_1.weight
    assert torch.equal(model.layer_1.weight, trained.layer_1.weight)
    # The default casts to the meta model's float32.
    with torch.device("meta"):
        cast = WeightSharingModule()
    load_model(cast, tmp_path / "m.safetensors")
    assert cast.layer_1.weight.dtype == torch.float32 and cast.layer_3.weight is cast.layer_1.weight


def test_dtype_file_into_a_real_model_with_a_broken_tie(tmp_path: Path) -> None:
    trained = WeightSharingModule().to(torch.bfloat16)
    save_model(trained, tmp_path / "m.safetensors")
    model = broken_tie()
    load_model(model, tmp_path / "m.safetensors", dtype="file")
    assert model.layer_1.weight.dtype == torch.bfloat16 and model.layer_3.weight is model.layer_1.weight
    assert torch.equal(model.layer_2.weight, trained.layer_2.weight)


class Counter(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(3, dtype=dtype))


def test_no_cast_between_integer_and_floating_point(tmp_path: Path) -> None:
    save_model(Counter(torch.int64), tmp_path / "m.safetensors")
    model = Counter(torch.float32)
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=re.escape("dtype mismatch for 'seen': the file has int64")):
        load_model(model, tmp_path / "m.safetensors")
    assert_unchanged(model, before)
    load_model(model, tmp_path / "m.safetensors", dtype="file")  # taking the file's dtype is allowed
    assert model.seen.dtype == torch.int64


def test_bad_dtype_policy_and_bad_device_are_checkpoint_errors(tmp_path: Path) -> None:
    save_model(WeightSharingModule(), tmp_path / "m.safetensors")
    model = broken_tie()
    before = snapshot(model)
    with pytest.raises(CheckpointError, match="dtype must be 'model' or 'file'"):
        load_model(model, tmp_path / "m.safetensors", dtype="bfloat16")  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=r"m\.safetensors: cannot load onto device 'bogus'"):
        load_model(model, tmp_path / "m.safetensors", device="bogus")
    # A device torch knows that this machine lacks failed as torch's RuntimeError at the first read (probe).
    absent = f"cuda:{torch.cuda.device_count()}"
    for device in (absent, torch.device(absent).index):
        with pytest.raises(CheckpointError, match=rf"m\.safetensors: cannot load onto device {device!r}: \w"):
            load_model(model, tmp_path / "m.safetensors", device=device)
    assert_unchanged(model, before)


def test_training_checkpoint_resumes_across_precisions(tmp_path: Path) -> None:
    model = WeightSharingModule().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 32, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    save_checkpoint(tmp_path / "c.safetensors", model=model, optimizer=optimizer, step=1)

    resumed = broken_tie()
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    record = load_checkpoint(tmp_path / "c.safetensors", model=resumed, optimizer=resumed_optimizer)
    assert record["step"] == 1 and resumed.layer_3.weight is resumed.layer_1.weight
    state = resumed_optimizer.state[resumed.layer_1.weight]
    assert state["exp_avg"].dtype == torch.float32  # torch's load_state_dict casts to the parameter
    assert torch.equal(state["exp_avg"], optimizer.state[model.layer_1.weight]["exp_avg"].float())
    resumed(torch.randn(4, 32)).sum().backward()
    resumed_optimizer.step()  # the restored state fits


# -- a failed load changes nothing, ties included --------------------------------------------


class SavedOverDuringLoad(WeightSharingModule):
    """Its tie is broken, and the checkpoint is replaced by a real save right after staging
    validated the headers (staging asks the model for its declared ties), before any read."""

    def __init__(self, replace: Callable[[], None]) -> None:
        super().__init__()
        self.layer_3.weight = nn.Parameter(self.layer_1.weight.detach() + 1.0)
        self.replace: Callable[[], None] | None = replace

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict[str, str]:
        if self.replace is not None:
            replace, self.replace = self.replace, None
            replace()
        return {}


def corrupt_header(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[12:20] = b"\xff" * 8
    path.write_bytes(bytes(raw))


def test_failure_at_the_header_stage(tmp_path: Path) -> None:
    save_model(WeightSharingModule(), tmp_path / "m.safetensors")
    corrupt_header(tmp_path / "m.safetensors")
    model = broken_tie()
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=r"m\.safetensors"):
        load_model(model, tmp_path / "m.safetensors")
    assert_unchanged(model, before)


def test_failure_at_the_index_stage(tmp_path: Path) -> None:
    save_model(gpt2(), tmp_path, max_shard_size=20_000)
    index = tmp_path / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["weight_map"]["lm_head.weight"] = "model-99999-of-99999.safetensors"
    index.write_text(json.dumps(raw))
    model = gpt2()
    model.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach() * 2)  # broken, different
    before = snapshot(model)
    with pytest.raises(CheckpointError, match="is missing"):
        load_model(model, tmp_path)
    assert_unchanged(model, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16: each value cast as it is read
@pytest.mark.parametrize("sharded", [False, True])
def test_failure_at_the_read_stage(
    tmp_path: Path, sharded: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reads, "READ_ATTEMPTS", 1)  # a load would otherwise start again from the new save
    folder = tmp_path / "ckpt"
    kwargs = {"max_shard_size": 1500} if sharded else {}
    save_model(WeightSharingModule(), folder, **kwargs)  # type: ignore[arg-type]
    model = SavedOverDuringLoad(lambda: save_model(WeightSharingModule(), folder, **kwargs)).to(dtype)  # type: ignore[arg-type]
    before = snapshot(model)
    with pytest.raises(CheckpointError, match="changed on disk after its header was checked"):
        load_model(model, folder)
    assert_unchanged(model, before)  # no value written and the broken tie not re-tied


def test_failure_at_the_optimizer_stage(tmp_path: Path) -> None:
    source = WeightSharingModule()
    optimizer = torch.optim.AdamW(source.parameters())
    save_checkpoint(tmp_path / "c.safetensors", model=source, optimizer=optimizer)
    model = broken_tie()
    wrong = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model)
    with pytest.raises(CheckpointError, match="holds AdamW state, not SGD"):
        load_checkpoint(tmp_path / "c.safetensors", model=model, optimizer=wrong)
    assert_unchanged(model, before)
    assert not wrong.state
