"""tiekit.fit with XLA:CPU launch threads (one process, one thread per device): fit inside your own
``torch_xla.launch``, bf16-mixed on a tied weight without racing, and a failing replica that
releases its peers with a TiekitError. Every run is a subprocess with a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.xla

ROOT = Path(__file__).resolve().parents[1]


def run_file(
    tmp_path: Path, code: str, timeout: float, args: list[str] | None = None, devices: int = 2
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """Run ``code`` as a script file (launch's worker process re-imports it) on ``devices`` XLA:CPU
    devices; the process and the JSON records it printed (lines starting with ``RECORD``)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "XLA_ENABLE_PARAM_ALIASING": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), *(args or [])],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    records = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RECORD ")]
    return done, records


# Ten fits inside the user's own torch_xla.launch (2 threads), bf16-mixed, on the seeds' module
# whose one weight feeds two Linear layers. The last one writes checkpoints: the renames show who
# wrote them.
OWN_LAUNCH = """
import functools, json, sys, threading, torch, torch.nn.functional as F, torch_xla
import torch_xla.runtime as xr
import tiekit
from models import WeightSharingModule
from examples.weight_sharing import dataset

folder = sys.argv[1]
lock = threading.Lock()

def record(**fields):
    with lock:
        print("RECORD " + json.dumps(fields), flush=True)

def audit(event, args):
    if event == "os.rename" and str(args[1]).endswith(".safetensors"):
        record(kind="rename", ordinal=xr.global_ordinal(), file=str(args[1]))

def replica(index):
    sys.addaudithook(audit) if index == 0 else None
    for run in range(10):
        ckpt = dict(checkpoint_dir=folder + "/ckpt", checkpoint_every=6) if run == 9 else {}
        model, start = WeightSharingModule, None
        if run == 0:  # a module each replica builds its own way: replica 0's weights go to every replica
            torch.manual_seed(1000 * index)
            model = WeightSharingModule()
            start = [v.sum().item() for v in model.state_dict().values()]
        result = tiekit.fit(model, dataset(256), loss_fn=F.mse_loss, strategy="xla", max_steps=12,
                            batch_size=8, precision="bf16-mixed", progress=False,
                            optimizer=functools.partial(torch.optim.AdamW, lr=1e-2), **ckpt)
        record(kind="fit", ordinal=index, run=run, steps=result.steps, world=result.world_size,
               digest=result.replica_digests[index], digests=list(result.replica_digests),
               ties_kept=result.ties_kept, first=result.losses[:1],
               last=result.losses[-1:], checkpoint=str(result.checkpoint), start=start)

if __name__ == "__main__":
    torch_xla.launch(replica)
"""


