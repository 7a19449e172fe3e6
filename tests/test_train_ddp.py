"""strategy="ddp": two gloo processes on the CPU train like one process with the global batch."""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import random
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from models import WeightSharingModule
from torch.utils.data import DataLoader, Dataset, SubsetRandomSampler, TensorDataset

import tiekit


def test_two_gloo_processes_match_one_process_with_the_global_batch(capfd: pytest.CaptureFixture[str]) -> None:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 32, generator=generator), torch.randn(64, 10, generator=generator))
    kw = {"loss_fn": F.mse_loss, "epochs": 2, "seed": 3, "optimizer": functools.partial(torch.optim.AdamW, lr=1e-2)}
    torch.manual_seed(3)
    model = WeightSharingModule()  # a module, not a factory: it reaches the processes pickled
    before = {k: v.clone() for k, v in model.state_dict().items()}

    val = TensorDataset(torch.randn(22, 32, generator=generator), torch.randn(22, 10, generator=generator))
    kw["val_data"] = val
    result = tiekit.fit(model, data, strategy="ddp", devices=2, batch_size=8, **kw)  # type: ignore[arg-type]
    bars = capfd.readouterr().err.count("0/8 [")
    reference = tiekit.fit(WeightSharingModule, data, devices="cpu", batch_size=16, progress=False, **kw)  # type: ignore[arg-type]

    assert (result.strategy, result.world_size, result.steps) == ("ddp", 2, 8)
    assert len(result.replica_digests) == 2 and result.replicas_identical
    assert result.ties_kept and result.model is model
    assert model.layer_3.weight is model.layer_1.weight
    trained, expected = model.state_dict(), reference.model.state_dict()
    assert not all(torch.equal(trained[k], before[k]) for k in before)
    for name in expected:
        torch.testing.assert_close(trained[name], expected[name], rtol=1e-5, atol=1e-6)
    assert bars == 1  # one progress bar: the master's
    # Validation over both processes' shares (11 + 11 samples, batches of 8 and 3) is the mean over all 22.
    assert len(result.val_losses) == 2
    assert result.val_losses == pytest.approx(reference.val_losses, rel=1e-5)


UNGUARDED = """
import sys
import torch, torch.nn.functional as F
from torch.utils.data import TensorDataset
import tiekit
sys.path.insert(0, sys.argv[1])
from models import WeightSharingModule

data = TensorDataset(torch.randn(16, 32), torch.randn(16, 10))
# At the top level, no `if __name__ == "__main__":`: every replica imports this and calls fit again.
tiekit.fit(WeightSharingModule, data, loss_fn=F.mse_loss, strategy="ddp", devices=2, batch_size=4, progress=False)
"""


