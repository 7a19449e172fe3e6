"""examples/sharded_checkpoint.py runs: 2 FSDP2 processes save, this process loads and converts."""

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