def test_ten_bf16_mixed_fits_inside_your_own_launch_never_race(tmp_path: Path) -> None:
    # Before: with autocast's cast cache on, one thread leaving autocast cleared the casts the
    # other was using; it traced one more cast, its all-reduce met nobody, and XLA aborted the
    # process ("Termination timeout for all reduce ... only 1 of them arrived") in the first fit.
    # And each thread's fit made its own run id, so their compile gates never met: a hang.
    done, records = run_file(tmp_path, OWN_LAUNCH, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    fits = [r for r in records if r["kind"] == "fit"]
    assert sorted((r["run"], r["ordinal"]) for r in fits) == [(run, o) for run in range(10) for o in (0, 1)]
    for run in range(10):
        pair = [r for r in fits if r["run"] == run]
        assert all(r["steps"] == 12 and r["world"] == 2 and r["ties_kept"] for r in pair)
        assert pair[0]["digest"] == pair[1]["digest"]  # each replica ends bit-identical to its peer
        assert pair[0]["digests"] == pair[1]["digests"] == [pair[0]["digest"]] * 2  # and every result says so
    first = sorted((r for r in fits if r["run"] == 0), key=lambda r: r["ordinal"])
    assert first[0]["start"] != first[1]["start"]  # built apart, trained as one (before: digests differed)
    assert all(r["last"][0] < r["first"][0] for r in fits if r["ordinal"] == 0)
    # The run's checkpoints: written once each, by ordinal 0; both replicas name the last one.
    renames = [r for r in records if r["kind"] == "rename"]
    assert [(r["ordinal"], Path(r["file"]).name) for r in renames] == [
        (0, "step-00000006.safetensors"),
        (0, "step-00000012.safetensors"),
    ]
    last = str(tmp_path / "ckpt" / "step-00000012.safetensors")
    assert [r["checkpoint"] for r in fits if r["run"] == 9] == [last, last]


FAILING_REPLICA = """
import json, sys, time, warnings, torch, torch.nn.functional as F
import torch_xla.runtime as xr
from torch.utils.data import Dataset
import tiekit
from models import WeightSharingModule
from examples.weight_sharing import dataset

calls = {}

def loss_on_replica_1_fails_at_step_4(out, target):
    ordinal = xr.global_ordinal()
    calls[ordinal] = calls.get(ordinal, 0) + 1
    if ordinal == FAILING and calls[ordinal] == 4:
        raise ValueError(f"replica {FAILING} cannot compute this loss")
    return F.mse_loss(out, target)

class SampleOfReplica1Fails(Dataset):
    # Unshuffled, replica 1 reads the odd samples: it fails in its 4th batch, replica 0 never.

    def __init__(self):
        self.data = dataset(256)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if i == 61:
            raise ValueError("sample 61 cannot be read")
        return self.data[i]

FAILING = int(sys.argv[3]) if len(sys.argv) > 3 else 1

if __name__ == "__main__":
    started = time.time()
    if sys.argv[2] == "loss":
        data, loss_fn = dataset(256), loss_on_replica_1_fails_at_step_4
    else:
        data, loss_fn = SampleOfReplica1Fails(), F.mse_loss
    with warnings.catch_warnings(record=True) as caught:  # "16-true" is bfloat16 on XLA: a note says so
        warnings.simplefilter("always")
        try:
            tiekit.fit(WeightSharingModule, data, loss_fn=loss_fn, strategy="xla", devices=2, max_steps=12,
                       batch_size=8, shuffle=False, progress=False, precision="16-true")
            error = None
        except Exception as exc:
            error = {"type": type(exc).__name__, "tiekit": isinstance(exc, tiekit.TiekitError), "message": str(exc),
                     "notes": getattr(exc, "__notes__", []), "traceback": str(exc.__cause__)}
    notes = [[w.filename, str(w.message)] for w in caught if "16-true" in str(w.message)]
    print("RECORD " + json.dumps({"error": error, "seconds": time.time() - started, "notes": notes}), flush=True)
"""


@pytest.mark.parametrize(
    ("where", "raised", "line"),
    [
        ("loss", "ValueError: replica 1 cannot compute this loss", "in loss_on_replica_1_fails_at_step_4"),
        # Raised in torch_xla's loader thread, which used to swallow it: replica 1's epoch just
        # ended early, fit went on and returned as if nothing had happened.
        ("dataset", "ValueError: sample 61 cannot be read", "in __getitem__"),
    ],
)
def test_a_replica_that_raises_releases_its_peer_with_a_tiekit_error(
    tmp_path: Path, where: str, raised: str, line: str
) -> None:
    started = time.monotonic()
    done, records = run_file(tmp_path, FAILING_REPLICA, timeout=180, args=[where])
    assert done.returncode == 0, done.stderr[-3000:]
    error = records[-1]["error"]
    assert error is not None and error["tiekit"], error
    # Its own type, so that fit adds no "raised in replica 0" note: the message names the replica that failed.
    assert error["type"] == "ReplicaStopped" and error["notes"] == [], error
    assert "replica 0 stopped because another replica failed" in error["message"]
    assert f"replica 1: {raised}" in error["message"]
    # The launch's report of replica 0's error (the process pool's remote traceback) holds replica
    # 1's traceback as its cause, down to the line of the user's code: it was the message alone.
    assert 'job.py", line' in error["traceback"] and line in error["traceback"], error["traceback"][-3000:]
    assert "The above exception was the direct cause" in error["traceback"]
    # The replicas' warnings reach the caller (they went to the launched process's stderr), once,
    # at the line that called fit (they were given in tiekit's loop, in a launch thread).
    [[filename, note]] = records[-1]["notes"]
    assert filename == str(tmp_path / "job.py") and note.startswith('precision="16-true" on XLA trains in bfloat16')
    assert time.monotonic() - started < 120  # released at once, not after XLA's or a collective's timeout


def test_replica_0s_own_error_names_replica_0(tmp_path: Path) -> None:
    """The launch raises replica 0's exception: a peer's failure reaches you as replica 0's
    TiekitError naming the replica that failed, but replica 0's own error named no replica."""
    done, records = run_file(tmp_path, FAILING_REPLICA, timeout=180, args=["loss", "0"])
    assert done.returncode == 0, done.stderr[-3000:]
    error = records[-1]["error"]
    assert error is not None and error["type"] == "ValueError", error
    assert error["message"] == "replica 0 cannot compute this loss"
    assert error["notes"] == ["tiekit.fit: raised in replica 0 of 2"]


# Inside your own torch_xla.launch: a fit whose replica 1 cannot build its model (a 64 MiB one),
# while replica 0 waits in fit's check that both hold the same model; the error caught, a
# collective of your own, then two more fits.
FIT_AFTER_A_FAILED_FIT = """
import gc, json, sys, threading, time, traceback, weakref, torch, torch.nn.functional as F, torch_xla
import torch_xla.runtime as xr
import tiekit
from models import WeightSharingModule
from examples.weight_sharing import dataset

lock = threading.Lock()
built = {}

def record(**fields):
    with lock:
        print("RECORD " + json.dumps(fields), flush=True)

def model_replica_1_cannot_build():
    model = WeightSharingModule()
    if xr.global_ordinal() == 1:
        model.register_buffer("ballast", torch.zeros(16, 1024, 1024))
        built[1] = weakref.ref(model)
        raise ValueError("replica 1 cannot build its model")
    return model

def described(exc):
    return f"{type(exc).__name__}: {exc}"

def replica(index):
    for run, factory in enumerate([model_replica_1_cannot_build, WeightSharingModule, WeightSharingModule]):
        started, error, cause = time.time(), None, ""
        try:
            tiekit.fit(factory, dataset(256), loss_fn=F.mse_loss, strategy="xla", max_steps=6, batch_size=8,
                       progress=False)
        except Exception as exc:
            error, cause = described(exc), str(exc.__cause__)
        record(ordinal=index, run=run, error=error, cause=cause, seconds=time.time() - started)
        if run == 0:
            gc.collect()
            record(ordinal=index, freed=built[1]() is None if 1 in built else None)
            try:
                tiekit.collective_check_same_model(WeightSharingModule())
                record(ordinal=index, own="ok")
            except Exception as exc:
                record(ordinal=index, own=described(exc))

if __name__ == "__main__":
    torch_xla.launch(replica)
"""


def test_a_fit_after_a_failed_fit_in_your_own_launch_is_refused_naming_the_failure(tmp_path: Path) -> None:
    """The launch threads' collectives kept the failure of the first fit: every later collective
    of the launch raised "stopped because another replica failed", though none had. Counted per
    fit, the next fit trained on, and XLA aborted the process ("Termination timeout for all
    reduce"): the failed fit left computations traced on its devices. Later fits and your own
    collectives are refused, saying so; replica 0, released from a gather, carries replica 1's
    traceback as its cause; that traceback is kept as text, not holding replica 1's model."""
    done, records = run_file(tmp_path, FIT_AFTER_A_FAILED_FIT, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]  # no XLA abort
    fits = {(r["ordinal"], r["run"]): r for r in records if "run" in r}
    assert sorted(fits) == [(o, run) for o in (0, 1) for run in range(3)]
    failed = "ValueError: replica 1 cannot build its model"
    assert fits[(1, 0)]["error"] == failed
    assert fits[(0, 0)]["error"].startswith("ReplicaStopped: replica 0: stopped because another replica failed")
    assert fits[(0, 0)]["error"].endswith(failed)
    cause = fits[(0, 0)]["cause"]  # the failing replica's traceback: the line of the user's factory
    assert "in model_replica_1_cannot_build" in cause and 'raise ValueError("replica 1 cannot build' in cause, cause
    assert [r["freed"] for r in records if "freed" in r] == [True, True]  # replica 1's 64 MiB model is gone
    refused = f"ReplicaStopped: replica {{}}: a tiekit.fit in this torch_xla.launch failed ({failed})"
    for ordinal in (0, 1):
        [own] = [r["own"] for r in records if r["ordinal"] == ordinal and "own" in r]
        assert own.startswith(refused.format(ordinal)), own
        for run in (1, 2):
            error = fits[(ordinal, run)]["error"]
            assert error.startswith(refused.format(ordinal)) and "in a new torch_xla.launch" in error, error
            assert fits[(ordinal, run)]["seconds"] < 30  # refused at once, no timeout


# fit(strategy="xla", devices=2) on XLA:CPU: the replicas are launch threads of one process.
# argv: the folder, "clean" (no transfer in the step; with log_every=1 the other replica fetches
# its losses after every step, for the save's check) or "chatty" (an .item() in every step).
TRANSFERS = """
import sys, warnings, torch, torch.nn.functional as F
from torch.utils.data import TensorDataset
import tiekit
from tiekit.train import PerformanceWarning
from models import WeightSharingModule

def chatty(out, target):
    loss = F.mse_loss(out, target)
    if loss.item() > 1e9:  # a host transfer inside the step
        raise AssertionError("unreachable")
    return loss

if __name__ == "__main__":
    folder, which = sys.argv[1], sys.argv[2]
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 32, generator=generator), torch.randn(64, 10, generator=generator))
    warnings.simplefilter("always", PerformanceWarning)
    tiekit.fit(
        WeightSharingModule(), data, loss_fn=chatty if which == "chatty" else F.mse_loss, strategy="xla",
        devices=2, batch_size=4, max_steps=12, progress=False, log_every=1 if which == "clean" else 4,
        checkpoint_dir=folder + "/ckpt", checkpoint_every=100,
    )
"""


@pytest.mark.parametrize("which", ["clean", "chatty"])
def test_a_step_is_told_of_its_own_host_transfers_not_another_replicas(tmp_path: Path, which: str) -> None:
    """The transfer count is torch_xla's, per process: replica 1's fetches between its steps
    (its losses for the save's check, the end of its run) made fit warn that replica 0's step,
    which had none, made device-to-host transfers (every run with log_every=1)."""
    done, _ = run_file(tmp_path, TRANSFERS, timeout=300, args=[which])
    assert done.returncode == 0, done.stderr[-3000:]
    warned = "PerformanceWarning: step" in done.stderr and "device-to-host transfer(s)" in done.stderr
    assert warned == (which == "chatty"), done.stderr[-3000:]


# fit(strategy="xla", devices=3 and 4) on 4 XLA:CPU devices: a bias-free Linear (one parameter)
# and an Embedding tied to the output Linear.
MORE_REPLICAS_THAN_CORES = """
import sys, torch, torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
import tiekit

class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.embed(x)).mean(1)

def one_linear():
    return nn.Linear(8, 4, bias=False)

def lm_loss(out, target):
    return ((out - target[:, None]) ** 2).mean()

if __name__ == "__main__":
    x = torch.randn(48, 8, generator=torch.Generator().manual_seed(0))
    ids = torch.arange(48).remainder(32)[:, None]
    for devices in (3, 4):
        for name, model, data, loss_fn in [
            ("linear", one_linear, TensorDataset(x, x[:, :4]), F.mse_loss),
            ("tied", TiedLM, TensorDataset(ids, torch.arange(48).float()), lm_loss),
        ]:
            result = tiekit.fit(model, data, loss_fn=loss_fn, strategy="xla", devices=devices, max_steps=3,
                                batch_size=4, progress=False)
            print("RECORD " + json.dumps(dict(devices=devices, model=name, world=result.world_size,
                                              steps=result.steps, ties_kept=result.ties_kept,
                                              identical=result.replicas_identical)), flush=True)
""".replace("import sys,", "import json, sys,")


def test_more_replicas_than_cores_train(tmp_path: Path) -> None:
    """Every replica's step runs on torch_xla's thread pool, as big as the machine's cores by
    default: with more replicas (3 on 2 cores) one step waited in the pool's queue while the
    others waited for it in the all-reduce, and XLA aborted the process ("Expected 3 threads to
    join the rendezvous, but only 2 of them arrived on time"). The tied model also compiled its
    step's all-reduce twice when a peer's sync outside the gate moved the compile counters. (Fails
    before the fix on machines with fewer than 4 cores.)"""
    done, records = run_file(tmp_path, MORE_REPLICAS_THAN_CORES, timeout=240, devices=4)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(r["devices"], r["model"]) for r in records] == [(3, "linear"), (3, "tied"), (4, "linear"), (4, "tied")]
    for r in records:
        assert (r["world"], r["steps"], r["ties_kept"], r["identical"]) == (r["devices"], 3, True, True), r


