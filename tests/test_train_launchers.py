"""tiekit.fit under real launchers: torchrun (one node with 2 processes, and 2 nodes of 1 process
started as two torchruns), spawned DDP processes that die, and the launchers' device choices.

Node-local folders: every process is given the checkpoint_dir ``/proc/self/cwd/ckpt``, one path
string on every rank that each process resolves in its own working directory, as a folder on a
node's local disk is one path on every node with different contents. Every launch is a
subprocess with a timeout, in its own session, killed whole when the time is up.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from launching import free_port
from models import WeightSharingModule
from packaging.version import Version
from torch.utils.data import Dataset, TensorDataset

import tiekit
from tiekit.backends.torch_distributed import local_ranks, process_device

ROOT = Path(__file__).resolve().parents[1]
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
LOCAL = "/proc/self/cwd/ckpt"  # the same path on every rank, resolved in each process's own folder

WORKER = """
import functools, json, os, sys, time
import torch, torch.nn.functional as F
import tiekit
from launching import free_port
from models import WeightSharingModule
from test_train_launchers import FailsAfter, FolderBecomesFile, dataset

out, options = sys.argv[1], json.loads(sys.argv[2])
rank = int(os.environ["RANK"])
own = options.pop("own_folder", None)  # "{rank}" -> this process's folder
if own:
    os.chdir(own.format(rank=rank))
control = options.pop("control", False)
started = time.time()


def gloo_threads():  # this process's gloo worker threads (torch names them): alive while a group is
    tasks = [f"/proc/self/task/{t}/comm" for t in os.listdir("/proc/self/task")]
    return sum(open(task).read().strip() == "pt_gloo_runloop" for task in tasks)


def fit():
    data = FailsAfter(dataset(size), failing["after"]) if failing.get("rank") == rank else dataset(size)
    if swapping.get("rank") == rank:
        data = FolderBecomesFile(data, swapping["after"], options["checkpoint_dir"])
    return tiekit.fit(WeightSharingModule, data, loss_fn=F.mse_loss, batch_size=8,
                      progress=False, optimizer=functools.partial(torch.optim.AdamW, lr=lr), **options)


def own_group(prefix):  # a group made by the script, in torchrun's store under a prefix of its own
    import torch.distributed as dist

    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, agent), rank=rank, world_size=2)


options.setdefault("strategy", "ddp")
options["strategy"] = options.pop("strategies", {}).get(str(rank), options["strategy"])  # {"1": "fsdp"}
size = options.pop("sizes", {}).get(str(rank), 256)  # {"1": 240}: rank 1's dataset is shorter
failing = options.pop("failing", {})  # {"rank": 1, "after": 16}: its dataset raises after 16 samples
swapping = options.pop("swapping", {})  # {"rank": 0, "after": 24}: checkpoint_dir becomes a file then
lr = options.pop("lrs", {}).get(str(rank), 1e-2)  # {"1": 0.1}: rank 1's optimizer factory differs
if "resumes" in options:  # {"1": "data/ckpt/step-00000004"}: rank 1 names the checkpoint its own way
    options["resume"] = options.pop("resumes").get(str(rank), options.get("resume"))
if "threads" in options:  # the script's own choice of torch's threads, which fit must keep
    torch.set_num_threads(options.pop("threads"))
try:
    if rank in options.pop("validating", []):  # [1]: val_data on rank 1 only
        options.setdefault("val_data", dataset(64))
    result = fit()
    record = dict(steps=result.steps, losses=len(result.losses), world=result.world_size,
                  checkpoint=str(result.checkpoint), digest=result.replica_digests[rank],
                  loss_values=list(result.losses), digests=list(result.replica_digests),
                  identical=result.replicas_identical,
                  ties=result.model.layer_3.weight is result.model.layer_1.weight, strategy=result.strategy,
                  weights={k: v.tolist() for k, v in result.model.state_dict().items()})
except Exception as exc:
    record = dict(error=type(exc).__name__, tiekit=isinstance(exc, tiekit.TiekitError), message=str(exc),
                  notes=getattr(exc, "__notes__", []))
    record.update(gloo_threads_while_failing=gloo_threads())  # the traceback, and its frames, still alive
record.update(rank=rank, cwd=os.getcwd(), seconds=time.time() - started, gloo_threads=gloo_threads(),
              threads=torch.get_num_threads())
if control:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    own_group("yours")  # fit fails in a group the script made: it is gone once the script closes it
    try:
        fit()
    except tiekit.TiekitError:  # the checkpoint_dir a file by now: refused when fit starts
        dist.destroy_process_group()
        record["own_group_gloo_threads_while_failing"] = gloo_threads()

    def fails(model):
        raise RuntimeError("in the step")

    own_group("control")  # torch alone: a closed group lives on, its threads too, while a traceback holds DDP
    try:
        fails(DistributedDataParallel(torch.nn.Linear(2, 2)))
    except RuntimeError:
        dist.destroy_process_group()
        record["control_gloo_threads_while_failing"] = gloo_threads()
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump(record, f)
"""


def dataset(size: int = 256) -> TensorDataset:
    """A noisy linear map the seeds' module can learn (the workers import it from here)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(size, 32, generator=generator)
    return TensorDataset(x, x @ torch.randn(32, 10, generator=generator) / 32**0.5)


