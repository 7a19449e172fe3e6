"""`tiekit demo` (the README's main job), shortened: the loss falls, the tie survives the round trip."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.xla

ROOT = Path(__file__).resolve().parents[1]


def test_demo_trains_on_two_xla_devices_and_the_tie_survives(tmp_path: Path) -> None:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}
    command = [sys.executable, "-m", "tiekit.cli", "demo", "--steps", "40", "--out", str(tmp_path)]
    command += ["--sample-length", "40"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout

    assert "trained 40 steps on 2 XLA device(s) ('xla', bf16-mixed)" in out
    loss = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out)
    assert loss is not None
    first, last = float(loss.group(1)), float(loss.group(2))
    assert first > 4.0 and last < 0.75 * first  # from about ln(96) to well below it
    assert "replicas bit-identical: True; ties kept on the device: True" in out
    assert "embed.weight  parameter  96x128  float32  head.weight" in out  # the reloaded model's plan
    assert "head.weight is embed.weight: True; weights equal the trained ones: True" in out
    assert "a plain .to(xla) of the same model: 28 -> 29 tensors, head.weight is embed.weight: False" in out
    assert (tmp_path / "checkpoints" / "step-00000040.safetensors").is_file()
    assert (tmp_path / "logs" / "metrics.csv").is_file()
    sample = out.split("sample:\n", 1)[1]
    assert sample.startswith("Shall I compare thee") and len(sample.strip()) > len("Shall I compare thee")
    assert "40/40" in done.stderr  # the progress bar

    # Run again into the same --out: a fresh run, so fit would refuse the folder holding the first
    # run's checkpoint; the demo writes into a folder of its own and the first one's stays.
    first = (tmp_path / "checkpoints" / "step-00000040.safetensors").read_bytes()
    command = [sys.executable, "-m", "tiekit.cli", "demo", "--steps", "2", "--out", str(tmp_path)]
    again = subprocess.run([*command, "--sample-length", "5"], capture_output=True, text=True, env=env, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    moved = f"{tmp_path / 'checkpoints'} holds an earlier demo's checkpoints: this one writes into {tmp_path}"
    assert f"{moved}/checkpoints-2" in again.stdout, again.stdout
    assert (tmp_path / "checkpoints-2" / "step-00000002.safetensors").is_file()
    assert (tmp_path / "checkpoints" / "step-00000040.safetensors").read_bytes() == first
