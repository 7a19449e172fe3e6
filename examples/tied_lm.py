"""A small character-level language model whose output layer is tied to its embedding.

    PJRT_DEVICE=CPU .venv/bin/python examples/tied_lm.py        # same as `tiekit demo`

``build()`` is the zero-argument factory `tiekit.fit` needs for spawn-based launches (each
replica builds its own copy from the same seed); ``corpus()`` is the training data, the
Shakespeare sonnets in ``examples/data/`` (public domain); ``generate()`` samples text.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

DATA = Path(__file__).resolve().parent / "data" / "sonnets.txt"
# A fixed vocabulary (newline + printable ASCII), so the model does not depend on the corpus.
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
CONTEXT = 64


def encode(text: str) -> torch.Tensor:
    """Character ids; characters outside the vocabulary become "?"."""
    unknown = VOCAB.index("?")
    return torch.tensor([VOCAB.find(c) if c in VOCAB else unknown for c in text], dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    return "".join(VOCAB[i] for i in ids.tolist())


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm_1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm_1(x)).view(b, t, 3, self.heads, w // self.heads).transpose(1, 3).unbind(2)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.norm_2(x))


class TiedLM(nn.Module):
    """Embedding -> transformer blocks -> output layer that *is* the embedding matrix.

    A plain ``nn.Module``: a bare ``.to(xla)`` gives ``head`` a copy of the matrix (the tie
    breaks); `tiekit.fit` moves it with `tiekit.move`, which keeps one. ``forward(ids, targets)``
    returns the mean cross-entropy (so `tiekit.fit` needs no ``loss_fn``); ``forward(ids)``
    returns the logits.
    """

    def __init__(self, vocab: int = len(VOCAB), width: int = 128, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(CONTEXT, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # the tie: one matrix, read twice
        nn.init.normal_(self.embed.weight, std=1 / math.sqrt(width))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(ids) + self.position[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Every ``CONTEXT``-long window of the text and the same window shifted by one character."""

    def __init__(self, text: str, stride: int = 1) -> None:
        self.ids = encode(text)
        self.stride = stride

    def __len__(self) -> int:
        return (len(self.ids) - CONTEXT - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride
        chunk = self.ids[start : start + CONTEXT + 1]
        return chunk[:-1], chunk[1:]


def build() -> TiedLM:
    """The zero-argument factory: a fresh, randomly initialised model (seed it before calling)."""
    return TiedLM()


def corpus(stride: int = 1) -> CharWindows:
    """The training set: windows over the sonnets in ``examples/data/sonnets.txt``."""
    return CharWindows(DATA.read_text(encoding="utf-8"), stride)


@torch.no_grad()
def generate(model: nn.Module, prompt: str, length: int = 200, temperature: float = 0.8, seed: int = 0) -> str:
    """Sample ``length`` characters after ``prompt`` (on the model's device, one at a time)."""
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    ids = encode(prompt)
    for _ in range(length):
        window = ids[-CONTEXT:].unsqueeze(0).to(device)
        logits = model(window)[0, -1].float().cpu() / temperature
        ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=generator)])
    return decode(ids)


if __name__ == "__main__":
    from tiekit.cli import main

    raise SystemExit(main(["demo"]))
