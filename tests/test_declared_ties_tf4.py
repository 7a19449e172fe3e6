"""transformers 4.x declares a model's ties as a list of targets (``_tied_weights_keys``), each
taking the input embedding's weight when the config ties word embeddings, and encoder weights
taking the decoder's under ``tie_encoder_decoder``; tiekit read only transformers 5's
``{target: source}`` form and so saw no declared ties on 4.x (probe, transformers 4.57.6).

Real transformers models from tiny configs, shown the way 4.x classes carry the declaration: a
subclass whose ``_tied_weights_keys`` is the 4.x list and that has no
``get_expanded_tied_weights_keys``. The same tests pass under a real transformers 4.57."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers
from models import gpt2
from torch import nn

import tiekit
from tiekit.declarations import declared_ties

IDS = torch.tensor([[1, 5, 9, 2, 7, 3]])
T5_TIED = ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"]  # 4.x's list


def as_transformers4(model: nn.Module, lists: dict[str, list[str] | None]) -> nn.Module:
    """``model`` with each submodule at a path in ``lists`` ("" is the model) of a subclass that
    declares its ties as 4.x does: that list (None: no list), and no transformers 5 expansion."""
    for path, targets in lists.items():
        module = model.get_submodule(path)
        declaring = type(
            f"{type(module).__name__}4",
            (type(module),),
            {"_tied_weights_keys": targets, "get_expanded_tied_weights_keys": None},
        )
        module.__class__ = declaring
    return model


def gpt2_4(**overrides: object) -> nn.Module:
    return as_transformers4(gpt2(**overrides), {"": ["lm_head.weight"]})


def t5_4() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    return as_transformers4(model, {"": T5_TIED})


def bart_4() -> nn.Module:
    """A 4.x model whose base model declares its own ties: its names are relative to it."""
    config = transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
    )  # fmt: skip
    embeddings = ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight"]
    model = transformers.BartForConditionalGeneration(config)
    return as_transformers4(model, {"": [*embeddings, "lm_head.weight"], "model": embeddings})


def bert2bert_4() -> nn.Module:
    """An encoder-decoder whose config ties the encoder to the decoder (``tie_encoder_decoder``)."""
    sizes = dict(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24)
    config = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(
        transformers.BertConfig(**sizes),
        transformers.BertConfig(**sizes, is_decoder=True, add_cross_attention=True),
        tie_encoder_decoder=True,
    )
    model = transformers.EncoderDecoderModel(config)
    head = ["cls.predictions.decoder.bias", "cls.predictions.decoder.weight"]
    return as_transformers4(model, {"": None, "decoder": head})  # 4.x EncoderDecoderModel lists none


def quietly(build: Callable[[], nn.Module]) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return build()


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (gpt2_4, {"lm_head.weight": "transformer.wte.weight"}),
        (lambda: gpt2_4(tie_word_embeddings=False), {}),  # the config does not tie: nothing declared
        (lambda: gpt2_4(torchscript=True), {}),  # 4.x clones the embedding for TorchScript
        (t5_4, dict.fromkeys(T5_TIED, "shared.weight")),
        (
            bart_4,
            {
                "lm_head.weight": "model.shared.weight",
                "model.encoder.embed_tokens.weight": "model.shared.weight",
                "model.decoder.embed_tokens.weight": "model.shared.weight",
            },
        ),
    ],
    ids=["gpt2", "gpt2-untied", "gpt2-torchscript", "t5", "bart"],
)
def test_a_transformers4_list_declares_its_targets_tied_to_the_input_embedding(
    build: Callable[[], nn.Module], expected: dict[str, str]
) -> None:
    assert declared_ties(quietly(build)) == expected


def test_transformers4_tie_encoder_decoder_ties_each_encoder_weight_to_the_decoders() -> None:
    model = quietly(bert2bert_4)
    declared = declared_ties(model)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    pairs = {n: f"decoder.bert.{n.removeprefix('encoder.')}" for n in names if n.startswith("encoder.")}
    pairs = {t: s for t, s in pairs.items() if s in names and ".pooler." not in t}  # the decoder has no pooler
    assert pairs and {t: declared[t] for t in pairs if t in declared} == pairs
    # The decoder's head takes the decoder's own input embedding (its bias, no embedding-shaped tensor, is not one).
    assert declared["decoder.cls.predictions.decoder.weight"] == "decoder.bert.embeddings.word_embeddings.weight"
    assert "decoder.cls.predictions.decoder.bias" not in declared


def test_a_file_without_the_tied_target_loads_into_a_transformers4_model_whose_tie_broke(tmp_path: Path) -> None:
    """A transformers-style file stores the embedding alone; the 4.x model's tie was broken (two
    equal tensors, as a plain move leaves them): the declared tie fills the head and re-ties it."""
    source = quietly(gpt2).eval()
    state = {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}
    safetensors.torch.save_file(state, tmp_path / "hf.safetensors")
    model = quietly(gpt2_4).eval()
    model.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach().clone())  # type: ignore[union-attr]
    result = tiekit.load_model(model, tmp_path / "hf.safetensors")
    assert result.plan_origin == "model" and not result.missing
    assert model.lm_head.weight is model.transformer.wte.weight  # type: ignore[union-attr]
    assert torch.equal(source(IDS).logits, model(IDS).logits)


def test_a_declared_transformers4_tie_a_plain_move_broke_is_restored_by_a_tiekit_move() -> None:
    model = quietly(gpt2_4)
    model.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach().clone())  # type: ignore[union-attr]
    tiekit.move(model, dtype=torch.float64)
    assert model.lm_head.weight is model.transformer.wte.weight  # type: ignore[union-attr]


def test_a_tied_save_loaded_into_a_transformers4_model_built_untied_names_the_config_tie(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt2().save_pretrained(tmp_path)  # type: ignore[operator]
    untied = quietly(lambda: gpt2_4(tie_word_embeddings=False))
    with pytest.raises(tiekit.CheckpointError) as info:
        tiekit.load_model(untied, tmp_path)
    message = str(info.value)
    assert "missing 'lm_head.weight'" in message
    assert "ties lm_head.weight to transformer.wte.weight when its config says so" in message


def test_a_transformers4_model_held_by_a_wrapper_declares_its_ties_under_its_path() -> None:
    """Read from the wrapper (a LightningModule's self.model) as from the model, prefixed; a tie a
    plain move broke is restored by a tiekit.move of the wrapper."""
    wrapper = nn.Module()
    wrapper.model = quietly(gpt2_4)
    assert declared_ties(wrapper) == {"model.lm_head.weight": "model.transformer.wte.weight"}
    model = wrapper.model
    model.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach().clone())  # type: ignore[union-attr]
    tiekit.move(wrapper, dtype=torch.float64)
    assert model.lm_head.weight is model.transformer.wte.weight  # type: ignore[union-attr]