def test_a_script_calling_fit_without_a_main_guard_is_told_so(tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    tests = Path(__file__).parent
    run = subprocess.run(
        [sys.executable, str(script), str(tests)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    # Each replica raised tiekit's error while it imported the script, not Python's bootstrapping
    # RuntimeError ("An attempt has been made to start a new process before ..."), and fit says
    # the replica died without reporting an error of its training.
    assert run.returncode != 0
    assert "TiekitError: tiekit.fit was called while a new replica process imported your script" in run.stderr
    assert "Call fit under if __name__ == '__main__':" in run.stderr, run.stderr[-3000:]
    assert "An attempt has been made to start a new process" not in run.stderr
    assert "without reporting an error (its output above says why)" in run.stderr.splitlines()[-1]


def test_what_spawned_processes_cannot_unpickle_is_a_clear_error() -> None:
    data = TensorDataset(torch.randn(16, 32), torch.randn(16, 10))
    with pytest.raises(tiekit.TiekitError, match=r"strategy='ddp' starts new processes.*no lambdas or local functions"):
        tiekit.fit(
            WeightSharingModule,
            data,
            loss_fn=lambda out, target: F.mse_loss(out, target),
            strategy="ddp",
            devices=2,
            batch_size=4,
            progress=False,
        )


class NoisyData(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Inputs with noise from Python's and NumPy's global generators, as augmentations draw it
    (``entropy``: from the operating system's instead, which no seed reaches)."""

    def __init__(self, entropy: bool = False) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 32, generator=generator), torch.randn(64, 10, generator=generator)
        self.entropy = entropy

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = random.SystemRandom().random() if self.entropy else random.random() + float(np.random.rand())
        return self.x[i] + noise, self.y[i]


def test_spawned_processes_seed_python_and_numpy_so_two_runs_of_one_seed_are_equal() -> None:
    kw: dict[str, Any] = {"loss_fn": F.mse_loss, "max_steps": 3, "batch_size": 4, "progress": False, "seed": 3}
    runs = [tiekit.fit(WeightSharingModule, NoisyData(), strategy="ddp", devices=2, **kw) for _ in range(2)]
    assert runs[0].losses == runs[1].losses and runs[0].replica_digests == runs[1].replica_digests
    # The control: the noise reaches the losses, so unseeded noise makes two runs of one seed differ.
    unseeded = [tiekit.fit(WeightSharingModule, NoisyData(entropy=True), **kw) for _ in range(2)]
    assert unseeded[0].losses != unseeded[1].losses


class AbortsAtExit(WeightSharingModule):
    """Built in a spawned process, it makes that process abort (SIGABRT) at interpreter exit, as
    torch's gloo process groups sometimes do, once the run is over."""

    def __init__(self) -> None:
        super().__init__()
        if multiprocessing.parent_process() is not None:
            atexit.register(os.abort)


def test_a_replica_killed_on_its_way_out_after_every_replica_reported_is_a_warning() -> None:
    """The run is complete (every outcome written before the ranks' last meeting), so fit returns
    it and says what happened; a replica dying before that still fails the run
    (tests/test_train_launchers.py, a worker killed at step 8)."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 32, generator=generator), torch.randn(32, 10, generator=generator))
    kw: dict[str, Any] = {"loss_fn": F.mse_loss, "max_steps": 3, "batch_size": 4, "progress": False}
    with pytest.warns(RuntimeWarning, match=r"killed by signal SIGABRT while exiting, after every replica"):
        result = tiekit.fit(AbortsAtExit, data, strategy="ddp", devices=2, **kw)
    assert (result.steps, result.world_size, result.replicas_identical, result.ties_kept) == (3, 2, True, True)
    assert result.model.layer_3.weight is result.model.layer_1.weight


class FailsOnReplica1(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Replica 1 raises in its third batch, and takes a few seconds to exit after it (an exit
    handler, as a process with much to tear down has); replica 0 meanwhile fails in the group it
    broke, and exits first."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 32, generator=generator), torch.randn(64, 10, generator=generator)
        self.read = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.read += 1
        if torch.distributed.get_rank() == 1 and self.read > 8:
            atexit.register(time.sleep, 3)
            raise ValueError("sample cannot be read on replica 1")
        return self.x[i], self.y[i]


@pytest.mark.newest_torch_only  # fit's own logic, the same on both stacks: one run keeps CI short
def test_the_replica_that_failed_first_is_named_not_the_one_that_exited_first() -> None:
    """torch reports the first replica whose exit it sees: here replica 0, whose error is the broken
    group's ("Connection closed by peer"), which says nothing of the cause."""
    kw: dict[str, Any] = {"loss_fn": F.mse_loss, "max_steps": 6, "batch_size": 4, "progress": False, "shuffle": False}
    with pytest.raises(tiekit.TiekitError) as raised:
        tiekit.fit(WeightSharingModule, FailsOnReplica1(), strategy="ddp", devices=2, **kw)
    message = str(raised.value)
    assert message.startswith("replica 1 (process "), message
    assert "failed: ValueError: sample cannot be read on replica 1 (then replica 0 failed too)" in message, message


def small_disk_on_replica_0(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss that gives replica 0 a 2000-byte file size limit (writes beyond it fail with
    "File too large", as on a full disk) and makes replica 1 take seconds to exit, so that torch
    reads replica 0's error file: cut short by the limit."""
    import resource
    import signal

    if torch.distributed.get_rank() == 0 and not small_disk_on_replica_0.limited:  # type: ignore[attr-defined]
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, resource.RLIM_INFINITY))
        small_disk_on_replica_0.limited = True  # type: ignore[attr-defined]
    if torch.distributed.get_rank() == 1 and not small_disk_on_replica_0.limited:  # type: ignore[attr-defined]
        atexit.register(time.sleep, 5)
        small_disk_on_replica_0.limited = True  # type: ignore[attr-defined]
    return F.mse_loss(output, target)


small_disk_on_replica_0.limited = False  # type: ignore[attr-defined]


@pytest.mark.newest_torch_only  # fit's own logic, the same on both stacks: one run keeps CI short
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_failing_on_one_replica_names_every_replica_and_where_it_began(
    strategy: str, tmp_path: Path
) -> None:
    """A save failing on replica 0 (its disk full) raises the same error on every replica: fit
    named whichever wrote its error first ("replica 1 ... failed: ... rank 0: ... File too large
    (then replica 0 failed too)"), and, when torch read replica 0's own error file, cut short by
    the same full disk, torch's raw UnpicklingError came out of fit instead."""
    data = TensorDataset(torch.randn(64, 32), torch.randn(64, 10))
    kw: dict[str, Any] = {"max_steps": 4, "batch_size": 4, "progress": False, "checkpoint_every": 2}
    with pytest.raises(tiekit.CheckpointError) as raised:
        tiekit.fit(
            WeightSharingModule, data, loss_fn=small_disk_on_replica_0, strategy=strategy, devices=2,
            checkpoint_dir=tmp_path, **kw,
        )  # fmt: skip
    message = str(raised.value)
    assert message.startswith("replicas 0, 1 (processes "), message
    assert "all failed with: CheckpointError: " in message and "rank 0: " in message, message
    assert "File too large" in message and message.endswith("would go on from: none (the folder holds none)"), message
    assert not list(tmp_path.glob("step-*")), list(tmp_path.iterdir())


def loss_on_this_replicas_share_of_the_cores(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE, raising in a replica whose torch threads are not its share of the host's cores."""
    share, rank = max(1, (os.cpu_count() or 1) // 2), torch.distributed.get_rank()
    if torch.get_num_threads() != share:
        raise ValueError(f"replica {rank} runs {torch.get_num_threads()} threads, not {share}")
    if os.environ.get("LOCAL_RANK") != str(rank):  # for code that reads it, as under torchrun
        raise ValueError(f"replica {rank} has LOCAL_RANK={os.environ.get('LOCAL_RANK')}")
    return F.mse_loss(output, target)


@pytest.mark.newest_torch_only  # fit's own logic, the same on both stacks: one run keeps CI short
def test_replicas_fit_spawns_ignore_the_local_rank_they_inherit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A LOCAL_RANK left in the caller's environment reached both spawned replicas: each took
    itself for local rank 1 of a host of unknown size, and all of the host's cores (on a GPU
    host, both would have taken cuda:1)."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # fit divides the cores only when it is unset
    data = TensorDataset(torch.randn(32, 32), torch.randn(32, 10))
    kw: dict[str, Any] = {"max_steps": 2, "batch_size": 4, "progress": False}
    result = tiekit.fit(
        WeightSharingModule, data, loss_fn=loss_on_this_replicas_share_of_the_cores, strategy="ddp", devices=2, **kw
    )
    assert result.world_size == 2 and result.steps == 2


def interrupted_at_the_third_batch(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss every replica is interrupted in, as by a SIGINT sent to the replicas alone."""
    if interrupted_at_the_third_batch.calls == 2:  # type: ignore[attr-defined]
        raise KeyboardInterrupt
    interrupted_at_the_third_batch.calls += 1  # type: ignore[attr-defined]
    return F.mse_loss(output, target)


interrupted_at_the_third_batch.calls = 0  # type: ignore[attr-defined]


@pytest.mark.newest_torch_only  # fit's own logic, the same on both stacks: one run keeps CI short
def test_replicas_all_interrupted_are_reported_by_their_error_files() -> None:
    """torch's spawn wrapper ends a replica interrupted by KeyboardInterrupt with exit code 0, so
    no exit reports it; fit said the replicas "exited without reporting (see their output above)",
    above which nothing was printed."""
    kw: dict[str, Any] = {"max_steps": 6, "batch_size": 4, "progress": False}
    with pytest.raises(tiekit.TiekitError) as raised:
        data = TensorDataset(torch.randn(64, 32), torch.randn(64, 10))
        tiekit.fit(WeightSharingModule, data, loss_fn=interrupted_at_the_third_batch, strategy="ddp", devices=2, **kw)
    assert str(raised.value).startswith("replicas 0, 1 (processes "), str(raised.value)
    assert str(raised.value).endswith("all failed with: KeyboardInterrupt"), str(raised.value)


def test_a_dataloader_holding_a_generator_trains_as_in_one_process() -> None:
    """A torch.Generator does not survive torch's spawn pickling (pytorch/pytorch#146828): the
    replica died unpickling the job, and fit could say only that it "exited with code 1". It now
    travels by value, and the subset its sampler draws with it is the one a single process trains on."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 32, generator=generator), torch.randn(48, 10, generator=generator))
    subset = SubsetRandomSampler(range(24), generator=torch.Generator().manual_seed(7))
    kw: dict[str, Any] = {"loss_fn": F.mse_loss, "max_steps": 3, "progress": False, "seed": 1}
    kw["optimizer"] = functools.partial(torch.optim.SGD, lr=0.1)
    spawned = tiekit.fit(
        WeightSharingModule, DataLoader(data, batch_size=4, sampler=subset), strategy="ddp", devices=2, **kw
    )
    alone = tiekit.fit(WeightSharingModule, DataLoader(data, batch_size=8, sampler=subset), devices="cpu", **kw)
    trained, expected = spawned.model.state_dict(), alone.model.state_dict()
    for name in expected:
        torch.testing.assert_close(trained[name], expected[name], rtol=1e-5, atol=1e-6)
    assert spawned.ties_kept and spawned.model.layer_3.weight is spawned.model.layer_1.weight


@pytest.mark.newest_torch_only  # fit's own logic, the same on both stacks: one run keeps CI short
def test_a_loss_gone_nan_on_one_rank_stops_every_rank_at_the_next_save(tmp_path: Path) -> None:
    x, y = torch.randn(64, 32), torch.randn(64, 10)
    x[25] = float("nan")  # rank 1's 13th sample (no shuffle): in its batch of step 4
    kw: dict[str, Any] = {"loss_fn": F.mse_loss, "strategy": "ddp", "devices": 2, "batch_size": 4, "shuffle": False}
    kw |= {"max_steps": 8, "checkpoint_dir": tmp_path, "checkpoint_every": 2, "progress": False}
    with pytest.raises(tiekit.TiekitError, match=r"the loss of step 4 was nan on rank 1\. fit stopped at step 4"):
        tiekit.fit(WeightSharingModule, TensorDataset(x, y), **kw)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000002.safetensors"]


def test_a_resume_taking_as_many_samples_per_step_with_other_loaders_is_quiet(tmp_path: Path) -> None:
    """2 DDP loaders of 4 take, step by step, the samples 1 loader of 8 takes: a resume across them
    continues the same order. It warned that the data order differs (it compared devices and each
    loader's batch), and said nothing where an SPMD host's loader of 4 devices' batches met DDP
    loaders of as many per step but of other spans (probe); another count per step still warns."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 32, generator=generator), torch.randn(64, 10, generator=generator))
    kw: dict[str, Any] = {"loss_fn": F.mse_loss, "seed": 3, "progress": False, "checkpoint_dir": tmp_path}
    kw["optimizer"] = functools.partial(torch.optim.SGD, lr=1e-2)
    torch.manual_seed(3)  # as fit seeds a factory: the runs below start from these weights
    tiekit.fit(WeightSharingModule(), data, strategy="ddp", devices=2, batch_size=4, max_steps=3, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = tiekit.fit(WeightSharingModule, data, devices="cpu", batch_size=8, max_steps=6, resume="last", **kw)
    straight = tiekit.fit(WeightSharingModule, data, devices="cpu", batch_size=8, max_steps=6, seed=3, progress=False,
                          loss_fn=F.mse_loss, optimizer=kw["optimizer"])  # fmt: skip
    assert resumed.losses == pytest.approx(straight.losses[3:], rel=1e-5)
    with pytest.warns(
        UserWarning, match=r"saved by a run that took 8 samples per step \(1 loader\(s\) of 8\), with 4 "
    ):
        tiekit.fit(WeightSharingModule, data, devices="cpu", batch_size=4, max_steps=8, resume="last", **kw)
