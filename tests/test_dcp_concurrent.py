"""Loading a sharded checkpoint folder while another process commits new saves into it (an
evaluator beside training): every rank reads one save, and a save replaced under the load is read
again from the new one instead of failing on its removed files."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from launching import TIMEOUT, base_env, free_port, run_ok
from torch import nn

import tiekit
from tiekit.checkpoint import reads
from tiekit.dcp import loading, records
from tiekit.inspection import inspect_file

# Another process saving into the folder: every weight is the value given, recorded in `extra`.
WRITER = """
import sys, torch
from torch import nn
import tiekit

model = nn.Sequential(nn.Embedding(40, 16), nn.Linear(16, 16), nn.Linear(16, 40, bias=False))
model[2].weight = model[0].weight
with torch.no_grad():
    for p in model.parameters():
        p.fill_(float(sys.argv[2]))
tiekit.save_sharded(model, sys.argv[1], extra={"value": float(sys.argv[2])})
"""


def tied() -> nn.Module:
    model = nn.Sequential(nn.Embedding(40, 16), nn.Linear(16, 16), nn.Linear(16, 40, bias=False))
    model[2].weight = model[0].weight
    return model


def commit_here(folder: Path, value: float) -> None:
    """What `WRITER` saves, saved by this process (the state a test starts from)."""
    model = tied()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    tiekit.save_sharded(model, folder, extra={"value": value})


def commit_from_another_process(folder: Path, value: float) -> None:
    subprocess.run([sys.executable, "-c", WRITER, str(folder), str(value)], env=base_env(), check=True, timeout=TIMEOUT)


def replaced_at_first_read(folder: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """DCP's reader, at its first read of the load, first lets another process commit a new save
    (which removes the files of the one being read). The saves the reads were of, in order."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    real = FileSystemReader.read_data
    reads: list[str] = []

    def read_data(self: FileSystemReader, *args: Any, **kwargs: Any) -> Any:
        reads.append(Path(self.path).name)
        if len(reads) == 1:
            commit_from_another_process(folder, 2.0)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemReader, "read_data", read_data)
    return reads


def test_a_save_committed_under_a_load_is_read_again_from_the_new_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "ck"
    commit_here(folder, 1.0)
    first = tiekit.load_sharded(tied(), folder).save_id
    reads = replaced_at_first_read(folder, monkeypatch)
    model = tied()
    result = tiekit.load_sharded(model, folder)
    assert result.save_id != first and result.extra == {"value": 2.0}
    assert reads[0] == f"save-{first}" and reads[-1] == f"save-{result.save_id}"
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in model.parameters())
    assert model[2].weight is model[0].weight


def test_without_reading_again_the_replaced_save_fails_on_its_removed_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: one attempt only, as before; the old save's files are gone, and the message
    says so (it called the removed file "damaged ... changed in place" before)."""
    folder = tmp_path / "ck"
    commit_here(folder, 1.0)
    replaced_at_first_read(folder, monkeypatch)
    monkeypatch.setattr(loading, "READ_ATTEMPTS", 1)
    gone = r"replaced by a newer save 1 times .*__0_0\.distcp: gone while the load read"
    with pytest.raises(tiekit.CheckpointError, match=gone):
        tiekit.load_sharded(tied(), folder)


def test_a_load_that_fails_for_another_reason_is_not_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "ck"
    commit_here(folder, 1.0)
    (shard,) = folder.glob("save-*/__0_0.distcp")
    shard.write_bytes(bytes(shard.stat().st_size))  # same size, not a torch.save record
    starts: list[int] = []
    real = loading._read

    def counted(*args: Any) -> Any:
        starts.append(1)
        return real(*args)

    monkeypatch.setattr(loading, "_read", counted)
    with pytest.raises(tiekit.CheckpointError, match=r"__0_0\.distcp: key '0\.weight' .* is damaged"):
        tiekit.load_sharded(tied(), folder)
    assert len(starts) == 1


RANKS_SPLIT = """
import json, subprocess, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn
import tiekit
from tiekit.dcp import loading, records

def tied():
    model = nn.Sequential(nn.Embedding(40, 16), nn.Linear(16, 16), nn.Linear(16, 40, bias=False))
    model[2].weight = model[0].weight
    return model

