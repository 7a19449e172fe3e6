"""The ``tiekit`` command: ``demo``, ``inspect``, ``verify``, ``convert`` and ``--version``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tiekit
from tiekit.checkpoint.layout import saved_at
from tiekit.errors import CheckpointError, TieError, TiekitError


def demo(args: argparse.Namespace) -> int:
    """The main job: train the tied LM of examples/ on every XLA:CPU core in bf16, save a tied
    checkpoint, reload it into a fresh model, show the tie survived, and sample some text."""
    import functools
    import importlib
    import time

    import torch

    from tiekit import devices

    root = Path(__file__).resolve().parents[1]
    if not (root / "examples" / "tied_lm.py").is_file():
        raise TiekitError(f"tiekit demo trains examples/tied_lm.py of a source checkout; none found under {root}")
    sys.path.insert(0, str(root))  # spawned replicas inherit sys.path and import examples.tied_lm too
    tied_lm = importlib.import_module("examples.tied_lm")

    count: int | str = "auto"
    if devices.xla_wanted():
        if os.environ.get("PJRT_DEVICE", "").upper() == "CPU":
            os.environ.setdefault("CPU_NUM_DEVICES", str(os.cpu_count() or 1))  # every core an XLA device
        strategy = "xla"
    else:
        print("torch_xla is not configured (no PJRT_DEVICE): training with DDP on the CPU cores instead")
        strategy, count = "ddp", os.cpu_count() or 1
    out = Path(args.out)
    checkpoints = _unused_checkpoint_dir(out)
    if checkpoints != out / "checkpoints":
        print(f"{out / 'checkpoints'} holds an earlier demo's checkpoints: this one writes into {checkpoints}")
    started = time.perf_counter()
    result = tiekit.fit(
        tied_lm.build,
        tied_lm.corpus(),
        max_steps=args.steps,
        batch_size=args.batch_size,
        precision=args.precision,
        optimizer=functools.partial(torch.optim.AdamW, lr=3e-3),
        strategy=strategy,
        devices=count,
        checkpoint_dir=checkpoints,
        log_dir=out / "logs",
    )
    first, last = result.losses[0], sum(result.losses[-10:]) / len(result.losses[-10:])
    print(
        f"trained {result.steps} steps on {result.world_size} {result.device_type.upper()} device(s) "
        f"({result.strategy!r}, {result.precision}) in {time.perf_counter() - started:.0f} s, "
        f"{result.samples_per_second:.0f} samples/s"
    )
    print(f"loss {first:.3f} -> {last:.3f} (first step -> mean of the last 10)")
    print(f"replicas bit-identical: {result.replicas_identical}; ties kept on the device: {result.ties_kept}")
    print(f"tied checkpoint: {result.checkpoint}")

    assert result.checkpoint is not None  # fit always writes one when given checkpoint_dir
    fresh = tied_lm.build()
    tiekit.load_checkpoint(result.checkpoint, model=fresh)
    plan = tiekit.find_ties(fresh)
    tied = fresh.head.weight is fresh.embed.weight
    trained = result.model.state_dict()
    same = all(torch.equal(t, trained[k]) for k, t in fresh.state_dict().items())
    names = dict(fresh.named_parameters(remove_duplicate=False))
    print(f"reloaded into a fresh {type(fresh).__name__}; its tie plan:")
    print(plan)
    print(
        f"parameters: {plan.total_count} names, {plan.unique_count} tensors, "
        f"{sum(p.numel() for p in fresh.parameters()):,} values "
        f"({sum(p.numel() for p in names.values()):,} if the tie were broken); "
        f"head.weight is embed.weight: {tied}; weights equal the trained ones: {same}"
    )
    if strategy == "xla":
        import copy

        plain = copy.deepcopy(fresh).to(devices.resolve_device("xla"))
        still = plain.head.weight is plain.embed.weight
        print(
            f"for comparison, a plain .to(xla) of the same model: {plan.unique_count} -> "
            f"{len(list(plain.parameters()))} tensors, head.weight is embed.weight: {still}"
        )
    print("sample:")
    print(tied_lm.generate(fresh, "Shall I compare thee", length=args.sample_length))
    return 0 if tied and same and result.ties_kept else 1


def _unused_checkpoint_dir(out: Path) -> Path:
    """``out/checkpoints``, or when it holds an earlier demo's checkpoints the first of
    ``out/checkpoints-2``, ``-3``... that holds none: each demo trains from scratch, and fit
    refuses a fresh run in a folder holding another run's checkpoints (it would write over them)."""
    from tiekit.train.state import checkpoints_in

    folder, n = out / "checkpoints", 1
    while folder.exists() and checkpoints_in(folder):
        n += 1
        folder = out / f"checkpoints-{n}"
    return folder


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiekit", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tiekit {tiekit.__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_parser = sub.add_parser("demo", parents=[_debug_option()], help="the main job: see README")
    demo_parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    demo_parser.add_argument("--batch-size", type=int, default=16, help="per device (default 16)")
    demo_parser.add_argument("--precision", default="bf16-mixed", help="default bf16-mixed")
    demo_parser.add_argument("--out", default="runs/demo", help="checkpoints and logs go here (default runs/demo)")
    demo_parser.add_argument("--sample-length", type=int, default=200, help="characters to generate")
    demo_parser.set_defaults(func=demo)
    _add_inspect_and_verify(sub)
    _add_convert(sub)
    return parser