class FolderBecomesFile(Dataset[tuple[torch.Tensor, ...]]):
    """``data`` that, at its read ``after`` + 1, replaces ``folder`` by a file: a checkpoint_dir
    fit found usable at the start fails at the next save (a disk swapped under the run)."""

    def __init__(self, data: TensorDataset, after: int, folder: str) -> None:
        self.data, self.after, self.folder, self.read = data, after, Path(folder), 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        self.read += 1
        if self.read == self.after + 1 and self.folder.is_dir():
            shutil.rmtree(self.folder)
            self.folder.write_text("not a folder")
        return tuple(self.data[i])


class FailsAfter(Dataset[tuple[torch.Tensor, ...]]):
    """``data`` whose sample ``after`` + 1 (counting every read) raises `ValueError`."""

    def __init__(self, data: TensorDataset, after: int) -> None:
        self.data, self.after, self.read = data, after, 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        self.read += 1
        if self.read > self.after:
            raise ValueError(f"sample {i} cannot be read")
        return tuple(self.data[i])


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PJRT_DEVICE", None)  # DDP on the CPU: no XLA here
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


def _start(command: list[str], cwd: Path) -> subprocess.Popen[str]:
    """Start ``command`` in ``cwd`` as the leader of its own session (so it can be killed whole)."""
    pipe = subprocess.PIPE
    return subprocess.Popen(
        command, env=_env(), cwd=cwd, stdout=pipe, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _wait(processes: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    """Wait for every process (each leads its own session); kill them all and fail at the deadline."""
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the launch did not end within {timeout:g} s")
    return outputs


def _launch_failure(output: str, out: Path) -> str:
    """What a failed torchrun launch's ranks printed, without the agent's own traceback (its
    report of the failure, which would fill an assertion message's tail), and which ranks reported
    a result first: a rank dying after its report died at exit, not in fit."""
    reported = sorted(p.stem for p in out.glob("rank-*.json"))
    agent = output.rfind("Traceback (most recent call last):", 0, output.find("ChildFailedError"))
    ranks, trailer = (output[:agent], output[agent:]) if agent >= 0 else (output, "")
    causes = [line.strip() for line in trailer.splitlines() if "exitcode" in line or "rank  " in line]
    return f"reported before the failure: {reported}; agent: {causes}\n{ranks[-6000:]}"


def _records(out: Path, world: int = 2) -> list[dict[str, Any]]:
    files = sorted(out.glob("rank-*.json"))
    assert len(files) == world, f"{len(files)} of {world} ranks reported"
    return [json.loads(f.read_text()) for f in files]


def torchrun_one_node(tmp_path: Path, name: str, options: dict[str, Any], timeout: float = 120) -> list[dict[str, Any]]:
    """``torchrun --nproc-per-node 2 worker.py``: what each rank's fit returned or raised."""
    out = tmp_path / name
    out.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), str(script), str(out), json.dumps(options)]
    process = _start(command, cwd=tmp_path)
    output = _wait([process], timeout)[0]
    if process.returncode != 0 and _aborted_at_exit(output, out):
        # torch's gloo groups can abort a process at interpreter exit (pytorch/pytorch#179291),
        # after fit returned on every rank: the launch failed, fit did not (seen in CI under load).
        told = _launch_failure(output, out)[:300]
        warnings.warn(f"a rank aborted at exit after every rank reported: {told}", RuntimeWarning, stacklevel=2)
    else:
        assert process.returncode == 0, _launch_failure(output, out)
    return _records(out)


def _aborted_at_exit(output: str, out: Path, world: int = 2) -> bool:
    """Every rank reported its result, and the failure is gloo's abort at interpreter exit."""
    reported = len(list(out.glob("rank-*.json"))) == world
    return reported and "terminate called without an active exception" in output


def seed_checkpoint(folder: Path, steps: int, seed: int = 0) -> Path:
    """A single-process run of ``steps`` steps writing its checkpoint into ``folder/ckpt``."""
    kw: dict[str, Any] = {"loss_fn": F.mse_loss, "batch_size": 8, "progress": False, "optimizer": ADAMW}
    result = tiekit.fit(
        WeightSharingModule, dataset(256), devices="cpu", max_steps=steps, checkpoint_dir=folder / "ckpt", seed=seed,
        **kw,
    )  # fmt: skip
    assert result.checkpoint is not None
    return result.checkpoint


# -- 1. resume="last" with node-local folders ---------------------------------------------------


