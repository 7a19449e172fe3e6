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
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from launching import ROOT, base_env
from models import WeightSharingModule
from torch.utils.data import TensorDataset

import tiekit
from tiekit.train.folder_lock import LOCK_NAME

# tiekit's folder lock, the same code on both stacks: run once (keeps CI under its budget).
pytestmark = pytest.mark.newest_torch_only

RUN_A = """
import sys
import time
from pathlib import Path
from typing import Any

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


def test_the_lock_is_held_until_a_failed_runs_background_save_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that fails goes on writing its last background save into the folder after fit raised;
    its lock was released at once, and another run could take the folder meanwhile (probe). A run
    this process starts next (a resume right after the failed fit) waits for that save: it was
    refused as "in use by another tiekit.fit run", naming this very process (probe today52)."""
    import threading
    from concurrent.futures import Future

    from tiekit.checkpoint.handle import SaveHandle
    from tiekit.collective import Ranks
    from tiekit.train import folder_lock
    from tiekit.train.coordinate import Coordinator
    from tiekit.train.folder_lock import lock_checkpoint_dir

    folder = tmp_path / "ckpt"
    writing: Future[None] = Future()
    pending = SaveHandle(folder / "step-00000002.safetensors", "", writing)
    run = Coordinator(Ranks(0, 1, "single"), "run-a", pending=pending, folder_lock=lock_checkpoint_dir(folder, "run-a"))
    run.release()  # fit's end, the save still being written
    monkeypatch.setattr(folder_lock, "ENDED_RUN_WAIT_SECONDS", 0.2)  # not written within the wait: refused
    with pytest.raises(tiekit.TiekitError, match=re.escape('in use by another tiekit.fit run ({"run": "run-a"')):
        lock_checkpoint_dir(folder, "run-b")
    monkeypatch.setattr(folder_lock, "ENDED_RUN_WAIT_SECONDS", 60.0)
    threading.Timer(0.5, writing.set_result, [None]).start()  # written meanwhile: the folder is free then
    started = time.monotonic()
    lock_checkpoint_dir(folder, "run-b").release()  # waited for the save, not refused
    assert writing.done() and time.monotonic() - started >= 0.4
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


def _contents(folder: Path) -> dict[str, bytes | None]:
    """Every entry of ``folder`` by name: a file's bytes, None for a folder."""
    return {p.name: p.read_bytes() if p.is_file() else None for p in sorted(folder.iterdir())}


def test_a_fresh_run_in_a_folder_holding_an_earlier_runs_checkpoints_is_refused(tmp_path: Path) -> None:
    """The lock covers runs at the same time only: a run started later without resume wrote its
    step-<n> names over the earlier run's checkpoints, silently, deleted them with checkpoint_keep,
    and a later resume="last" took the earlier run's newest step, trained on other data (probe)."""
    folder = tmp_path / "ckpt"
    kw: dict[str, Any] = {"loss_fn": F.mse_loss, "batch_size": 4, "progress": False, "devices": "cpu"}
    kw |= {"checkpoint_dir": folder, "checkpoint_every": 2}
    tiekit.fit(WeightSharingModule, data(), max_steps=4, **kw)  # the earlier run: step 2 and 4
    before = _contents(folder)
    assert sorted(before) == ["step-00000002.safetensors", "step-00000004.safetensors"]
    refused = re.escape(
        f"{folder}: checkpoint_dir already holds 2 checkpoint(s) of an earlier run (step-00000002.safetensors, "
        "step-00000004.safetensors), and this run was started without resume"
    )
    with pytest.raises(tiekit.TiekitError, match=refused) as raised:
        tiekit.fit(WeightSharingModule, data(), max_steps=3, checkpoint_keep=1, seed=5, **kw)
    assert 'Pass resume="last" to continue that run, or give this run another (or an empty) checkpoint_dir' in str(
        raised.value
    )
    assert _contents(folder) == before  # nothing written over, nothing deleted, the lock file gone
    # resume="last" continues the folder, and resume=<path> an older step on purpose (its run's
    # later steps are written again: the abandoned branch).
    assert tiekit.fit(WeightSharingModule, data(), max_steps=6, resume="last", **kw).steps == 6
    older = tiekit.fit(WeightSharingModule, data(), max_steps=4, resume=folder / "step-00000002.safetensors", **kw)
    assert older.checkpoint == folder / "step-00000004.safetensors"
    # A checkpoint from elsewhere, continued into this folder, would write over it all the same.
    elsewhere = tiekit.fit(WeightSharingModule, data(), max_steps=2, **{**kw, "checkpoint_dir": tmp_path / "other"})
    before = _contents(folder)
    with pytest.raises(tiekit.TiekitError, match=f"started from {re.escape(str(elsewhere.checkpoint))}, a checkpoint"):
        tiekit.fit(WeightSharingModule, data(), max_steps=4, resume=elsewhere.checkpoint, **kw)
    assert _contents(folder) == before
    # The folder itself is no checkpoint: said so, naming those it holds (not "outside it").
    with pytest.raises(tiekit.TiekitError, match=r"is a folder, not a checkpoint"):
        tiekit.fit(WeightSharingModule, data(), max_steps=4, resume=folder, **kw)

    # What a killed run leaves beside its complete checkpoints is no checkpoint: alone it says nothing.
    leftovers = tmp_path / "leftovers"
    uncommitted = leftovers / "step-00000006"  # a sharded save killed before its marker
    tiekit.save_sharded(WeightSharingModule(), uncommitted)
    (uncommitted / tiekit.dcp.MARKER_NAME).unlink()
    tiekit.save_sharded(WeightSharingModule(), leftovers / ".step-00000004.deleting")  # a deletion cut short
    (leftovers / ".step-00000002.safetensors.tiekit-tmp-host-1-0123abcd").write_bytes(b"half a file")
    (leftovers / LOCK_NAME).write_text('{"run": "killed"}')  # a killed run's lock file
    fresh = tiekit.fit(WeightSharingModule, data(), max_steps=2, **{**kw, "checkpoint_dir": leftovers})
    assert fresh.checkpoint == leftovers / "step-00000002.safetensors"
    # A committed sharded folder is a checkpoint: refused too, naming it.
    sharded = tmp_path / "sharded"
    tiekit.save_sharded(WeightSharingModule(), sharded / "step-00000003")
    with pytest.raises(tiekit.TiekitError, match=r"holds 1 checkpoint\(s\) of an earlier run \(step-00000003\)"):
        tiekit.fit(WeightSharingModule, data(), max_steps=2, **{**kw, "checkpoint_dir": sharded})
    assert sorted(p.name for p in sharded.iterdir()) == ["step-00000003"]


def test_the_refusal_of_a_folder_holding_checkpoints_is_raised_on_every_rank(tmp_path: Path) -> None:
    """Rank 0 decides (it holds the lock) and the others are told: none trains, none waits."""
    folder = tmp_path / "ckpt"
    kw: dict[str, Any] = {"loss_fn": F.mse_loss, "batch_size": 4, "progress": False, "checkpoint_dir": folder}
    tiekit.fit(WeightSharingModule, data(), max_steps=2, devices="cpu", **kw)
    before = _contents(folder)
    started = time.monotonic()
    with pytest.raises(tiekit.TiekitError, match=r"holds 1 checkpoint\(s\) of an earlier run") as raised:
        tiekit.fit(WeightSharingModule, data(), max_steps=2, strategy="ddp", devices=2, **kw)
    assert time.monotonic() - started < 90
    assert str(raised.value).startswith("replicas 0, 1 (processes "), str(raised.value)  # both raised it
    assert _contents(folder) == before