# fit(strategy="xla", devices=2) with XLA_THREAD_POOL_SIZE=argv[2], set before the runtime starts.
SMALL_POOL = """
import json, os, sys
os.environ["XLA_THREAD_POOL_SIZE"] = sys.argv[2]
import torch, torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
import tiekit

if __name__ == "__main__":
    x = torch.randn(16, 8)
    try:
        tiekit.fit(nn.Linear(8, 4), TensorDataset(x, x[:, :4]), loss_fn=F.mse_loss, strategy="xla", devices=2,
                   max_steps=2, batch_size=4, progress=False)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    print("RECORD " + json.dumps(dict(error=error)), flush=True)
"""


@pytest.mark.parametrize("size", ["1", "abc"])
def test_a_thread_pool_too_small_for_the_replicas_is_refused_before_the_runtime_starts(
    tmp_path: Path, size: str
) -> None:
    """XLA_THREAD_POOL_SIZE below the replica count would abort the first step's all-reduce, and
    torch_xla reads what is no number as 0 threads ('Check failed: num_threads >= 1'): a
    TiekitError naming the variable, where 'abc' aborted the process (probe)."""
    done, records = run_file(tmp_path, SMALL_POOL, timeout=120, args=[size])
    assert done.returncode == 0, done.stderr[-3000:]
    error = records[-1]["error"]
    assert error is not None and error.startswith("TiekitError: "), error
    assert f"XLA_THREAD_POOL_SIZE={size}" in error and "too small for 2 XLA:CPU replicas" in error, error


