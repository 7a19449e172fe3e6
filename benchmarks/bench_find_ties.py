"""find_ties speed on a synthetic model of N blocks, against one named_parameters pass (the floor)
and, when installed, Lightning's find_shared_parameters and accelerate's find_tied_parameters.

Targets (issue 2): at 4,000 blocks (~24,000 parameter names) find_ties <= 1.5x the pass, and
doubling the model at most doubles the time.

    .venv/bin/python benchmarks/bench_find_ties.py [--blocks 4000] [--repeats 15]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import best_times

import tiekit


def synthetic(blocks: int) -> nn.Module:
    """N small blocks (6 parameter names each) plus a tied embedding/head pair."""
    model = nn.Module()
    model.embed = nn.Embedding(16, 4)
    model.blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4)) for _ in range(blocks)
    )
    model.head = nn.Linear(4, 16, bias=False)
    model.head.weight = model.embed.weight
    return model


def contenders(model: nn.Module, with_peers: bool) -> dict[str, Callable[[], object]]:
    fns: dict[str, Callable[[], object]] = {
        "named_parameters pass": lambda: list(model.named_parameters(remove_duplicate=False)),
        "tiekit.find_ties": lambda: tiekit.find_ties(model),
    }
    if not with_peers:
        return fns
    try:
        from accelerate.utils import find_tied_parameters

        fns["accelerate find_tied_parameters"] = lambda: find_tied_parameters(model)
    except ImportError:
        print("accelerate not installed: skipped")
    try:
        from lightning.pytorch.utilities.parameter_tying import find_shared_parameters

        fns["lightning find_shared_parameters"] = lambda: find_shared_parameters(model)
    except ImportError:
        print("lightning not installed: skipped")
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    small, large = synthetic(args.blocks), synthetic(2 * args.blocks)
    names = len(list(small.named_parameters(remove_duplicate=False)))
    print(f"synthetic model: {args.blocks} blocks, {names} parameter names")
    times = best_times(contenders(small, with_peers=True), repeats=args.repeats)
    floor = times["named_parameters pass"]
    for name, seconds in times.items():
        print(f"  {name:34s} {seconds * 1e3:9.1f} ms  {seconds / floor:6.2f}x the pass")
    large_times = best_times(contenders(large, with_peers=False), repeats=args.repeats)
    growth = large_times["tiekit.find_ties"] / times["tiekit.find_ties"]
    print(
        f"doubling to {2 * args.blocks} blocks: find_ties {large_times['tiekit.find_ties'] * 1e3:.1f} ms, "
        f"{growth:.2f}x (pass {large_times['named_parameters pass'] / floor:.2f}x)"
    )
    ratio = times["tiekit.find_ties"] / floor
    print(
        f"targets: find_ties/pass {ratio:.2f} <= 1.5: {'met' if ratio <= 1.5 else 'MISSED'}; "
        f"doubling {growth:.2f} <= 2.0: {'met' if growth <= 2.0 else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
