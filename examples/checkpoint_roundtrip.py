"""Tied checkpoints, end to end: save, inspect with plain safetensors, load back into every kind of model.

    .venv/bin/python examples/checkpoint_roundtrip.py [--xla]

Builds a small GPT-2 from a config (no download), trains it one step, then:

1. saves a training checkpoint (weights once per tie group, AdamW state once per tied
   parameter) and shows that plain ``safetensors`` reads it;
2. shows ``safetensors.torch.load_model`` failing on a model whose tie is broken, and
   ``tiekit.load_model`` re-tying it;
3. loads the weights into a meta-device model (one allocation per unique tensor);
4. resumes training from the checkpoint and checks it matches uninterrupted training;
5. writes a Hugging Face folder that ``transformers`` ``from_pretrained`` loads;
6. with ``--xla``: loads straight onto the XLA device (run with ``PJRT_DEVICE=CPU`` without a TPU).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import safetensors.torch
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import tiekit

IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])


def build(seed: int, **config: object) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 without dropout (so training is reproducible), random weights, tied."""
    torch.manual_seed(seed)
    settings = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, use_cache=False)
    settings |= dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **config)
    return GPT2LMHeadModel(GPT2Config(**settings))


def step(model: GPT2LMHeadModel, optimizer: torch.optim.Optimizer) -> float:
    optimizer.zero_grad()
    loss = model(IDS, labels=IDS).loss
    loss.backward()
    optimizer.step()
    return loss.item()


def tied(model: GPT2LMHeadModel) -> bool:
    return model.lm_head.weight is model.transformer.wte.weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--xla", action="store_true", help="also load onto the XLA device")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tiekit-example-") as tmp:
        run(Path(tmp), args.xla)


def run(folder: Path, xla: bool) -> None:

    model = build(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, optimizer)
    path = folder / "checkpoint.safetensors"
    tiekit.save_checkpoint(path, model=model, optimizer=optimizer, step=1, extra={"rng": torch.get_rng_state()})

    # 1. a plain safetensors file: one copy of the tied weight, its optimizer state once
    keys = safetensors.torch.load_file(path)
    print(f"1. {len(keys)} tensors in the file; lm_head.weight stored: {'lm_head.weight' in keys}")
    print(f"   optimizer state for wte: {'optimizer/state/transformer.wte.weight/exp_avg' in keys}")

    # 2. a model whose tie is broken (what a plain .to(xla) does)
    broken = build(1)
    broken.lm_head.weight = torch.nn.Parameter(broken.lm_head.weight.detach().clone())
    weights = folder / "model.safetensors"
    tiekit.save_model(model, weights)
    with torch.no_grad():
        expected = model(IDS).logits  # what the saved weights compute
    try:
        safetensors.torch.load_model(broken, weights)
        print("2. safetensors.load_model: loaded")
    except RuntimeError as exc:
        print(f"2. safetensors.load_model: {str(exc).splitlines()[-1].strip()}")
    result = tiekit.load_model(broken, weights)
    print(f"   tiekit.load_model: re-tied {[g.names for g in result.retied]}, tied: {tied(broken)}")

    # 3. meta device: one allocation per unique tensor
    with torch.device("meta"):
        empty = build(2)
    tiekit.load_model(empty, weights)
    print(
        f"3. meta model loaded, tied: {tied(empty)}, same logits: {torch.equal(empty(IDS).logits, model(IDS).logits)}"
    )

    # 4. resume: identical to training straight on
    resumed = build(3)
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    restored = tiekit.load_checkpoint(path, model=resumed, optimizer=resumed_optimizer)
    same = step(model, optimizer) == step(resumed, resumed_optimizer)
    same &= torch.equal(model.transformer.wte.weight, resumed.transformer.wte.weight)
    print(f"4. resumed at step {restored['step']}, next step identical to uninterrupted training: {same}")

    # 5. a Hugging Face folder
    hf = folder / "hf"
    model.config.save_pretrained(hf)
    tiekit.save_model(model, hf / "model.safetensors", max_shard_size="200KB")
    loaded = GPT2LMHeadModel.from_pretrained(hf)
    shards = sorted(p.name for p in hf.glob("model-*.safetensors"))
    same = torch.equal(loaded(IDS).logits, model.eval()(IDS).logits)
    print(f"5. from_pretrained on {len(shards)} shards: tied: {tied(loaded)}, same logits: {same}")

    if xla:
        import torch_xla

        with torch.device("meta"):
            on_device = build(4)
        tiekit.load_model(on_device, weights, device="xla")
        close = torch.allclose(on_device(IDS.to(torch_xla.device())).logits.cpu(), expected, atol=1e-5)
        print(f"6. loaded onto {on_device.lm_head.weight.device}, tied: {tied(on_device)}, same logits: {close}")


if __name__ == "__main__":
    main()
