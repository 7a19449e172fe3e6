"""Keep a Hugging Face model's tied embeddings tied through a move to XLA, without subclassing it.

    PJRT_DEVICE=CPU .venv/bin/python examples/move_hf_model.py

Builds GPT-2 from a small config (no download), shows that a plain ``.to(xla)`` breaks the
wte/lm_head tie, then moves a second copy with ``tiekit.move`` and an optimizer built before the
move, and takes one training step on the XLA device.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import tiekit


def build() -> GPT2LMHeadModel:
    """A 2-layer GPT-2 from a config: random weights, tied wte/lm_head."""
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64, use_cache=False, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def main() -> None:
    import torch_xla

    device = torch_xla.device()
    print(tiekit.find_ties(build()))

    plain = build()
    before = len(list(plain.parameters()))
    plain.to(device)
    print(
        f"plain .to(xla): {before} -> {len(list(plain.parameters()))} parameters, "
        f"tied: {plain.lm_head.weight is plain.transformer.wte.weight}"
    )

    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tiekit.move(model, device, optimizer=optimizer)
    print(
        f"tiekit.move:    {before} -> {len(list(model.parameters()))} parameters, "
        f"tied: {model.lm_head.weight is model.transformer.wte.weight}"
    )

    ids = torch.randint(0, 256, (2, 16), device=device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    torch_xla.sync()
    print(
        f"one step on {device}: loss {loss.item():.3f}; still tied: "
        f"{model.lm_head.weight is model.transformer.wte.weight}"
    )


if __name__ == "__main__":
    main()
