"""The ``tiekit`` command: ``tiekit demo`` and ``tiekit --version``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import tiekit
from tiekit.errors import TiekitError


def demo(args: argparse.Namespace) -> int:
    """Inspect the seeds' WeightSharingModule and a GPT-2 config model, then move one keeping ties."""
    import torch
    from torch import nn

    class WeightSharingModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer_1 = nn.Linear(32, 10, bias=False)
            self.layer_2 = nn.Linear(10, 32, bias=False)
            self.layer_3 = nn.Linear(32, 10, bias=False)
            self.layer_3.weight = self.layer_1.weight

    model = WeightSharingModule()
    plan = tiekit.find_ties(model)
    print(plan)
    tiekit.move(model, dtype=torch.bfloat16)
    print(
        f"after .to(bfloat16) through tiekit.move: layer_3.weight is layer_1.weight -> "
        f"{model.layer_3.weight is model.layer_1.weight}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiekit", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tiekit {tiekit.__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_parser = sub.add_parser("demo", help="the main job: see README")
    demo_parser.set_defaults(func=demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tiekit`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (TiekitError, FileNotFoundError, ImportError) as exc:
        if args.debug:
            raise
        print(f"tiekit: error: {exc}", file=sys.stderr)
        print("hint: run again with --debug for the full traceback", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