def _debug_option() -> argparse.ArgumentParser:
    """``--debug`` for a command's own options: every error's hint says "run again with --debug",
    which ``tiekit inspect x --debug`` then is. Its default SUPPRESS leaves the main parser's
    value (False, or True when given before the command) when the command's options lack it."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    return options


def _add_convert(sub: Any) -> None:
    convert_parser = sub.add_parser(
        "convert",
        parents=[_debug_option()],
        help="convert a sharded (DCP) checkpoint folder to tied safetensors, or back, one tensor at a time",
        description="SRC is a tiekit.save_sharded folder, a plain torch.distributed.checkpoint folder, or a "
        ".safetensors file, index or folder. A DCP source becomes DST.safetensors (or a folder holding "
        "model.safetensors, or shards with --max-shard-size); a safetensors source becomes a save_sharded folder "
        "DST. Tied names are written once; tied names stored with different values are refused.",
    )
    convert_parser.add_argument("src", metavar="SRC")
    convert_parser.add_argument("dst", metavar="DST", help="must not hold a checkpoint already")
    convert_parser.add_argument("--max-shard-size", help="e.g. 5GB: write Hugging Face style shards and an index")
    convert_parser.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="take ties from this model (built on the meta device), e.g. for a "
        "plain DCP folder that stores both names of a tie",
    )
    convert_parser.add_argument("--json", action="store_true", help="print the result as JSON")
    convert_parser.set_defaults(func=convert_command)


def convert_command(args: argparse.Namespace) -> int:
    """``tiekit convert SRC DST``: 0 when written."""
    from tiekit import inspection
    from tiekit.dcp.convert import convert_silently, converted

    with _factory_output(args):
        plan = inspection.model_plan(inspection.build_model(args.model).model) if args.model else None
    result = convert_silently(args.src, args.dst, plan=plan, max_shard_size=args.max_shard_size)  # left_out: below
    if args.json:
        print(json.dumps({"files": list(result.files), "stored": len(result.stored), "merged": list(result.merged),
                          "bytes": result.bytes, "left_out": list(result.left_out)}, indent=2))  # fmt: skip
    else:
        merged = f"; merged into their tie source: {', '.join(result.merged)}" if result.merged else ""
        print(f"{args.src} -> {args.dst}: {len(result.stored)} tensors, {result.bytes:,} bytes in "
              f"{len(result.files)} file(s){merged}")  # fmt: skip
        if result.left_out:
            print(f"  converted {converted(args.src, result)}")
    return 0


def _add_inspect_and_verify(sub: Any) -> None:
    inspect_parser = sub.add_parser(
        "inspect",
        parents=[_debug_option()],
        help="show the ties, tensors and sizes of a checkpoint, or the tie plan of a model",
        description="TARGET is a .safetensors file, a *.safetensors.index.json, a folder holding one, "
        "a tiekit.save_sharded folder or a plain torch.distributed.checkpoint one, or module:factory (e.g. "
        "examples.tied_lm:build), which is built on the meta device when possible.",
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
        parents=[_debug_option()],
        help="load a checkpoint into a fresh model and check every key, shape and tie (exit 0 or 1)",
        description="Builds the model with --model module:factory, loads PATH into it with tiekit.load_model "
        "(strict; tiekit.load_sharded for a save_sharded folder) and checks every key, shape, dtype and tie. "
        "Exit code 0 when everything holds, 1 otherwise.",
    )
    verify_parser.add_argument(
        "path", metavar="PATH", help="a .safetensors file, an index, a folder, or a tiekit.save_sharded folder"
    )
    verify_parser.add_argument("--model", required=True, metavar="MODULE:FACTORY", help="e.g. examples.tied_lm:build")
    verify_parser.add_argument("--json", action="store_true", help="print the report as JSON")
    verify_parser.set_defaults(func=verify_command)


def inspect_command(args: argparse.Namespace) -> int:
    """``tiekit inspect TARGET``: a checkpoint's ties and sizes, or a model's tie plan."""
    from tiekit import inspection

    if inspection.is_factory_spec(args.target):
        with _factory_output(args):
            model_report = inspection.inspect_model(args.target)
        print(json.dumps(model_report.to_dict(), indent=2) if args.json else model_report.render())
        return 0
    # A file path a sharded save wrote its index beside (max_shard_size) is read through the index.
    if not saved_at(args.target).exists():
        raise inspection.TargetError(f"{args.target}: no such file or folder, and not module:factory")
    report = inspection.inspect_file(args.target, check_values=args.check_values)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.render(tensors=args.tensors))
    return 0


def verify_command(args: argparse.Namespace) -> int:
    """``tiekit verify PATH --model module:factory``: 0 when the checkpoint fits the model, else 1."""
    from tiekit import inspection

    with _factory_output(args):  # builds the model with the factory, then loads
        outcome = inspection.verify_checkpoint(args.path, args.model)
    print(json.dumps(outcome.to_dict(), indent=2) if args.json else outcome.render())
    return 0 if outcome.ok else 1


def _factory_output(args: argparse.Namespace) -> contextlib.AbstractContextManager[Any]:
    """Where the user's factory prints while it is imported and run: under ``--json`` to stderr,
    so stdout holds the JSON alone, as a program reading it needs."""
    return contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()


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
    except BrokenPipeError:
        # The reader went away (`tiekit inspect ... | head`): stop quietly, as other tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
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
