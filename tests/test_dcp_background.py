"""Background sharded saves whose folder changes under them: reached through a symlink by a later
save, or its marker removed while the save writes (probe findings). The background writer is
held by a task queued before the save, so the save is pending when the folder changes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from held_writers import writer_held
from launching import ROOT, base_env
from models import WeightSharingModule, filled

import tiekit
from tiekit.dcp import MARKER_NAME
from tiekit.dcp.background import background_writer
from tiekit.dcp.layout import committed_save_id


def test_a_save_through_a_symlink_waits_for_the_pending_save_into_the_same_folder(tmp_path: Path) -> None:
    """Pending saves were found by the path as given: the save through the symlink did not wait,
    and one of the two failed with "committed into this folder by another writer" (the older one
    here; the later one when the older was already writing, and the folder kept the older)."""
    (tmp_path / "latest").symlink_to(tmp_path / "ck")
    release = threading.Event()
    background_writer().submit(release.wait, 60)
    older = tiekit.save_sharded(filled(1.0), tmp_path / "ck", blocking=False)
    threading.Timer(1.0, release.set).start()  # the save below must wait for the older one, held until then
    tiekit.save_sharded(filled(2.0), tmp_path / "latest")
    older.wait(60)
    loaded = WeightSharingModule()
    tiekit.load_sharded(loaded, tmp_path / "ck")
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in loaded.parameters())  # the later call wins
    assert loaded.layer_3.weight is loaded.layer_1.weight


def test_a_marker_removed_while_a_background_save_writes_does_not_fail_the_save(tmp_path: Path) -> None:
    """It failed with "save None was committed into this folder by another writer ... (save None
    stays the checkpoint)" and removed the new save: the folder held no checkpoint at all."""
    tiekit.save_sharded(filled(1.0), tmp_path / "ck")
    with writer_held("sharded"):
        handle = tiekit.save_sharded(filled(2.0), tmp_path / "ck", blocking=False)
        os.remove(tmp_path / "ck" / MARKER_NAME)  # a cleanup job, a user clearing the old checkpoint
    handle.wait(60)
    assert committed_save_id(tmp_path / "ck") is not None
    loaded = WeightSharingModule()
    tiekit.load_sharded(loaded, tmp_path / "ck")
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in loaded.parameters())


FORK_CHILD_SAVES = """
import multiprocessing, sys, threading, torch
import tiekit
from models import filled

def child(root):
    # The parent's writers (threads) are not in a fork child: its saves ran nowhere and waited for good.
    tiekit.save_sharded(filled(2.0), f"{root}/sharded", blocking=False)
    tiekit.save_checkpoint(f"{root}/file.safetensors", model=filled(2.0), step=2, blocking=False)
    # Leaves without wait(): a fork child exits by os._exit, skipping atexit (the sharded save's
    # exit join was one: the save stayed uncommitted, without a word).

if __name__ == "__main__":
    root = sys.argv[1]
    tiekit.save_sharded(filled(1.0), f"{root}/sharded", blocking=False).wait()  # the parent's writers started
    tiekit.save_checkpoint(f"{root}/file.safetensors", model=filled(1.0), step=1, blocking=False).wait()
    process = multiprocessing.get_context("fork").Process(target=child, args=(root,))
    process.start()
    process.join(60)
    print("child", process.exitcode, flush=True)
"""


@pytest.mark.newest_torch_only  # tiekit's own writer threads, the same on both stacks: run once
def test_a_fork_child_writes_its_background_saves_and_commits_them_without_wait(tmp_path: Path) -> None:
    script = tmp_path / "fork_child.py"
    script.write_text(FORK_CHILD_SAVES)
    env = {**base_env(), "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0 and "child 0" in done.stdout, done.stderr[-3000:]
    for load in (
        lambda model: tiekit.load_sharded(model, tmp_path / "sharded"),
        lambda model: tiekit.load_checkpoint(tmp_path / "file.safetensors", model=model),
    ):
        loaded = WeightSharingModule()
        load(loaded)
        assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in loaded.parameters())  # the child's save
        assert loaded.layer_3.weight is loaded.layer_1.weight
