"""A background save that fails is never silent, even when nothing waits for its handle: the next
save into the same folder warns, the process says so on stderr at exit, and a process group
destroyed under a save is named as the cause."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from launching import base_env, free_port, run_ok
from models import WeightSharingModule
from torch import nn

import tiekit

NEVER_WAITED = """
import sys
from torch import nn
import tiekit

handle = tiekit.save_checkpoint(sys.argv[1] + "/ckpt.safetensors", model=nn.Linear(2, 2), blocking=False)
if sys.argv[2] == "wait":
    try:
        handle.wait(60)
    except tiekit.CheckpointError as exc:
        print("wait raised:", exc)
"""


@pytest.mark.parametrize("waits", [False, True], ids=["never-waited", "waited"])
def test_a_failed_background_save_nothing_waited_for_is_reported_at_exit(tmp_path: Path, waits: bool) -> None:
    """Before, a script that never waited for its failed save exited 0 and printed nothing. The
    control: a script that waits gets the error from `wait` and no second report at exit."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    command = [sys.executable, "-c", NEVER_WAITED, str(blocker), "wait" if waits else "no"]
    [run] = run_ok([command], env=base_env(), cwd=tmp_path)
    report = "a background save nothing waited for: SaveHandle.wait() raises it"
    if waits:
        assert "wait raised:" in run.output and str(blocker) in run.output and report not in run.output, run.output
    else:
        assert f"tiekit: {blocker}" in run.output and report in run.output, run.output


def test_a_failed_sharded_save_nothing_waited_for_warns_at_the_next_save_into_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiekit.dcp.writer import DurableWriter  # the writer save_sharded uses

    def full_disk(self: DurableWriter, *args: object) -> None:
        raise OSError(28, "No space left on device")

    model = WeightSharingModule()
    tiekit.save_sharded(model, tmp_path / "ck")
    with monkeypatch.context() as patch:
        patch.setattr(DurableWriter, "write_data", full_disk)
        failed = tiekit.save_sharded(model, tmp_path / "ck", blocking=False)
        failed.join()
    with pytest.warns(RuntimeWarning, match=r"ck/save-\w+.*No space left on device.*nothing waited for this save"):
        tiekit.save_sharded(model, tmp_path / "ck", blocking=False).wait(60)
    with pytest.raises(tiekit.CheckpointError, match="No space left"):
        failed.wait(0)  # still raised by its own handle
    # A failure that was waited for is not reported again.
    with monkeypatch.context() as patch:
        patch.setattr(DurableWriter, "write_data", full_disk)
        seen = tiekit.save_sharded(model, tmp_path / "ck", blocking=False)
        with pytest.raises(tiekit.CheckpointError):
            seen.wait(60)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        tiekit.save_sharded(model, tmp_path / "ck", blocking=False).wait(60)
    fresh = WeightSharingModule()
    tiekit.load_sharded(fresh, tmp_path / "ck")
    assert fresh.layer_3.weight is fresh.layer_1.weight and torch.equal(fresh.layer_1.weight, model.layer_1.weight)


DESTROYED = """
import sys, threading
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
import tiekit
from tiekit.dcp.background import background_writer

def worker(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = nn.Sequential(nn.Embedding(30, 8), nn.Linear(8, 30, bias=False))
    model[1].weight = model[0].weight
    release = threading.Event()
    background_writer().submit(release.wait, 60)  # the save starts only after the destroy below
    handle = tiekit.save_sharded(model, out, blocking=False)
    dist.destroy_process_group()
    release.set()
    try:
        handle.wait(60)
        told = "waited"
    except tiekit.CheckpointError as exc:
        told = str(exc)
    with open(f"{out}-rank{rank}.txt", "w") as f:  # the ranks' prints would interleave
        f.write(told)

if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
    print("committed:", tiekit.dcp.is_sharded_checkpoint(sys.argv[2]))
"""


def test_a_process_group_destroyed_under_a_background_save_is_named_as_its_failure(tmp_path: Path) -> None:
    """Before, `wait` raised torch's "Group ... is not registered, please create group with
    torch.distributed.new_group API"."""
    (tmp_path / "destroyed.py").write_text(DESTROYED)
    command = [sys.executable, "destroyed.py", str(free_port()), str(tmp_path / "ck")]
    [run] = run_ok([command], env=base_env(), cwd=tmp_path)
    told = [Path(f"{tmp_path / 'ck'}-rank{rank}.txt").read_text() for rank in (0, 1)]
    for text in told:
        assert text.startswith(f"{tmp_path / 'ck'}/save-"), told
        assert "the process group was destroyed while this background save was under way" in text
        assert "wait for its handle (handle.wait()) before destroy_process_group()" in text
    assert "committed: False" in run.output, run.output


