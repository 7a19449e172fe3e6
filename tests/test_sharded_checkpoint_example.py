"""examples/sharded_checkpoint.py runs: 2 FSDP2 processes save, this process loads and converts;
examples/evaluate_beside_training.py runs: an evaluator process reads the folder training saves into."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from launching import ROOT, base_env, run_ok

EXAMPLES = ROOT / "examples"


def test_sharded_checkpoint_example(tmp_path: Path) -> None:
    env = base_env()
    env.pop("PJRT_DEVICE", None)  # the CPU and gloo only
    runs = run_ok(
        [[sys.executable, str(EXAMPLES / "sharded_checkpoint.py"), str(tmp_path / "out")]], env=env, cwd=EXAMPLES
    )
    # Only the example's numbered steps: a launcher or gloo may print other lines that start with a digit.
    lines = [line for line in runs[0].output.splitlines() if re.match(r"\d\. ", line)]
    assert lines[0] == "1. saved by 2 processes: __0_0.distcp, __1_0.distcp", lines
    assert lines[1] == (
        "2. loaded in 1 process: head.weight is embed.weight: True, same weights as training in one process: True, "
        "extra: {'step': 1}, optimizer state for 28 parameters"
    ), lines
    assert (
        lines[2]
        == "3. converted to model.safetensors: 28 tensors, embed.weight stored: True, head.weight stored: False"
    )
    assert len(lines) == 3


def test_evaluate_beside_training_example(tmp_path: Path) -> None:
    """An evaluator process loads the folder a training process keeps saving into in the
    background: every save it reads is whole and tied, in step order, up to the last one."""
    env = base_env()
    env.pop("PJRT_DEVICE", None)
    command = [sys.executable, str(EXAMPLES / "evaluate_beside_training.py"), str(tmp_path / "out")]
    [run] = run_ok([command], env=env, cwd=EXAMPLES)
    evaluated = [line for line in run.output.splitlines() if line.startswith("evaluated step ")]
    assert evaluated and all(line.endswith("head.weight is embed.weight: True") for line in evaluated), run.output
    assert "trainer: 40 steps, a save every 4 into" in run.output
    last = [line for line in run.output.splitlines() if line.startswith("evaluator: ")]
    assert last == [f"evaluator: {len(evaluated)} saves evaluated, steps in order: True, last step 40"], run.output
