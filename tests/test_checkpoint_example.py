"""examples/checkpoint_roundtrip.py runs and every step reports success."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_checkpoint_roundtrip_example() -> None:
    xla = importlib.util.find_spec("torch_xla") is not None
    command = [sys.executable, str(ROOT / "examples" / "checkpoint_roundtrip.py"), *(["--xla"] if xla else [])]
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, check=True)
    lines = [line for line in result.stdout.splitlines() if line[:1].isdigit() or line.startswith("   ")]
    assert lines[0].endswith("lm_head.weight stored: False")
    assert lines[1].endswith("optimizer state for wte: True")
    assert lines[2] == '2. safetensors.load_model: Missing key(s) in state_dict: "lm_head.weight"'
    assert lines[3].endswith("tied: True")
    assert lines[4] == "3. meta model loaded, tied: True, same logits: True"
    assert lines[5] == "4. resumed at step 1, next step identical to uninterrupted training: True"
    assert lines[6].startswith("5. from_pretrained on 3 shards") and lines[6].endswith("tied: True, same logits: True")
    if xla:
        assert lines[7] == "6. loaded onto xla:0, tied: True, same logits: True"
    assert len(lines) == 7 + xla
