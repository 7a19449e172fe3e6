"""examples/weight_sharing.py runs as examples/README.md says: fit on 2 XLA devices, the tie kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.xla
def test_weight_sharing_example() -> None:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "weight_sharing.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    lines = result.stdout.splitlines()
    assert lines[0] == "strategy 'xla' on 2 xla device(s), 80 steps"
    first, last = (float(x) for x in lines[1].removeprefix("loss ").split(" -> "))
    assert last < first / 10
    assert "replicas bit-identical: True; tie kept on every device: True" in lines
    assert lines[-1] == "layer_3.weight is layer_1.weight: True"
