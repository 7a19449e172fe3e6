"""One `tiekit.fit` run per ``checkpoint_dir`` (`tiekit.train.folder_lock`).

Two runs started in one folder wrote the same ``step-<n>`` names over each other's, silently, and
each one's ``checkpoint_keep`` deleted what the other rewrote; a later ``resume="last"`` took the
other run's weights with at most a warning about the seed (probe). Here run A (a subprocess)
holds the folder, paused inside its first epoch, while runs B (one process, then 2 DDP processes)
start in it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from launching import ROOT, base_env
from models import WeightSharingModule
from torch.utils.data import TensorDataset

import tiekit
from tiekit.train.folder_lock import LOCK_NAME

RUN_A = """
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import tiekit

folder, started, go, tests = (Path(a) for a in sys.argv[1:5])
sys.path.insert(0, str(tests))
from models import WeightSharingModule


class Paused(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        if i == 0 or not started.exists():
            started.write_text("in the first epoch")
            while not go.exists():  # held here until the test has tried its runs
                time.sleep(0.05)
        g = torch.Generator().manual_seed(i)
        return torch.randn(32, generator=g), torch.randn(10, generator=g)


tiekit.fit(WeightSharingModule, Paused(), loss_fn=F.mse_loss, batch_size=4, max_steps=4, checkpoint_dir=folder,
           checkpoint_every=2, devices="cpu", progress=False, shuffle=False)
print("run A finished", flush=True)
"""


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(16, 32, generator=g), torch.randn(16, 10, generator=g))


def test_a_second_run_in_a_folder_another_run_holds_is_refused_on_every_rank(tmp_path: Path) -> None:
    folder, started, go = tmp_path / "ckpt", tmp_path / "started", tmp_path / "go"
    (tmp_path / "run_a.py").write_text(RUN_A)
    a = subprocess.Popen(
        [sys.executable, str(tmp_path / "run_a.py"), str(folder), str(started), str(go), str(ROOT / "tests")],
        cwd=ROOT,
        env=base_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    kw = {"batch_size": 4, "max_steps": 2, "checkpoint_dir": folder, "checkpoint_every": 2, "progress": False}
    kw["loss_fn"] = F.mse_loss
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert a.poll() is None, a.communicate()[0]
            assert time.monotonic() < deadline, "run A did not start"
            time.sleep(0.1)
        held = re.escape('ckpt: checkpoint_dir is in use by another tiekit.fit run ({"run": ')
        with pytest.raises(tiekit.TiekitError, match=held + f'.*"pid": {a.pid}') as one:
            tiekit.fit(WeightSharingModule, data(), devices="cpu", **kw)
        assert "give each run its own checkpoint_dir" in str(one.value)
        # Two DDP processes: the writer holds the lock for the run; every rank raises, none waits.
        with pytest.raises(tiekit.TiekitError, match=held):
            tiekit.fit(WeightSharingModule, data(), strategy="ddp", devices=2, **kw)
        assert sorted(p.name for p in folder.iterdir()) == [LOCK_NAME]  # B wrote nothing
    finally:
        go.write_text("go")
        output = a.communicate(timeout=120)[0]
    assert a.returncode == 0 and "run A finished" in output, output
    # A's checkpoints are its own; its lock file went with it, and the folder is free again.
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000002.safetensors", "step-00000004.safetensors"]
    result = tiekit.fit(
        WeightSharingModule, data(), devices="cpu", resume="last", shuffle=False, **{**kw, "max_steps": 6}
    )
    assert result.checkpoint == folder / "step-00000006.safetensors"
    assert not (folder / LOCK_NAME).exists()


def test_the_lock_is_held_until_a_failed_runs_background_save_is_written(tmp_path: Path) -> None:
    """A run that fails goes on writing its last background save into the folder after fit raised;
    its lock was released at once, and another run could take the folder meanwhile (probe)."""
    from concurrent.futures import Future

    from tiekit.checkpoint.handle import SaveHandle
    from tiekit.collective import Ranks
    from tiekit.train.coordinate import Coordinator
    from tiekit.train.folder_lock import lock_checkpoint_dir

    folder = tmp_path / "ckpt"
    writing: Future[None] = Future()
    pending = SaveHandle(folder / "step-00000002.safetensors", "", writing)
    run = Coordinator(Ranks(0, 1, "single"), "run-a", pending=pending, folder_lock=lock_checkpoint_dir(folder, "run-a"))
    run.release()  # fit's end, the save still being written
    with pytest.raises(tiekit.TiekitError, match=re.escape('in use by another tiekit.fit run ({"run": "run-a"')):
        lock_checkpoint_dir(folder, "run-b")
    writing.set_result(None)  # written: the folder is free
    lock_checkpoint_dir(folder, "run-b").release()
    assert not folder.exists()  # made by the first lock, empty: removed by the last release


def test_a_run_that_wrote_nothing_leaves_no_folder_the_lock_made(tmp_path: Path) -> None:
    from tiekit.train.folder_lock import lock_checkpoint_dir

    lock_checkpoint_dir(tmp_path / "runs" / "exp1" / "ckpt", "run").release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the parents it made went too (probe: they stayed)
    (tmp_path / "runs").mkdir()
    kept = lock_checkpoint_dir(tmp_path / "runs" / "exp1" / "ckpt", "run")
    (tmp_path / "runs" / "exp1" / "ckpt" / "step-00000002.safetensors").write_text("written")
    kept.release()
    assert [p.name for p in (tmp_path / "runs" / "exp1" / "ckpt").iterdir()] == ["step-00000002.safetensors"]
