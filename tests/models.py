"""Models the tests share: the seeds' WeightSharingModule and small HF models from configs."""

from __future__ import annotations

import torch
from torch import nn

import tiekit


class WeightSharingModule(nn.Module):
    """The seeds' example, verbatim apart from the base class."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_1 = nn.Linear(32, 10, bias=False)
        self.layer_2 = nn.Linear(10, 32, bias=False)
        self.layer_3 = nn.Linear(32, 10, bias=False)
        self.layer_3.weight = self.layer_1.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_1(x)
        x = self.layer_2(x)
        x = self.layer_3(x)
        return x


class MixinWeightSharingModule(tiekit.TPUMixin, WeightSharingModule):
    pass


class DroppingWeightSharingModule(WeightSharingModule):
    """The same with dropout on its input: its steps draw from the random generators a resume restores."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.drop(x))


class ViewBuffers(nn.Module):
    """A parameter with buffers that are views of it: transposed, sliced and reshaped."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6))
        self.register_buffer("wt", self.w.detach().t())
        self.register_buffer("ws", self.w.detach()[:, 2:5])
        self.register_buffer("wv", self.w.detach().view(24))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.wt + x @ self.w.t()


class FunctionalHeadLM(nn.Module):
    """Logits from the embedding matrix read in the root's own forward (``F.linear(h,
    self.embed.weight)``), as hand-written language models often do: no output module owns it."""

    def __init__(self, vocab: int = 101, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([nn.Linear(dim, dim), nn.Linear(dim, dim)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return nn.functional.linear(h, self.embed.weight)


class Scaled(nn.Module):
    """A linear layer keeping extra state (as FP8 and quantised layers do): an amax history tensor
    that is no parameter or buffer, in the state dict as ``'<path>._extra_state'``."""

    def __init__(self, state: str = "tensor") -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.state = state
        self.amax = torch.zeros(4, dtype=torch.float64)
        self.given: list[object] = []

    def get_extra_state(self) -> object:
        return self.amax if self.state == "tensor" else {"amax": self.amax.tolist()}

    def set_extra_state(self, state: object) -> None:
        self.given.append(state)
        assert isinstance(state, torch.Tensor)
        self.amax = state


class ExtraStateLM(nn.Module):
    """A tied embedding and head around a `Scaled` layer: ``mid._extra_state`` beside a tie."""

    def __init__(self, state: str = "tensor") -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mid = Scaled(state)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


def gpt2(**overrides: object) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = dict(
        n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32, use_cache=False, bos_token_id=0, eos_token_id=0
    )
    config.update(overrides)
    return GPT2LMHeadModel(GPT2Config(**config))


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=96,
            tie_word_embeddings=True,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    )


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(
        T5Config(
            d_model=32,
            d_ff=64,
            num_layers=2,
            num_heads=2,
            d_kv=16,
            vocab_size=96,
            tie_word_embeddings=True,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


def albert() -> nn.Module:
    from transformers import AlbertConfig, AlbertForMaskedLM

    return AlbertForMaskedLM(
        AlbertConfig(
            embedding_size=16,
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=96,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=0,
        )
    )


def filled(value: float) -> WeightSharingModule:
    """The model whose weights (layer_1's, tied to layer_3's, and layer_2's) are all ``value``."""
    model = WeightSharingModule()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def broken_tie() -> WeightSharingModule:
    """The seeds' module with its tie broken (as after a plain .to(xla)) and different values."""
    model = WeightSharingModule()
    model.layer_3.weight = nn.Parameter(model.layer_1.weight.detach() + 1.0)
    return model


def snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every state name's tensor object and a copy of its values."""
    return {n: (t, t.detach().clone()) for n, t in model.state_dict(keep_vars=True).items()}


def assert_unchanged(model: nn.Module, before: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The model holds the same tensor objects (so the same ties) with the same values as ``before``."""
    now = model.state_dict(keep_vars=True)
    assert list(now) == list(before)
    for name, (tensor, values) in before.items():
        assert now[name] is tensor, f"{name} was replaced or re-tied"
        assert torch.equal(now[name], values), f"{name} was modified"


def assert_sharded_round_trip(
    model: nn.Module, optimizer: torch.optim.Optimizer, folder: object, fresh: nn.Module, tie: tuple[str, str]
) -> None:
    """``fresh`` (a new model of ``model``'s class) loads the sharded checkpoint ``folder`` with a new
    AdamW: the tie ``(source, tied)`` (module paths of the two weights) restored, every value and
    every optimizer moment equal to ``model``'s and ``optimizer``'s."""
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    tiekit.load_sharded(fresh, folder, optimizer=fresh_optimizer)  # type: ignore[arg-type]
    assert fresh.get_submodule(tie[1]).weight is fresh.get_submodule(tie[0]).weight
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][moment], fresh_optimizer.state[q][moment]), moment
