"""A save killed with SIGKILL (issue 12): the previous sharded checkpoint still loads, and the
half-written save folder is never taken for a checkpoint. Real processes (tests/dcp_kill_worker.py)
killed while a blocking or an asynchronous save writes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dcp_kill_worker import DIM, ROWS, Tied
from launching import ROOT, TIMEOUT, base_env

import tiekit


@pytest.mark.parametrize(
    ("mode", "when"),
    [
        ("blocking", "partial"),
        ("blocking", "metadata"),
        ("blocking", "marker"),
        ("async", "partial"),
        ("async", "marker"),
    ],
)
def test_killed_save_leaves_the_previous_checkpoint(tmp_path: Path, mode: str, when: str) -> None:
    path = tmp_path / "ck"
    command = [sys.executable, str(ROOT / "tests" / "dcp_kill_worker.py"), str(path), mode, when]
    run = subprocess.run(command, env=base_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == -signal.SIGKILL, run.stdout + run.stderr
    assert "second save starts" in run.stdout
    folders = sorted(path.glob("save-*"))
    assert len(folders) == 2, folders  # the committed save and the killed one
    marker_folder = tiekit.dcp.layout.read_marker(path).folder
    killed = next(f for f in folders if f != marker_folder)
    shards = list(killed.glob("*.distcp"))
    if when == "partial":  # killed half way through the shard file
        assert shards and 0 < shards[0].stat().st_size < ROWS * DIM * 4
    else:  # every shard written; DCP's metadata too when killed at tiekit's commit
        assert shards
        assert (killed / ".metadata").exists() == (when == "marker")

    reference = Tied()
    tiekit.load_model(reference, path.with_name("ck.reference.safetensors"))
    model = Tied()
    model.head.weight = torch.nn.Parameter(torch.zeros(ROWS, DIM))
    tiekit.load_sharded(model, path)
    assert model.head.weight is model.embed.weight
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name

    with pytest.raises(tiekit.CheckpointError, match="a save folder inside a checkpoint"):
        tiekit.load_sharded(model, killed)  # never taken for a checkpoint, even when named
    left = sorted(p.name for p in path.glob(f".{tiekit.dcp.MARKER_NAME}.tiekit-tmp-*"))
    assert len(left) == (when == "marker"), left  # the marker's work folder, killed as it wrote it
    tiekit.save_sharded(model, path)  # the next commit clears the killed save away
    assert len(list(path.glob("save-*"))) == 1
    assert not list(path.glob(".*")), list(path.glob(".*"))  # and the killed commit's work folder