@pytest.mark.newest_torch_only
def test_resume_from_a_checkpoint_only_rank_0_has_fails_on_every_rank_under_torchrun(tmp_path: Path) -> None:
    # Before: rank 0 resumed at step 10 and rank 1 started at step 0; DDP averaged their
    # gradients across different steps without a word, and rank 1 wrote a step-5 file of its own.
    seed_checkpoint(tmp_path / "node0", 10)
    (tmp_path / "node1").mkdir()
    options = {"checkpoint_dir": LOCAL, "checkpoint_every": 5, "resume": "last", "max_steps": 15}
    options["own_folder"] = str(tmp_path / "node{rank}")
    records = torchrun_one_node(tmp_path, "lacking", options)
    path = f"{LOCAL}/step-00000010.safetensors"
    for record in records:
        assert record.get("tiekit"), record
        assert f"rank(s) 1 of 2 cannot open {path}" in record["message"]
        assert f"working directory {tmp_path / 'node1'}" in record["message"]
        assert record["seconds"] < 60
    assert sorted(os.listdir(tmp_path / "node0" / "ckpt")) == ["step-00000010.safetensors"]
    assert not (tmp_path / "node1" / "ckpt").exists()  # nobody trained, nobody wrote

    # The control: with a copy on rank 1's node too, both resume at 10 and run to 15; the
    # step-15 checkpoint is written once, by rank 0, into its own folder.
    (tmp_path / "node1" / "ckpt").mkdir()
    shutil.copy(tmp_path / "node0" / "ckpt" / "step-00000010.safetensors", tmp_path / "node1" / "ckpt")
    records = torchrun_one_node(tmp_path, "both", {**options, "threads": 2})
    # fit kept the script's threads (it set each rank to the host's cores over the local ranks: 1)
    assert [r["threads"] for r in records] == [2, 2]
    # Every rank's result holds every replica's digest and rank 0's losses (only rank 0 logs them);
    # each used to hold its own digest only (replicas_identical held whatever the replicas did)
    # and rank 1 no losses.
    assert [(r.get("error"), r["steps"], r["losses"]) for r in records] == [(None, 15, 5), (None, 15, 5)]
    assert records[0]["digests"] == records[1]["digests"] == [records[0]["digest"], records[1]["digest"]]
    assert records[0]["digest"] == records[1]["digest"] and records[1]["identical"]
    assert records[0]["loss_values"] == records[1]["loss_values"]
    assert sorted(os.listdir(tmp_path / "node0" / "ckpt")) == ["step-00000010.safetensors", "step-00000015.safetensors"]
    assert sorted(os.listdir(tmp_path / "node1" / "ckpt")) == ["step-00000010.safetensors"]

    # The other way round, rank 0's folder empty (rank 0 on another node this launch): every rank
    # started fresh and trained all 15 steps again, without a word (probe).
    (tmp_path / "swap0").mkdir()
    seed_checkpoint(tmp_path / "swap1", 10)
    records = torchrun_one_node(tmp_path, "swapped", {**options, "own_folder": str(tmp_path / "swap{rank}")})
    for record in records:
        assert record.get("tiekit"), record
        assert (
            f'resume="last": rank 0 finds no checkpoint in {LOCAL}, but 1 of the other 1 rank(s)' in record["message"]
        )
        assert f"rank 1: {LOCAL}/step-00000010.safetensors" in record["message"]
    assert not (tmp_path / "swap0" / "ckpt").exists()
    assert sorted(os.listdir(tmp_path / "swap1" / "ckpt")) == ["step-00000010.safetensors"]

    # Rank 0's newest older than another rank's: every rank resumed at rank 0's step 5 and trained
    # steps 5 to 10 again, without a word (probe).
    seed_checkpoint(tmp_path / "behind0", 5)
    seed_checkpoint(tmp_path / "behind1", 10)
    shutil.copy(tmp_path / "behind0" / "ckpt" / "step-00000005.safetensors", tmp_path / "behind1" / "ckpt")
    records = torchrun_one_node(tmp_path, "behind", {**options, "own_folder": str(tmp_path / "behind{rank}")})
    for record in records:
        assert record.get("tiekit"), record
        assert f"rank 0's newest checkpoint in {LOCAL} is {LOCAL}/step-00000005.safetensors" in record["message"]
        assert f"find a newer one there (rank 1: {LOCAL}/step-00000010.safetensors)" in record["message"]
    assert sorted(os.listdir(tmp_path / "behind0" / "ckpt")) == ["step-00000005.safetensors"]
    assert sorted(os.listdir(tmp_path / "behind1" / "ckpt")) == [
        "step-00000005.safetensors",
        "step-00000010.safetensors",
    ]


@pytest.mark.newest_torch_only  # fit's own logic, the same on both stacks: one run keeps CI short
def test_ranks_holding_different_checkpoints_of_the_same_step_refuse_to_resume(tmp_path: Path) -> None:
    """Node-local folders with a step-10 file each, written by two different runs: the ranks loaded
    the same step, so fit went on; DDP's broadcast at the wrap made the weights equal again, but
    rank 1 kept the other run's optimizer moments and RNG states, and the replicas drifted apart."""
    seed_checkpoint(tmp_path / "node0", 10)
    seed_checkpoint(tmp_path / "node1", 10, seed=5)
    options = {"checkpoint_dir": LOCAL, "checkpoint_every": 5, "resume": "last", "max_steps": 15}
    options["own_folder"] = str(tmp_path / "node{rank}")
    before = {n: sorted(os.listdir(tmp_path / n / "ckpt")) for n in ("node0", "node1")}
    records = torchrun_one_node(tmp_path, "different", options)
    for record in records:
        assert record.get("tiekit"), record
        assert f"resume: the ranks did not all load the same {LOCAL}/step-00000010.safetensors" in record["message"]
        runs = re.findall(r"rank (\d): step 10 \(epoch 0, batch 10\) written by run (\w+)", record["message"])
        assert [rank for rank, _ in runs] == ["0", "1"] and runs[0][1] != runs[1][1], record["message"]
    assert {n: sorted(os.listdir(tmp_path / n / "ckpt")) for n in ("node0", "node1")} == before


