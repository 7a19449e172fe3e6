"""The ``tiekit`` command: ``demo``, ``inspect``, ``verify`` and ``--version``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import tiekit
from tiekit.errors import CheckpointError, TieError, TiekitError


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
    _add_inspect_and_verify(sub)
    return parser


def _add_inspect_and_verify(sub: Any) -> None:
    inspect_parser = sub.add_parser(
        "inspect",
        help="show the ties, tensors and sizes of a checkpoint, or the tie plan of a model",
        description="TARGET is a .safetensors file, a *.safetensors.index.json, a folder holding one, "
        "or module:factory (e.g. examples.tied_lm:build), which is built on the meta device when possible.",
    )
    inspect_parser.add_argument("target", metavar="TARGET", help="PATH or module:factory")
    inspect_parser.add_argument("--json", action="store_true", help="print JSON for machines")
    inspect_parser.add_argument("--tensors", action="store_true", help="list every stored tensor")
    inspect_parser.add_argument(
        "--check-values", action="store_true", help="read the data and report byte-identical stored tensors"
    )
    inspect_parser.set_defaults(func=inspect_command)
    verify_parser = sub.add_parser(
        "verify",
        help="load a checkpoint into a fresh model and check every key, shape and tie (exit 0 or 1)",
        description="Builds the model with --model module:factory, loads PATH into it with tiekit.load_model "
        "(strict) and checks every key, shape, dtype and tie. Exit code 0 when everything holds, 1 otherwise.",
    )
    verify_parser.add_argument("path", metavar="PATH", help="a .safetensors file, an index, or a folder")
    verify_parser.add_argument("--model", required=True, metavar="MODULE:FACTORY", help="e.g. examples.tied_lm:build")
    verify_parser.add_argument("--json", action="store_true", help="print the report as JSON")
    verify_parser.set_defaults(func=verify_command)


def inspect_command(args: argparse.Namespace) -> int:
    """``tiekit inspect TARGET``: a checkpoint's ties and sizes, or a model's tie plan."""
    from tiekit import inspection

    if inspection.is_factory_spec(args.target):
        model_report = inspection.inspect_model(args.target)
        print(json.dumps(model_report.to_dict(), indent=2) if args.json else model_report.render())
        return 0
    if not os.path.exists(args.target):
        raise inspection.TargetError(f"{args.target}: no such file or folder, and not module:factory")
    report = inspection.inspect_file(args.target, check_values=args.check_values)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.render(tensors=args.tensors))
    return 0


def verify_command(args: argparse.Namespace) -> int:
    """``tiekit verify PATH --model module:factory``: 0 when the checkpoint fits the model, else 1."""
    from tiekit import inspection

    outcome = inspection.verify_checkpoint(args.path, args.model)
    print(json.dumps(outcome.to_dict(), indent=2) if args.json else outcome.render())
    return 0 if outcome.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tiekit`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("tiekit: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one line and a hint, whatever failed; --debug shows the traceback
        if args.debug:
            raise
        print(f"tiekit: error: {_one_line(exc)}", file=sys.stderr)
        print(f"hint: {_hint(exc)}; run again with --debug for the full traceback", file=sys.stderr)
        return 1


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, TiekitError):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _hint(exc: BaseException) -> str:
    hint = getattr(exc, "hint", None)
    if isinstance(hint, str):
        return hint
    if isinstance(exc, CheckpointError):
        return "see 'Errors and how to recover' in docs/checkpoints.md"
    if isinstance(exc, TieError):
        return "see 'When the check fires' in docs/ties.md"
    if isinstance(exc, TiekitError):
        return "see docs/index.md"
    if isinstance(exc, ImportError):
        return "install the missing package named above (torch_xla: pip install 'tiekit[xla]')"
    return "this was not expected; please report it with the traceback"


if __name__ == "__main__":
    sys.exit(main())
