"""examples/move_hf_model.py runs and shows the break and the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.xla
def test_move_hf_model_example() -> None:
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "move_hf_model.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    lines = result.stdout.splitlines()
    assert "plain .to(xla): 28 -> 29 parameters, tied: False" in lines
    assert "tiekit.move:    28 -> 28 parameters, tied: True" in lines
    assert lines[-1].endswith("still tied: True")