FILTER_SET_DURING_SAVE = """
import os, sys, threading, time, warnings
import torch.distributed as dist
from torch import nn
import tiekit
from tiekit.dcp.background import background_writer

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
model = nn.Sequential(nn.Embedding(30, 8), nn.Linear(8, 30, bias=False))
model[1].weight = model[0].weight
flag = f"{out}-filter-set"
release = threading.Event()
if rank == 1:
    background_writer().submit(release.wait, 60)  # rank 0's writer waits in DCP for this one's
handle = tiekit.save_sharded(model, out, blocking=False)
if rank == 0:
    time.sleep(2)  # its writer is inside DCP's save by now, waiting for rank 1's
    warnings.filterwarnings("error", message="the program's own")  # its own setting, made meanwhile
    open(flag, "w").close()
else:
    deadline = time.monotonic() + 60
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)
    release.set()
handle.wait(60)
kept = any(f[0] == "error" and f[1] is not None and f[1].pattern == "the program's own" for f in warnings.filters)
print(f"rank {rank}: filter kept {kept}", flush=True)
del model
dist.barrier()
dist.destroy_process_group()
"""


def test_warning_filters_the_program_sets_while_a_background_save_writes_stay(tmp_path: Path) -> None:
    """The writer thread ran DCP inside ``warnings.catch_warnings()``, which is not thread-safe: on
    leaving, it restored the filters it had found, and the main thread's "error" filter was gone
    (probe)."""
    out, port = tmp_path / "ck", str(free_port())
    commands = [[sys.executable, "-c", FILTER_SET_DURING_SAVE, str(rank), port, str(out)] for rank in (0, 1)]
    runs = run_ok(commands, env=base_env(), cwd=tmp_path)
    assert "rank 0: filter kept True" in runs[0].output, runs[0].output
    assert tiekit.dcp.is_sharded_checkpoint(out)


@pytest.mark.parametrize("kind", ["sharded", "single-file"])
def test_a_failed_background_save_keeps_no_copy_of_the_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Its handle kept the error with its traceback, whose frames (the writing closure's cells,
    DCP's per-rank errors) kept the save's host copies of the state for as long as the handle or
    the record of pending saves lived (probe; 1 copy sharded, 2 single-file)."""
    import gc

    from tiekit.dcp.writer import DurableWriter  # the writer save_sharded uses

    def full_disk(self: DurableWriter, *args: object) -> None:
        raise OSError(28, "No space left on device")

    rows = 4093 if kind == "sharded" else 4091  # sizes no other tensor of this process has
    model = nn.Sequential(nn.Embedding(rows, 64), nn.Linear(64, rows, bias=False))
    model[1].weight = model[0].weight
    if kind == "sharded":
        monkeypatch.setattr(DurableWriter, "write_data", full_disk)
        handle = tiekit.save_sharded(model, tmp_path / "ck", blocking=False)
    else:
        (tmp_path / "file").write_text("in the way")
        handle = tiekit.save_checkpoint(tmp_path / "file" / "ck.safetensors", model=model, blocking=False)
    handle.join()
    # The writing thread ends its work item just after the handle is done: wait until it took
    # the next one, so that what is left is what the handle keeps.
    from tiekit.checkpoint.saving import _background
    from tiekit.dcp.background import background_writer

    (background_writer() if kind == "sharded" else _background()).submit(lambda: None).result(60)
    gc.collect()
    own, size = model[0].weight.untyped_storage().data_ptr(), model[0].weight.numel()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated objects warns
        warnings.simplefilter("ignore")
        copies = [
            o
            for o in gc.get_objects()
            if isinstance(o, torch.Tensor) and o.numel() == size and o.untyped_storage().data_ptr() != own
        ]
    assert copies == []
    with pytest.raises(tiekit.CheckpointError, match="No space left" if kind == "sharded" else "cannot create"):
        handle.wait(0)


FILE_SIZE_LIMIT = """
import gc, resource, signal, sys, warnings, torch, tiekit
from torch import nn

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
warnings.simplefilter("ignore")
rows = 4093  # a size no other tensor of this process has
model = nn.Sequential(nn.Embedding(rows, 64), nn.Linear(64, rows, bias=False))
model[1].weight = model[0].weight
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))  # the disk refuses > 64 KiB
handle = tiekit.save_sharded(model, sys.argv[1], blocking=False)
handle.join()
from tiekit.dcp.background import background_writer
background_writer().submit(lambda: None).result(60)  # its work item over: what is left is the handle's
gc.collect()
own, size = model[0].weight.untyped_storage().data_ptr(), model[0].weight.numel()
tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel() == size]
copies = [t for t in tensors if t.untyped_storage().data_ptr() != own]
try:
    handle.wait(0)
    told = "saved"
except tiekit.CheckpointError as exc:
    told = str(exc)
print(len(copies), told)
"""


def test_a_background_sharded_save_failing_in_torchs_writer_keeps_no_copy_of_the_state(tmp_path: Path) -> None:
    """A real write failure (a file size limit) fails inside torch's zip writer: DCP's per-rank
    error had that RuntimeError as its context, whose frames (DCP's writer) held the tensors being
    written, 2 copies of the state for as long as the handle lived (probe). Every exception of the
    chain now loses its frames."""
    [run] = run_ok([[sys.executable, "-c", FILE_SIZE_LIMIT, str(tmp_path / "ck")]], env=base_env(), cwd=tmp_path)
    copies, told = run.output.strip().splitlines()[-1].split(" ", 1)
    assert "DCP could not write its shard files" in told, run.output
    assert copies == "0", run.output