def worker(rank, port, writer, scenarios):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    real_marker, real_metadata, attempts = loading.read_marker, loading.save_metadata, loading.READ_ATTEMPTS
    for folder, moment, tries in scenarios:
        # The first time only: rank 0 reads the marker (and with moment "after-metadata" DCP's
        # metadata too), another process commits a new save, then rank 1 reads the marker.
        first = [True]

        def commit_then_release():
            subprocess.run([sys.executable, "-c", writer, folder, "2.0"], check=True)
            dist.barrier()

        def read_marker(path):
            if not first[0]:
                return real_marker(path)
            if rank == 1:
                first[0] = False
                dist.barrier()
                return real_marker(path)
            marker = real_marker(path)
            if moment == "after-marker":
                first[0] = False
                commit_then_release()
            return marker

        def dcp_metadata(marker):
            metadata = real_metadata(marker)
            if first[0] and rank == 0:
                first[0] = False
                commit_then_release()
            return metadata

        loading.read_marker, loading.save_metadata = read_marker, dcp_metadata
        loading.READ_ATTEMPTS = attempts if tries is None else tries
        model = tied()
        try:
            result = tiekit.load_sharded(model, folder)
            values = sorted({float(v) for p in model.parameters() for v in p.detach().flatten()})
            told = f"rank {rank}: save {result.save_id} extra {result.extra} values {values}"
        except tiekit.CheckpointError as exc:
            told = f"rank {rank}: CheckpointError: {exc}"
        with open(f"{folder}-rank{rank}.txt", "w") as f:
            f.write(told)
        dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]), open(sys.argv[2]).read(), json.loads(sys.argv[3])), nprocs=2)