@pytest.mark.newest_torch_only
def test_two_torchrun_nodes_with_different_checkpoints_refuse_to_resume(tmp_path: Path) -> None:
    # Two "nodes" (torchrun --nnodes=2, c10d rendezvous), each in its own folder: one holds step 10,
    # the other step 5. Whichever node the rendezvous makes rank 0, rank 1 lacks its newest file.
    seed_checkpoint(tmp_path / "nodeA", 10)
    seed_checkpoint(tmp_path / "nodeB", 5)
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    options = {"checkpoint_dir": LOCAL, "checkpoint_every": 5, "resume": "last", "max_steps": 15}
    port = free_port()
    processes = []
    for node_rank, node in enumerate(("nodeA", "nodeB")):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
        command += [f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
        command += ["--rdzv-id=tiekit-test", str(script), str(out), json.dumps(options)]
        processes.append(_start(command, cwd=tmp_path / node))
    outputs = _wait(processes, timeout=150)
    assert all(p.returncode == 0 for p in processes), "\n".join(o[-12000:] for o in outputs)
    records = _records(out)
    newest = {"nodeA": "step-00000010.safetensors", "nodeB": "step-00000005.safetensors"}
    chosen = newest[Path(records[0]["cwd"]).name]  # rank 0's newest
    for record in records:
        assert record.get("tiekit"), record
        assert f"rank(s) 1 of 2 cannot open {LOCAL}/{chosen}" in record["message"]
        assert f"working directory {records[1]['cwd']}" in record["message"]
    for node, name in newest.items():
        assert os.listdir(tmp_path / node / "ckpt") == [name]  # untouched


@pytest.mark.newest_torch_only
def test_a_relative_sharded_checkpoint_dir_in_different_working_directories_is_refused_at_the_start(
    tmp_path: Path,
) -> None:
    # Every rank writes its part of a sharded checkpoint into one folder; "ckpt" names another in
    # each rank's working directory. This failed at the first checkpoint, after the steps before it.
    for rank in range(2):
        (tmp_path / f"rank{rank}").mkdir()
    options = {"strategy": "fsdp", "checkpoint_dir": "ckpt", "checkpoint_every": 2, "max_steps": 4}
    records = torchrun_one_node(tmp_path, "out", {**options, "own_folder": str(tmp_path / "rank{rank}")})
    for record in records:
        assert record.get("tiekit"), record
        assert "the ranks of this run passed fit different checkpoint_dir (rank 0: " in record["message"]
        assert f"rank 1: '{tmp_path / 'rank1' / 'ckpt'}'" in record["message"]
        assert "a relative path names a folder in each rank's working directory" in record["message"]
    assert not any((tmp_path / f"rank{rank}" / "ckpt").exists() for rank in range(2))  # nothing saved


def torchrun_two_nodes(tmp_path: Path, nodes: tuple[str, str], options: dict[str, Any], timeout: float = 150) -> Any:
    """Two "nodes" (``torchrun --nnodes=2``, c10d rendezvous, one process each), each started in
    its own folder ``tmp_path / node``: each rank's record (the rendezvous picks which is rank 0)."""
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    port = free_port()
    processes = []
    for node_rank, node in enumerate(nodes):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
        command += [f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
        command += ["--rdzv-id=tiekit-test", str(script), str(out), json.dumps(options)]
        processes.append(_start(command, cwd=tmp_path / node))
    outputs = _wait(processes, timeout=timeout)
    assert all(p.returncode == 0 for p in processes), "\n".join(o[-12000:] for o in outputs)
    return _records(out)


@pytest.mark.newest_torch_only  # fit's start-up, the same code on both stacks: one torchrun is enough
@pytest.mark.parametrize("option", ["checkpoint_dir", "log_dir"])
def test_a_folder_option_one_node_refuses_is_refused_on_every_rank(tmp_path: Path, option: str) -> None:
    # Node B's working directory holds a file where the relative folder goes. Its rank refused it
    # alone, before joining the process group, and node A's rank waited in init_process_group for
    # torch's 30 minutes (probe); here every rank raises it, naming node B's rank.
    for node in ("nodeA", "nodeB"):
        (tmp_path / node).mkdir()
    (tmp_path / "nodeB" / "folder").write_text("not a folder")
    options = {option: "folder", "max_steps": 2}
    records = torchrun_two_nodes(tmp_path, ("nodeA", "nodeB"), options, timeout=120)
    refusing = next(r["rank"] for r in records if Path(r["cwd"]).name == "nodeB")
    for record in records:
        assert record.get("tiekit"), record
        assert f"rank {refusing}: {option}='folder' is a file, not a folder" in record["message"], record
        assert "failed on 1 of 2 rank(s)" in record["message"]
        assert record["seconds"] < 60
    assert (tmp_path / "nodeB" / "folder").read_text() == "not a folder"
    assert os.listdir(tmp_path / "nodeA") == []  # nothing made on the node that could have


@pytest.mark.newest_torch_only
def test_a_sharded_checkpoint_dir_a_rank_names_through_a_symbolic_link_is_accepted(tmp_path: Path) -> None:
    # Each node mounts the shared folder at a path of its own (here: a link in each rank's working
    # directory): the absolute paths differ, the folder is one. fit refused it ("passed fit
    # different checkpoint_dir") where save_sharded and load_sharded accept it.
    shared = tmp_path / "shared"
    shared.mkdir()
    for rank in range(2):
        (tmp_path / f"rank{rank}").mkdir()
        (tmp_path / f"rank{rank}" / "data").symlink_to(shared, target_is_directory=True)
    options = {"strategy": "fsdp", "checkpoint_dir": "data/ckpt", "checkpoint_every": 2, "max_steps": 4}
    records = torchrun_one_node(tmp_path, "out", {**options, "own_folder": str(tmp_path / "rank{rank}")})
    for record in records:
        assert "error" not in record, record
        assert record["steps"] == 4 and record["ties"], record
    assert sorted(p.name for p in (shared / "ckpt").iterdir()) == ["step-00000002", "step-00000004"]
    resumed = torchrun_one_node(
        tmp_path, "again", {**options, "max_steps": 6, "resume": "last", "own_folder": str(tmp_path / "rank{rank}")}
    )
    assert all(r.get("steps") == 6 for r in resumed), resumed
    # A checkpoint named through the link on one rank and by its real path on the other: one folder.
    step4 = {"0": str(shared / "ckpt" / "step-00000004"), "1": "data/ckpt/step-00000004"}
    branched = torchrun_one_node(
        tmp_path, "branch", {**options, "max_steps": 8, "resumes": step4, "own_folder": str(tmp_path / "rank{rank}")}
    )
    assert all(r.get("steps") == 8 for r in branched), branched  # refused: "passed fit different resume"


@pytest.mark.newest_torch_only
def test_a_node_local_sharded_checkpoint_dir_is_refused_before_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One absolute path, a folder of its own in each rank's working directory (node-local disks):
    # every rank of a sharded run writes its part there, and this showed only at the first
    # checkpoint's commit, after the steps before it. Rank 0 locks the folder for the run at the
    # start; a rank that does not see that lock file does not share the folder.
    monkeypatch.setenv("TIEKIT_SHARED_FOLDER_WAIT", "3")  # not NFS here: no cache to outwait (65 s)
    for rank in range(2):
        (tmp_path / f"rank{rank}").mkdir()
    options = {"strategy": "fsdp", "checkpoint_dir": LOCAL, "checkpoint_every": 2, "max_steps": 4}
    records = torchrun_one_node(tmp_path, "out", {**options, "own_folder": str(tmp_path / "rank{rank}")}, timeout=90)
    for record in records:
        assert record.get("tiekit"), record
        assert f"the ranks do not share checkpoint_dir='{LOCAL}': rank(s) 1 of 2 do not see" in record["message"]
        assert "(node-local storage?)" in record["message"]
    # Nothing saved: rank 0's folder, made for the lock, went with it.
    assert not any((tmp_path / f"rank{rank}" / "ckpt").exists() for rank in range(2))


@pytest.mark.newest_torch_only  # fit's own logic, the same on both stacks: one run keeps CI short
def test_a_checkpoint_every_rank_fails_to_load_is_reported_as_that_failure(tmp_path: Path) -> None:
    # The ranks all read one file and all refused it alike; the error said they "did not all load
    # the same" file, "each read its own copy" (probe).
    (tmp_path / "ckpt").mkdir()
    tiekit.save_model(WeightSharingModule(), tmp_path / "ckpt" / "step-00000005.safetensors")  # weights only
    options = {"checkpoint_dir": str(tmp_path / "ckpt"), "resume": "last", "max_steps": 8}
    records = torchrun_one_node(tmp_path, "out", options, timeout=60)
    for record in records:
        assert record["error"] == "CheckpointError", record  # as one rank alone raises it (a TiekitError before)
        assert record["message"].startswith(
            f"resume: every rank failed to load {tmp_path / 'ckpt' / 'step-00000005.safetensors'}: CheckpointError: "
        ), record["message"]
        assert record["message"].endswith("step-00000005.safetensors: holds no optimizer state")


@pytest.mark.newest_torch_only  # fit's start-up, the same code on both stacks: one torchrun is enough
def test_ranks_given_different_strategies_are_refused_at_the_start(tmp_path: Path) -> None:
    # Rank 0 ("ddp") waited in fit's data check and rank 1 ("fsdp") in FSDP's broadcast of the
    # weights, each for the other (gloo's timeout: 30 minutes; this test's: 60 s).
    records = torchrun_one_node(tmp_path, "out", {"strategies": {"1": "fsdp"}, "max_steps": 2}, timeout=60)
    for record in records:
        assert record.get("tiekit"), record
        assert "passed fit different strategy (rank 0: 'ddp'; rank 1: 'fsdp')" in record["message"], record


@pytest.mark.newest_torch_only  # fit's start-up, the same code on both stacks: one torchrun is enough
def test_ranks_building_different_optimizers_are_refused_at_the_start(tmp_path: Path) -> None:
    # FSDP2 trained one model with each rank's shard stepped at its own learning rate, without a
    # word (and DDP's replicas drifted apart, reported only as replicas_identical=False; probe).
    options = {"strategy": "fsdp", "lrs": {"1": 0.1}, "max_steps": 2}
    records = torchrun_one_node(tmp_path, "out", options, timeout=60)
    for record in records:
        assert record.get("tiekit"), record
        told = "the ranks of this run built different optimizers: param group 0's lr is rank 0: 0.01; rank 1: 0.1"
        assert told in record["message"], record


@pytest.mark.newest_torch_only  # fit's start-up, the same code on both stacks: one torchrun is enough
def test_ranks_given_datasets_of_different_lengths_are_refused_at_the_start(tmp_path: Path) -> None:
    # Rank 1's epoch ended at step 15 and rank 0 waited in the all-reduce of step 16 for good (a
    # hang past any timeout of this test: gloo's own is 30 minutes).
    records = torchrun_one_node(tmp_path, "out", {"epochs": 1, "sizes": {"1": 240}}, timeout=60)
    for record in records:
        assert record.get("tiekit"), record
        assert "the ranks of this run were given different train_data" in record["message"]
        assert "rank 0: 128 samples in 16 batches; rank 1: 120 samples in 15 batches" in record["message"]
        assert record["seconds"] < 30
    # Shares of as many batches pass (the last, short batch is dropped either way); val_data
    # passed on one rank only is refused (rank 1 would have validated, with an all-reduce, alone).
    options = {"max_steps": 3, "sizes": {"1": 260}, "validating": [1]}
    records = torchrun_one_node(tmp_path, "equal", options, timeout=60)
    for record in records:
        assert record.get("tiekit"), record
        assert "val_data was passed to fit on rank(s) 1 but not on rank(s) 0" in record["message"]


# -- 1. a failing save ------------------------------------------------------------------------------


@pytest.mark.newest_torch_only
def test_a_save_that_fails_on_the_writer_raises_on_every_rank(tmp_path: Path) -> None:
    # Root ignores permissions, but not a file in the path: the writer's dataset replaces the
    # folder by a file during step 4 (a folder that is a file at the start is refused then).
    folder = tmp_path / "ckpt"
    options = {"checkpoint_dir": str(folder), "checkpoint_every": 4, "max_steps": 12, "control": True}
    options["swapping"] = {"rank": 0, "after": 24}
    records = torchrun_one_node(tmp_path, "out", options)
    path = str(folder / "step-00000004.safetensors")
    for record in records:
        assert record.get("error") == "CheckpointError", record
        assert f"{path}: cannot create the folder: File exists" in record["message"], record
        assert record["seconds"] < 60  # raised at step 4 on both, nobody waits for a timeout
        # The group fit made is gone, its threads joined, while the error is still being handled:
        # left to interpreter exit, a gloo thread releasing a collective's tensors then needs the
        # GIL and aborts the process ("terminate called without an active exception", torch 2.14).
        # torch 2.9 leaves gloo's threads unnamed, so there is nothing to count (nor that abort).
        if Version(torch.__version__).release >= (2, 14):
            assert record["gloo_threads_while_failing"] == 0, record
            assert record["own_group_gloo_threads_while_failing"] == 0, record  # yours, closed by you
            assert record["control_gloo_threads_while_failing"] > 0, record  # torch alone keeps them
    assert "rank 0" in records[1]["message"]  # rank 1 says whose save failed


# -- 4. a dead worker --------------------------------------------------------------------------------

DYING = """
import functools, json, os, signal, sys, time
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.utils.data import Dataset
import tiekit
from launching import free_port
from models import WeightSharingModule
from test_train_launchers import dataset

class DiesOnRank1(Dataset):
    '''Rank 1's process SIGKILLs itself while reading the batch of step 8.'''

    def __init__(self, folder):
        self.data, self.folder, self.reads = dataset(512), folder, 0

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        self.reads += 1
        if dist.get_rank() == 1 and self.reads > 7 * 8:
            with open(os.path.join(self.folder, "killed"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return self.data[i]

if __name__ == "__main__":
    folder = sys.argv[1]
    try:
        tiekit.fit(WeightSharingModule, DiesOnRank1(folder), loss_fn=F.mse_loss, strategy="ddp", devices=2,
                   batch_size=8, max_steps=20, checkpoint_dir=os.path.join(folder, "ckpt"), checkpoint_every=3,
                   progress=False, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
        error = None
    except Exception as exc:
        error = dict(type=type(exc).__name__, tiekit=isinstance(exc, tiekit.TiekitError), message=str(exc))
    print("RECORD " + json.dumps(dict(error=error, at=time.time())), flush=True)
"""


@pytest.mark.newest_torch_only  # fit's own logic, the same on both stacks: one run keeps CI short
def test_a_rank_that_raises_while_the_other_waits_in_the_all_reduce_ends_the_launch(tmp_path: Path) -> None:
    """Rank 1's data fails in its third batch while rank 0 waits for it in the gradient all-reduce.
    fit on rank 1 meets the others before closing the group for at most 10 s, on every rank: gloo's
    monitored_barrier, which fit used, bounds only rank 0's wait, so rank 1 waited there for the
    group's timeout (30 minutes) and rank 0 in the all-reduce, and the launch hung (the harness
    fails it after 120 s). Rank 0 then fails in the group rank 1 closed, its error noting rank 1's."""
    started = time.monotonic()
    records = torchrun_one_node(tmp_path, "failing", {"failing": {"rank": 1, "after": 16}, "max_steps": 8})
    assert time.monotonic() - started < 90
    first, second = records
    cause = f"ValueError: {second['message']}"
    assert second["error"] == "ValueError" and re.fullmatch(r"sample \d+ cannot be read", second["message"]), second
    assert second["notes"] == [] and first["error"] == "RuntimeError", first  # gloo's, from the all-reduce
    assert first["notes"] == [f"tiekit: rank 1 failed before this rank (this failure may follow from it): {cause}"], (
        first
    )


def test_a_killed_ddp_worker_ends_fit_within_seconds_and_the_last_checkpoint_loads(tmp_path: Path) -> None:
    script = tmp_path / "dying.py"
    script.write_text(textwrap.dedent(DYING))
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=_env(), capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(next(line[7:] for line in done.stdout.splitlines() if line.startswith("RECORD ")))
    error = record["error"]
    assert error is not None and error["tiekit"], error  # before: torch's ProcessExitedException
    assert "replica 1" in error["message"] and "killed by signal SIGKILL" in error["message"]
    last = tmp_path / "ckpt" / "step-00000006.safetensors"
    assert f'resume="last" would go on from: {last}' in error["message"]
    killed = float((tmp_path / "killed").read_text())
    assert record["at"] - killed < 20  # the survivor was stopped, not left waiting in its all-reduce
    model = WeightSharingModule()
    optimizer = ADAMW(model.parameters())
    assert tiekit.load_checkpoint(last, model=model, optimizer=optimizer)["step"] == 6
    assert model.layer_3.weight is model.layer_1.weight


# -- 4b. torchrun restarting the workers (--max-restarts) -------------------------------------------

RESTARTED = """
import datetime, functools, json, os, signal, sys, time
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.utils.data import Dataset
import tiekit
from launching import free_port
from models import WeightSharingModule
from test_train_launchers import dataset

out, how = sys.argv[1], sys.argv[2]
rank, launch = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
# Where each way of joining finds rank 0 in torchrun's store: torch's env:// reads rank 0's gloo
# address (key of torch 2.14's default group); tiekit reads rank 0's announcement.
KEY = {"torch": "default_pg/0//cpu//0/0", "tiekit": "tiekit/launch"}[how]

def in_torchruns_store():
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=10))
    return store.get(KEY).hex() if store.check([KEY]) else None

def record(name, value):
    with open(os.path.join(out, name), "w") as f:
        json.dump(value, f)

class DiesOnRank1(Dataset):
    '''In the first launch, rank 1's process SIGKILLs itself while reading the batch of step 10.'''

    def __init__(self):
        self.data, self.reads = dataset(256), 0

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        self.reads += 1
        if launch == 0 and rank == 1 and self.reads > 9 * 8:
            record("launch-0", in_torchruns_store())
            os.kill(os.getpid(), signal.SIGKILL)
        return self.data[i]

if launch == 1:  # rank 1 joins first: what it finds in the store, rank 0 of a dead launch put there
    if rank == 1:
        record("found-by-rank-1", in_torchruns_store())
    while not os.path.exists(os.path.join(out, "found-by-rank-1")):
        time.sleep(0.05)
    if how == "torch":
        sys.exit(0)
if how == "torch":  # what fit did before: torch's env:// in torchrun's store
    dist.init_process_group("gloo", init_method="env://")
result = tiekit.fit(WeightSharingModule, DiesOnRank1(), loss_fn=F.mse_loss, strategy="ddp", batch_size=8,
                    max_steps=16, checkpoint_dir="ckpt", checkpoint_every=4, checkpoint_keep=2, resume="last",
                    progress=False, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
record(f"rank-{rank}.json", dict(steps=result.steps, losses=len(result.losses), digest=result.replica_digests[rank],
                                 ties=result.model.layer_3.weight is result.model.layer_1.weight))
"""


@pytest.mark.newest_torch_only  # the subject is torchrun's restarts; torch 2.9.1 joins the same way
def test_fit_rejoins_and_resumes_when_torchrun_restarts_the_workers(tmp_path: Path) -> None:
    # torchrun keeps its store through restarts, and torch's env:// joins the group in it without a
    # prefix per launch: a restarted rank reading it before rank 0 of its launch is handed the dead
    # launch's gloo address of rank 0. It then failed ("Connection refused"), or, where a new process
    # had been given that port, hung or went on (torch 2.14.1: 4, 2 and 2 of 8 probes).
    script = tmp_path / "restarted.py"
    script.write_text(textwrap.dedent(RESTARTED))

    def launch(how: str) -> tuple[str, Path]:
        out = tmp_path / how
        out.mkdir()
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1"]
        command += ["--master-port", str(free_port()), str(script), str(out), how]
        process = _start(command, cwd=out)
        output = _wait([process], timeout=150)[0]
        assert process.returncode == 0, _launch_failure(output, out)
        assert "failed (exitcode: -9) local_rank: 1" in output  # the first launch's rank 1 was killed
        return output, out

    # The control: after the restart, torch's env:// would hand rank 1 the dead rank 0's address.
    _, out = launch("torch")
    dead = json.loads((out / "launch-0").read_text())
    assert dead is not None and json.loads((out / "found-by-rank-1").read_text()) == dead

    output, out = launch("tiekit")
    dead = json.loads((out / "launch-0").read_text())
    assert dead is not None and json.loads((out / "found-by-rank-1").read_text()) == dead  # the dead launch's
    records = _records(out)  # of the second launch
    for record in records:
        assert record["steps"] == 16 and record["ties"], record
    assert records[0]["losses"] in (8, 12), records  # resumed from step 8 (or 4, its save still under way)
    assert records[0]["digest"] == records[1]["digest"]
    assert "Connection refused" not in output
    # checkpoint_keep=2 over both launches: the restarted one continued the folder.
    kept = sorted(p.name for p in (out / "ckpt").glob("step-*.safetensors"))
    assert kept == ["step-00000012.safetensors", "step-00000016.safetensors"], kept


# -- 5. which GPU a DDP process uses -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "rank", "world", "gpus", "expected"),
    [
        # torchrun, 2 nodes x 1 GPU: rank 1 is local rank 0 of 1 on its node. Before: CPU and gloo,
        # because 1 GPU < world size 2; and rank % count picked the GPU.
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, 1, 2, 1, ("cuda:0", "nccl")),
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, 0, 2, 1, ("cuda:0", "nccl")),
        # 2 nodes x 4 GPUs, global rank 6 is local rank 2: cuda:2 (rank % count would also say 2;
        # with 3 GPUs per node and 2 processes per node it would not).
        ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}, 6, 8, 4, ("cuda:2", "nccl")),
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 3, 4, 3, ("cuda:1", "nccl")),
        # More processes on this node than GPUs: every process of the node on the CPU, with gloo.
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, 0, 2, 1, ("cpu", "gloo")),
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 1, 2, 1, ("cpu", "gloo")),
        # No GPU at all.
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, 0, 2, 0, ("cpu", "gloo")),
        # A launcher that sets LOCAL_RANK only: a GPU when this local rank has one.
        ({"LOCAL_RANK": "1"}, 1, 2, 2, ("cuda:1", "nccl")),
        ({"LOCAL_RANK": "2"}, 2, 4, 2, ("cpu", "gloo")),
        # Spawned by fit itself (no launcher variables): all on this host.
        ({}, 1, 2, 2, ("cuda:1", "nccl")),
        ({}, 1, 2, 1, ("cpu", "gloo")),
    ],
)
def test_a_ddp_process_uses_its_local_gpu_when_every_process_of_its_host_has_one(
    env: dict[str, str], rank: int, world: int, gpus: int, expected: tuple[str, str]
) -> None:
    local_rank, local_world = local_ranks(rank, world, env)
    device, backend = process_device(local_rank, local_world, gpus)
    assert (str(device), backend) == expected


