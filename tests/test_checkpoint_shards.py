"""Sharded saves in the Hugging Face layout, transformers interop, and damaged indexes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from models import gpt2

import tiekit
from tiekit import CheckpointError, load_model, save_model

IDS = torch.tensor([[1, 5, 9, 2, 7, 3]])
LIMIT = 40_000  # bytes: the small GPT-2 (about 118 kB of unique weights) takes 4 shards


def shard_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("model-"))


def visible(folder: Path) -> list[str]:
    return sorted(p for p in os.listdir(folder) if not p.startswith("."))


def test_sharded_save_follows_the_hf_layout_and_records_ties(tmp_path: Path) -> None:
    model = gpt2().eval()
    save_model(model, tmp_path, max_shard_size=LIMIT)
    shards = shard_names(tmp_path)
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert len(shards) > 1 and visible(tmp_path) == [*shards, "model.safetensors.index.json"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    plan = tiekit.find_ties(model)
    assert tiekit.TiePlan.from_dict(index["metadata"]["tiekit.plan"]) == plan
    unique = [n for n in model.state_dict() if n not in plan.tied_names]
    assert sorted(index["weight_map"]) == sorted(unique) and "lm_head.weight" not in index["weight_map"]
    total = 0
    for shard in shards:
        tensors = safetensors.torch.load_file(tmp_path / shard)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= LIMIT or len(tensors) == 1
        assert all(index["weight_map"][k] == shard for k in tensors)
        total += size
    assert index["metadata"]["total_size"] == total

    # The folder, the index, and the file path a sharded save of a file path writes beside (which
    # said "no such checkpoint file", not naming the index there).
    for where in (tmp_path, tmp_path / "model.safetensors.index.json", tmp_path / "model.safetensors"):
        target = gpt2(tie_word_embeddings=False).eval()
        result = load_model(target, where)
        assert result.plan_origin == "tiekit"
        assert target.lm_head.weight is target.transformer.wte.weight
        assert torch.equal(model(IDS).logits, target(IDS).logits)


@pytest.mark.parametrize("max_shard_size", [None, LIMIT])
def test_transformers_from_pretrained_loads_tiekit_files(tmp_path: Path, max_shard_size: int | None) -> None:
    from transformers import GPT2LMHeadModel

    model = gpt2().eval()
    model.config.save_pretrained(tmp_path)
    save_model(model, tmp_path / "model.safetensors", max_shard_size=max_shard_size)
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert torch.equal(model(IDS).logits, loaded(IDS).logits)


def test_resaving_replaces_shards_and_cleans_up(tmp_path: Path) -> None:
    torch.manual_seed(0)
    first, second = gpt2(), gpt2()
    save_model(first, tmp_path, max_shard_size=LIMIT)
    names = shard_names(tmp_path)
    save_model(second, tmp_path, max_shard_size=LIMIT)  # same shard names: overwritten safely
    assert shard_names(tmp_path) == names
    assert sorted(os.listdir(tmp_path)) == visible(tmp_path)  # no backup or temporary file left
    target = gpt2()
    load_model(target, tmp_path)
    assert torch.equal(target.transformer.wte.weight, second.transformer.wte.weight)

    save_model(first, tmp_path, max_shard_size=LIMIT // 2)  # more shards: the old ones go
    now = shard_names(tmp_path)
    assert len(now) > len(names) and all(n.endswith(f"-of-{len(now):05d}.safetensors") for n in now)
    save_model(second, tmp_path)  # one file: the index and its shards go
    assert visible(tmp_path) == ["model.safetensors"]
    load_model(target, tmp_path)
    assert torch.equal(target.transformer.wte.weight, second.transformer.wte.weight)


def test_small_model_with_a_shard_limit_is_one_file(tmp_path: Path) -> None:
    save_model(gpt2(), tmp_path, max_shard_size="10MB")
    assert visible(tmp_path) == ["model.safetensors"]
    with pytest.raises(CheckpointError, match="not a size"):
        save_model(gpt2(), tmp_path, max_shard_size="ten")


def damaged(tmp_path: Path, edit: str) -> tuple[Path, str]:
    save_model(gpt2(), tmp_path, max_shard_size=LIMIT)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = index["weight_map"]
    if edit == "escape":
        outside = tmp_path.parent / "outside.safetensors"
        shutil.copy(tmp_path / weight_map["transformer.wte.weight"], outside)
        weight_map["transformer.wte.weight"] = "../outside.safetensors"
        message = "shard path '../outside.safetensors' (key 'transformer.wte.weight') escapes the index's folder"
    elif edit == "missing shard":
        shard = weight_map["transformer.ln_f.bias"]
        (tmp_path / shard).unlink()
        first_key = next(k for k, v in weight_map.items() if v == shard)
        message = f"shard {shard!r} (holding key {first_key!r}) is missing"
    elif edit == "key not in shard":
        weight_map["transformer.wte.weight"] = weight_map["transformer.ln_f.bias"]
        message = "puts key 'transformer.wte.weight' in"
    elif edit == "plan source absent":
        del weight_map["transformer.wte.weight"]
        message = "the tie metadata names key 'transformer.wte.weight'"
    elif edit == "shard from another save":
        other = tmp_path / "other"
        save_model(gpt2(), other, max_shard_size=LIMIT)
        first = sorted(set(weight_map.values()))[0]
        shutil.copy(other / first, tmp_path / first)
        message = f"shard {first!r} belongs to another save"
    else:
        index_path.write_text("{ not json")
        return index_path, "corrupted index"
    index_path.write_text(json.dumps(index))
    return index_path, message


@pytest.mark.parametrize(
    "edit", ["escape", "missing shard", "key not in shard", "plan source absent", "shard from another save", "json"]
)
def test_damaged_index_raises_and_leaves_the_model_unchanged(tmp_path: Path, edit: str) -> None:
    folder = tmp_path / "ckpt"
    index_path, message = damaged(folder, edit)
    model = gpt2()
    params = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError) as info:
        load_model(model, folder)
    assert str(index_path) in str(info.value) and message in str(info.value)
    for name, p in model.named_parameters():
        assert p is params[name][0] and torch.equal(p, params[name][1])


def test_symlinked_shard_outside_the_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    save_model(gpt2(), folder, max_shard_size=LIMIT)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["transformer.wte.weight"]
    (tmp_path / "elsewhere.safetensors").write_bytes((folder / shard).read_bytes())
    (folder / shard).unlink()
    (folder / shard).symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(CheckpointError, match="escapes the index's folder \\(symlink\\)"):
        load_model(gpt2(), folder)
