"""Background sharded saves whose folder changes under them: reached through a symlink by a later
save, or its marker removed while the save writes (probe findings). The background writer is
held by a task queued before the save, so the save is pending when the folder changes."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch
from held_writers import writer_held
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
