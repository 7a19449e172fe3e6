"""The single-process XLA examples run as examples/README.md says and print what it promises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lines_of(example: str, **env: str) -> list[str]:
    """The stdout lines of ``examples/<example>`` run on XLA:CPU (failing the test if it fails)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example)],
        capture_output=True,
        text=True,
        env={**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT), **env},
        timeout=300,
        check=True,
    )
    return result.stdout.splitlines()


@pytest.mark.xla
def test_move_hf_model_example() -> None:
    lines = _lines_of("move_hf_model.py")
    assert "plain .to(xla): 28 -> 29 parameters, tied: False" in lines
    assert "tiekit.move:    28 -> 28 parameters, tied: True" in lines
    assert lines[-1].endswith("still tied: True")


@pytest.mark.xla
def test_weight_sharing_example() -> None:
    lines = _lines_of("weight_sharing.py", CPU_NUM_DEVICES="2")
    assert lines[0] == "strategy 'xla' on 2 xla device(s), 80 steps"
    first, last = (float(x) for x in lines[1].removeprefix("loss ").split(" -> "))
    assert last < first / 10
    assert "replicas bit-identical: True; tie kept on every device: True" in lines
    assert lines[-1] == "layer_3.weight is layer_1.weight: True"