# -- 6. who writes under SPMD ------------------------------------------------------------------------

SPMD = """
import json, os, sys, torch.nn.functional as F
import tiekit
from tiekit.collective import ranks
from tiekit.backends.xla_spmd import SpmdBackend
from launching import free_port
from models import WeightSharingModule
from test_train_launchers import dataset

folder = sys.argv[1]
result = tiekit.fit(WeightSharingModule, dataset(), loss_fn=F.mse_loss, strategy="spmd", batch_size=4, max_steps=4,
                    checkpoint_dir=folder, progress=False)
backend = SpmdBackend()
print(json.dumps(dict(ranks=list(vars(ranks()).values()), backend=list(vars(backend.ranks).values()),
                      writer=backend.is_master, replica=backend.replica_rank, world=result.world_size,
                      checkpoint=str(result.checkpoint), files=os.listdir(folder))))
"""


@pytest.mark.xla
def test_under_spmd_the_writer_is_process_index_0_not_the_xla_replica(tmp_path: Path) -> None:
    env = {**_env(), "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    done = subprocess.run(
        [sys.executable, "-c", SPMD, str(tmp_path)], env=env, capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # One host driving 4 devices is one rank; it writes, and its one checkpoint is there.
    assert out["ranks"] == out["backend"] == [0, 1, "single"]
    assert out["writer"] and out["world"] == 4
    assert out["files"] == ["step-00000004.safetensors"] and out["checkpoint"] == str(tmp_path / out["files"][0])


def test_the_writer_comes_from_the_ranks_not_from_the_replica_number() -> None:
    # Host 1 of a 2-host SPMD run is XLA replica 0 like host 0; only its process index tells them
    # apart, and the backend's writer flag follows the ranks (from tiekit.collective.ranks()).
    from tiekit.backends.torch_distributed import TorchBackend
    from tiekit.collective import Ranks

    backend = TorchBackend(torch.device("cpu"))
    assert backend.replica_rank == 0 and backend.is_master
    backend.ranks = Ranks(1, 2, "spmd-hosts")
    assert backend.replica_rank == 0 and not backend.is_master


def test_several_spmd_hosts_without_a_process_group_are_refused_before_anything_is_saved(tmp_path: Path) -> None:
    # No pod here: the ranks are given as host 1 of a 2-host SPMD run reports them (as above).
    # DCP over no process group would have every host write as the only rank, over each other.
    from tiekit.backends.torch_distributed import TorchBackend
    from tiekit.collective import Ranks
    from tiekit.dcp.ranks import process_group_needed
    from tiekit.train.config import FitConfig, Job
    from tiekit.train.joining import join

    host = Ranks(1, 2, "spmd-hosts")
    needed = process_group_needed(host, False, "save_sharded", tmp_path)
    assert needed is not None and str(needed).startswith(f"{tmp_path}: save_sharded runs torch.distributed.checkpoint")
    assert "coordinates the 2 hosts of this SPMD run through a torch.distributed process group" in str(needed)
    assert "init_process_group('gloo', init_method='xla://')" in str(needed)
    assert process_group_needed(host, True, "save_sharded", tmp_path) is None  # the group DCP needs
    assert process_group_needed(Ranks(0, 1, "single"), False, "save_sharded", tmp_path) is None
    # fit refuses such a run at its start when it would checkpoint, not at its first checkpoint.
    backend = TorchBackend(torch.device("cpu"))
    backend.ranks, backend.sharded_checkpoints, backend.name = host, True, "spmd_fsdp"
    job = Job(torch.nn.Linear(2, 2), None, None, FitConfig(checkpoint_dir=tmp_path), "spmd_fsdp", "run")
    with pytest.raises(tiekit.TiekitError, match=r"fit runs torch.distributed.checkpoint, .*strategy='spmd_fsdp'"):
        join(job, backend)
    assert list(tmp_path.iterdir()) == []