"""


@pytest.mark.newest_torch_only
def test_ranks_that_find_different_saves_committed_all_read_the_newer_one(tmp_path: Path) -> None:
    """A commit lands between two ranks' reads of the marker. Rank 0 then fails on the old save's
    removed files, or (its metadata already read) the ranks compare what they found: either way
    every rank starts again and reads the new save. The control, one attempt: refused on every
    rank, naming the reason; the ranks never go on to read two different saves. (One spawned run
    for the three cases.)"""
    scenarios = [
        (str(tmp_path / "gone"), "after-marker", None),
        (str(tmp_path / "differ"), "after-metadata", None),
        (str(tmp_path / "control"), "after-metadata", 1),
    ]
    for folder, _, _ in scenarios:
        commit_here(Path(folder), 1.0)
    (tmp_path / "split.py").write_text(RANKS_SPLIT)
    (tmp_path / "writer.py").write_text(WRITER)
    command = [sys.executable, "split.py", str(free_port()), "writer.py", json.dumps(scenarios)]
    run_ok([command], env=base_env(), cwd=tmp_path)
    for folder, _, tries in scenarios:
        lines = [Path(f"{folder}-rank{rank}.txt").read_text() for rank in (0, 1)]
        if tries == 1:
            for rank, line in enumerate(lines):
                assert line.startswith(f"rank {rank}: CheckpointError: ") and "the ranks found different saves" in line
        else:
            committed = tiekit.load_sharded(tied(), folder).save_id
            for rank, line in enumerate(lines):
                assert line == f"rank {rank}: save {committed} extra {{'value': 2.0}} values [2.0]", (folder, lines)


def test_a_folder_saved_over_while_it_is_converted_is_converted_from_the_new_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    converting = importlib.import_module("tiekit.dcp.convert_source")  # what convert reads through
    folder = tmp_path / "ck"
    commit_here(folder, 1.0)
    real = converting.read_rows
    calls: list[int] = []

    def read_rows(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            commit_from_another_process(folder, 2.0)
        return real(*args)

    monkeypatch.setattr(converting, "read_rows", read_rows)
    tiekit.convert(folder, tmp_path / "model.safetensors")
    model = tied()
    tiekit.load_model(model, tmp_path / "model.safetensors")
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in model.parameters())
    assert model[2].weight is model[0].weight
    # The control, one attempt: the old save's files are gone, and nothing is left at the destination.
    monkeypatch.setattr(reads, "READ_ATTEMPTS", 1)
    calls.clear()
    with pytest.raises(tiekit.CheckpointError, match=r"replaced by save \w+ while it was read"):
        tiekit.convert(folder, tmp_path / "again.safetensors")
    assert not (tmp_path / "again.safetensors").exists()


def test_inspecting_a_folder_saved_over_meanwhile_reports_the_new_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "ck"
    commit_here(folder, 1.0)
    first = inspect_file(folder).metadata["save_id"]
    real = records.save_metadata  # inspect's read of the folder
    calls: list[int] = []

    def dcp_metadata(marker: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            commit_from_another_process(folder, 2.0)  # after the marker was read
        return real(marker)

    monkeypatch.setattr(records, "save_metadata", dcp_metadata)
    report = inspect_file(folder)
    assert len(calls) == 2  # the attempt that found the old save gone, then the new save
    assert report.metadata["save_id"] == tiekit.load_sharded(tied(), folder).save_id != first


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
def test_a_save_another_writer_committed_over_meanwhile_is_not_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocking: bool
) -> None:
    """Two writers in one folder: the one committing second used to replace the first's marker and
    remove its save (the first's checkpoint lost, silently). Now it refuses to commit; the other
    writer's save stays the folder's checkpoint, whole."""
    from tiekit.dcp.writer import DurableWriter  # the writer save_sharded uses

    folder = tmp_path / "ck"
    commit_here(folder, 1.0)
    real = DurableWriter.write_data
    calls: list[int] = []

    def write_data(self: DurableWriter, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            commit_from_another_process(folder, 2.0)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DurableWriter, "write_data", write_data)
    model = tied()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
    with pytest.raises(tiekit.CheckpointError, match=r"ck: save \w+ was committed into this folder by another writer"):
        tiekit.save_sharded(model, folder, blocking=blocking).wait(60)
    loaded = tied()
    result = tiekit.load_sharded(loaded, folder)
    assert result.extra == {"value": 2.0} and all(torch.equal(p, torch.full_like(p, 2.0)) for p in loaded.parameters())
    monkeypatch.undo()
    tiekit.save_sharded(model, folder)  # the next save commits, and removes the refused one's files
    assert len(list(folder.glob("save-*"))) == 1
    assert tiekit.load_sharded(loaded, folder).extra is None
    assert all(torch.equal(p, torch.full_like(p, 3.0)) for p in loaded.parameters())


NODE_LOCAL_LOAD = """
import os, sys
import torch.distributed as dist
import tiekit
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from split_helpers import tied

rank, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
try:
    tiekit.load_sharded(tied(), path)
    told = "loaded"
except tiekit.CheckpointError as exc:
    told = f"CheckpointError: {exc}"
with open(f"{sys.argv[4]}-rank{rank}.txt", "w") as f:
    f.write(told)
dist.barrier()  # both done before either closes: gloo can abort a process whose peer left first
dist.destroy_process_group()
"""


def _mount_namespaces() -> bool:
    """Whether this process may give a child a mount namespace of its own (``unshare -m``)."""
    try:
        done = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.mark.newest_torch_only
@pytest.mark.skipif(not _mount_namespaces(), reason="needs unshare -m (a mount namespace per rank)")
def test_ranks_holding_different_checkpoints_at_one_path_are_told_so(tmp_path: Path) -> None:
    """Node-local storage: one path, a different disk (here a bind mount in each rank's own mount
    namespace) holding a different save on each node. The load read again 5 times and then blamed
    saves "committed faster than this load reads them", though nothing was saving (probe)."""
    commit_here(tmp_path / "node0", 1.0)
    commit_here(tmp_path / "node1", 2.0)
    shared = tmp_path / "shared"
    shared.mkdir()
    (tmp_path / "split_helpers.py").write_text("from torch import nn\n\n" + _source_of(tied))
    (tmp_path / "load.py").write_text(NODE_LOCAL_LOAD)
    port = free_port()
    mounted = f'mount --bind "$1" "$2" && exec "{sys.executable}" load.py "$3" {port} "$2" out'
    commands = [
        ["unshare", "-m", "sh", "-c", mounted, "sh", str(tmp_path / f"node{rank}"), str(shared), str(rank)]
        for rank in (0, 1)
    ]
    run_ok(commands, env=base_env(), cwd=tmp_path)
    for rank in (0, 1):
        told = (tmp_path / f"out-rank{rank}.txt").read_text()
        assert told.startswith(f"CheckpointError: {shared}: the ranks hold different checkpoints at this path"), told
        assert "the same on a second look" in told and "node-local storage?" in told
    assert not list(shared.iterdir())  # the bind mounts were the ranks' own


def _source_of(function: Any) -> str:
    import inspect

    return inspect.getsource(function)
