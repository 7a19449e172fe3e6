"""save_pretrained folders: load_model reads those whose keys transformers stores as named, and
for architectures it renames on save (ESM, Jamba, Marian) says exactly why not and what to use."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

import tiekit


def esm() -> nn.Module:
    config = transformers.EsmConfig(
        vocab_size=33, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
        max_position_embeddings=64, pad_token_id=1,
    )  # fmt: skip
    return transformers.EsmForMaskedLM(config)


def jamba() -> nn.Module:
    config = transformers.JambaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=37, num_experts=2, num_experts_per_tok=1, expert_layer_period=1, expert_layer_offset=0,
        attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=2, mamba_expand=2,
    )  # fmt: skip
    return transformers.JambaForCausalLM(config)


def marian() -> nn.Module:
    config = transformers.MarianConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64,
        pad_token_id=0, decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.MarianMTModel(config)


@pytest.mark.parametrize(
    ("build", "symptom"),
    [(esm, "LayerNorm.gamma"), (jamba, "experts.0.down_proj.weight"), (marian, "embed_positions.weight")],
)
def test_renamed_save_pretrained_folders_point_to_from_pretrained(
    tmp_path: Path, build: Callable[[], nn.Module], symptom: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = build()
        model.save_pretrained(tmp_path)  # type: ignore[operator]
        target = build()
    before = {n: (t, t.detach().clone()) for n, t in target.state_dict(keep_vars=True).items()}
    with pytest.raises(tiekit.CheckpointError) as info:
        tiekit.load_model(target, tmp_path)
    message = str(info.value)
    assert symptom in message and "written by transformers' save_pretrained" in message
    assert f"{type(target).__name__}.from_pretrained(folder)" in message
    for name, (tensor, values) in before.items():  # nothing changed
        assert target.state_dict(keep_vars=True)[name] is tensor and torch.equal(tensor, values)
    # What the message says works: transformers undoes its own renaming.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = type(target).from_pretrained(tmp_path)  # type: ignore[attr-defined]
    expected = dict(model.state_dict())
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_a_folder_without_transformers_config_gets_no_hint(tmp_path: Path) -> None:
    tiekit.save_model(nn.Linear(3, 4), tmp_path / "model.safetensors")
    with pytest.raises(tiekit.CheckpointError) as info:
        tiekit.load_model(nn.Linear(3, 5, bias=False), tmp_path)
    assert "save_pretrained" not in str(info.value)
    assert re.search(r"unexpected 'bias'", str(info.value))


def test_a_tied_save_loaded_into_a_model_built_untied_names_the_config_tie(tmp_path: Path) -> None:
    from models import gpt2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt2().save_pretrained(tmp_path)  # type: ignore[operator]
    untied = gpt2(tie_word_embeddings=False)
    head = untied.lm_head.weight.detach().clone()  # type: ignore[union-attr,operator]
    with pytest.raises(tiekit.CheckpointError) as info:
        tiekit.load_model(untied, tmp_path)
    message = str(info.value)
    assert "missing 'lm_head.weight'" in message
    assert "ties lm_head.weight to transformer.wte.weight when its config says so" in message
    assert "renames or re-lays" not in message  # not the key-renaming hint: nothing was renamed
    assert torch.equal(untied.lm_head.weight, head)  # type: ignore[union-attr,arg-type]