# A tied LM with a larger vocabulary, 2 replicas: 2 steps with a checkpoint, then resume="last"
# to step 4.
RESUME_TIED_LM = """
import json, sys, torch
from torch import nn
from torch.utils.data import TensorDataset
import tiekit

class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8192, 256)
        self.mid = nn.Linear(256, 256)
        self.head = nn.Linear(256, 8192, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.mid(self.embed(x)))

def loss(out, target):
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())

if __name__ == "__main__":
    ids = torch.randint(0, 8192, (16, 8), generator=torch.Generator().manual_seed(0))
    kw = dict(loss_fn=loss, strategy="xla", devices=2, batch_size=2, progress=False,
              checkpoint_dir=sys.argv[1] + "/ckpt", checkpoint_every=2)
    for steps, resume in [(2, None), (4, "last")]:
        r = tiekit.fit(TiedLM, TensorDataset(ids, ids), max_steps=steps, resume=resume, **kw)
        print("RECORD " + json.dumps(dict(steps=r.steps, ties_kept=r.ties_kept, identical=r.replicas_identical,
                                          checkpoint=str(r.checkpoint))), flush=True)
"""


def test_a_run_with_checkpoints_resumes_on_two_replicas(tmp_path: Path) -> None:
    """fit broadcasts replica 0's weights to the others when it places the model; that step was
    left to run with the next sync, and on resume that was the sync of each replica's checkpoint
    reads, outside the gate: each replica compiled its own graph, their all-reduces had
    different ids, and XLA aborted the resumed run."""
    done, records = run_file(tmp_path, RESUME_TIED_LM, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(r["steps"], r["ties_kept"], r["identical"]) for r in records] == [(2, True, True), (4, True, True)]
    assert records[1]["checkpoint"].endswith("step-00000004.safetensors")
