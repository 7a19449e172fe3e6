"""tiekit.fit on XLA:CPU: one device in this process; 2 ("xla") and 4 ("spmd") devices in subprocesses."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import WeightSharingModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tiekit
from tiekit.train import PerformanceWarning

pytestmark = pytest.mark.xla

ROOT = Path(__file__).resolve().parents[1]
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


def data(size: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(size, 32, generator=generator), torch.randn(size, 10, generator=generator))


def run_script(code: str, devices: int) -> dict[str, Any]:
    """Run ``code`` in a fresh process with ``devices`` XLA:CPU devices; the JSON it prints last."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_one_xla_device_keeps_the_tie_a_plain_move_breaks(xla_device: torch.device) -> None:
    torch.manual_seed(0)  # as the factory below is built (seed=0)
    model = WeightSharingModule()
    plain = copy.deepcopy(model).to(xla_device)
    assert plain.layer_3.weight is not plain.layer_1.weight and len(list(plain.parameters())) == 3

    kw: dict[str, Any] = {"loss_fn": F.mse_loss, "optimizer": ADAMW, "epochs": 2, "batch_size": 8, "progress": False}
    result = tiekit.fit(model, data(), **kw)
    reference = tiekit.fit(WeightSharingModule, data(), devices="cpu", **kw)
    assert (result.strategy, result.device_type, result.world_size, result.steps) == ("xla", "xla", 1, 16)
    assert result.ties_kept and result.model is model and model.layer_3.weight is model.layer_1.weight
    assert model.layer_1.weight.device.type == "cpu"
    assert result.compilations is not None and result.compilations <= 3  # AdamW's first steps, then one graph
    assert result.xla_report is not None and "compilation(s)" in result.xla_report
    for name, expected in reference.model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], expected, rtol=1e-5, atol=1e-6)


class DtypeProbe(nn.Module):
    """Tied; records the weight dtype and whether XLA autocast was on in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_1 = nn.Linear(32, 32)
        self.layer_2 = nn.Linear(32, 32)
        self.layer_2.weight = self.layer_1.weight
        self.head = nn.Linear(32, 10)
        self.seen: set[tuple[torch.dtype, bool]] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add((self.layer_1.weight.dtype, torch.is_autocast_enabled("xla")))
        return self.head(self.layer_2(torch.relu(self.layer_1(x)))).float()


def test_bf16_on_xla_and_the_16_bit_note(xla_device: torch.device) -> None:
    kw: dict[str, Any] = {"loss_fn": F.mse_loss, "max_steps": 3, "batch_size": 8, "progress": False}
    mixed = DtypeProbe()
    tiekit.fit(mixed, data(), precision="bf16-mixed", **kw)
    assert mixed.seen == {(torch.float32, True)}
    half = DtypeProbe()
    with pytest.warns(UserWarning, match=r'"16-true" on XLA trains in bfloat16') as noted:
        result = tiekit.fit(half, data(), precision="16-true", **kw)
    assert [w.filename for w in noted] == [__file__]  # your fit line, not tiekit's (it named loop.py)
    assert half.seen == {(torch.bfloat16, False)}
    assert result.precision == "bf16-true" and result.ties_kept
    assert half.layer_2.weight is half.layer_1.weight and half.layer_1.weight.dtype == torch.float32


class Ragged:
    """Collate that cuts every batch to a different number of rows: a new shape each step."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        rows = 1 + self.calls % len(batch)
        return torch.stack([x for x, _ in batch[:rows]]), torch.stack([y for _, y in batch[:rows]])


def test_advice_on_recompilations_and_host_transfers(xla_device: torch.device) -> None:
    kw: dict[str, Any] = {"optimizer": ADAMW, "max_steps": 12, "progress": False, "log_every": 4}
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)  # a clean run gives no advice
        tiekit.fit(WeightSharingModule(), data(), loss_fn=F.mse_loss, batch_size=8, **kw)

    shapes = DataLoader(data(), batch_size=8, collate_fn=Ragged())
    with pytest.warns(PerformanceWarning, match=r"XLA compiled \d+ new graph\(s\) after the first 3 steps"):
        tiekit.fit(nn.Sequential(nn.Linear(32, 10)), shapes, loss_fn=lambda out, y: F.mse_loss(out, y), **kw)

    def chatty_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(out, y)
        if loss.item() > 1e9:  # a host transfer inside the step
            raise AssertionError("unreachable")
        return loss

    with pytest.warns(PerformanceWarning, match=r"device-to-host transfer\(s\)"):
        tiekit.fit(WeightSharingModule(), data(), loss_fn=chatty_loss, batch_size=8, **kw)


def _bad_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    raise ValueError("a bug in loss_fn")


def test_a_failed_fit_leaves_the_module_passed_on_the_cpu_tied_and_unchanged(
    xla_device: torch.device, tmp_path: Path
) -> None:
    """A run that fails after it placed the module passed to fit (its optimizer factory, its resume
    checkpoint, its loss_fn) puts the module back on the CPU, tied, with its weights, dtype and
    eval mode: it was left on the XLA device, where a CPU forward fails."""
    untied = WeightSharingModule()
    untied.layer_3.weight = nn.Parameter(untied.layer_3.weight.detach() + 1.0)
    tiekit.save_checkpoint(tmp_path / "untied.safetensors", model=untied)
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"optimizer": lambda params: None}, tiekit.TiekitError, "returned None, not a torch.optim.Optimizer"),
        ({"resume": tmp_path / "missing"}, tiekit.TiekitError, "resume: no checkpoint at"),
        ({"resume": tmp_path / "untied.safetensors"}, tiekit.CheckpointError, "different values"),
        ({"loss_fn": _bad_loss}, ValueError, "a bug in loss_fn"),
        ({"optimizer": lambda params: None, "precision": "bf16-true"}, tiekit.TiekitError, "returned None"),
    ]
    for extra, error, message in cases:
        model = WeightSharingModule().eval()
        before, first = {k: v.clone() for k, v in model.state_dict().items()}, model.layer_1.weight
        kw: dict[str, Any] = {"loss_fn": F.mse_loss, "max_steps": 1, "batch_size": 8, "progress": False, **extra}
        with pytest.raises(error, match=message):
            tiekit.fit(model, data(16), strategy="single", devices="xla", **kw)
        weight = model.layer_1.weight
        assert weight.device.type == "cpu" and weight.dtype == torch.float32, extra
        assert model.layer_3.weight is weight and not model.training, extra
        if "precision" not in extra:  # bf16 rounded the weights on the device
            for name, value in model.state_dict().items():
                torch.testing.assert_close(value, before[name], rtol=0, atol=0)
        model(torch.randn(2, 32))  # on the CPU
        # A resume= path nobody can open stops the run before the move: the very same parameters.
        assert (weight is first) == (extra.get("resume") == tmp_path / "missing"), extra

    plain = WeightSharingModule().to(xla_device).to("cpu")  # the control: a plain round trip unties
    assert plain.layer_3.weight is not plain.layer_1.weight


class _SelfBreaking(WeightSharingModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        del self.layer_3  # a bug that also leaves the model without the tie's second owner
        raise ValueError("a bug in forward")


def test_a_failed_fit_that_cannot_put_the_module_back_raises_its_own_error_noted(xla_device: torch.device) -> None:
    model = _SelfBreaking()
    with pytest.raises(ValueError, match="a bug in forward") as caught:
        tiekit.fit(model, data(8), loss_fn=F.mse_loss, max_steps=1, batch_size=4, devices="xla", progress=False)
    (note,) = caught.value.__notes__
    assert note.startswith("tiekit: putting the model passed to fit back on cpu after this failure failed too: TieE")


XLA_JOB = """
import copy, functools, json, torch, torch.nn.functional as F
import tiekit
from examples.weight_sharing import WeightSharingModule, dataset

opt = functools.partial(torch.optim.AdamW, lr=1e-2)
kw = dict(loss_fn=F.mse_loss, optimizer=opt, epochs=2, seed=3, progress=False, val_data=dataset(22, seed=1))
torch.manual_seed(3)
model = WeightSharingModule()
run = tiekit.fit(model, dataset(128), strategy="xla", batch_size=8, **kw)
# Resumed with dropout, mid-epoch (step 3) and at an epoch's end (step 8 of 8 per epoch), from a
# run that saved after every step: each is bit-identical to the run that went straight through.
import pathlib, tempfile
from models import DroppingWeightSharingModule
folder = pathlib.Path(tempfile.mkdtemp())
dkw = dict(loss_fn=F.mse_loss, optimizer=opt, seed=3, progress=False, strategy="xla", batch_size=8, max_steps=10)
straight = tiekit.fit(DroppingWeightSharingModule, dataset(128), **dkw)
saving = tiekit.fit(DroppingWeightSharingModule, dataset(128), checkpoint_dir=folder, checkpoint_every=1, **dkw)
resumes = {}
for at in (3, 8):
    resumed = tiekit.fit(DroppingWeightSharingModule, dataset(128), resume=folder / f"step-{at:08d}.safetensors", **dkw)
    pairs = zip(straight.model.state_dict().values(), resumed.model.state_dict().values())
    resumes[at] = dict(
        same=all(torch.equal(a, b) for a, b in pairs), losses=[straight.losses[at:], list(resumed.losses)],
        digests=resumed.replica_digests,
    )
saving_same = saving.losses == straight.losses
one = tiekit.fit(WeightSharingModule, dataset(128), strategy="single", devices="xla", batch_size=16, **kw)
plain = copy.deepcopy(model).to(tiekit.devices.resolve_device("xla"))

diff = max((a - b).abs().max().item() for a, b in zip(run.model.state_dict().values(), one.model.state_dict().values()))
print(json.dumps(dict(
    strategy=run.strategy, world=run.world_size, steps=run.steps, one_steps=one.steps, one_world=one.world_size,
    digests=run.replica_digests, ties_kept=run.ties_kept, tied=model.layer_3.weight is model.layer_1.weight,
    compilations=run.compilations, one_compilations=one.compilations, max_diff=diff, losses=run.losses,
    val=run.val_losses, one_val=one.val_losses, resumes=resumes, saving_same=saving_same,
    plain_params=len(list(plain.parameters())), plain_tied=plain.layer_3.weight is plain.layer_1.weight,
)))
"""


def test_xla_strategy_on_two_devices_matches_one_device_with_the_global_batch() -> None:
    out = run_script(XLA_JOB, devices=2)
    assert (out["strategy"], out["world"], out["steps"]) == ("xla", 2, 16)
    assert (out["one_world"], out["one_steps"]) == (1, 16)
    assert len(out["digests"]) == 2 and len(set(out["digests"])) == 1  # replicas bit-identical
    assert out["ties_kept"] and out["tied"]
    assert (out["plain_params"], out["plain_tied"]) == (3, False)  # without tiekit the tie breaks
    # Every graph compiled once, by one replica: as many as one device needs, plus at most the
    # set-up's broadcast of replica 0's weights and the all-reduce of the validation sum (one
    # device has nothing to reduce). Since the broadcast runs in a sync of its own at placement
    # (39e3437) either may be served from XLA's cache (6 against 6 in one CI run), hence a range.
    assert out["one_compilations"] <= out["compilations"] <= out["one_compilations"] + 2, (
        out["compilations"],
        out["one_compilations"],
    )
    assert out["max_diff"] < 1e-5
    assert out["losses"][-1] < 0.8 * out["losses"][0]
    assert out["val"] == pytest.approx(out["one_val"], rel=1e-4)  # the mean over all 22 samples either way
    # With dropout: saving after every step changes nothing, and a resume mid-epoch or at an
    # epoch's end is bit-identical to the run that went straight through.
    assert out["saving_same"]
    for at, resumed in out["resumes"].items():
        assert resumed["same"] and resumed["losses"][0] == resumed["losses"][1], (at, resumed["losses"])
        assert len(resumed["digests"]) == 2 and len(set(resumed["digests"])) == 1


SPMD_JOB = """
import functools, json, torch, torch.nn.functional as F
import tiekit
from models import WeightSharingModule
from examples.weight_sharing import dataset

opt = functools.partial(torch.optim.AdamW, lr=1e-2)
kw = dict(loss_fn=F.mse_loss, optimizer=opt, epochs=2, seed=3, progress=False)
run = tiekit.fit(WeightSharingModule, dataset(128), strategy="spmd", batch_size=4, **kw)  # SPMD first: it must
cpu = tiekit.fit(WeightSharingModule, dataset(128), devices="cpu", batch_size=16, **kw)   # own the runtime
diff = max((a - b).abs().max().item() for a, b in zip(run.model.state_dict().values(), cpu.model.state_dict().values()))
print(json.dumps(dict(strategy=run.strategy, world=run.world_size, steps=run.steps, cpu_steps=cpu.steps,
    ties_kept=run.ties_kept, tied=run.model.layer_3.weight is run.model.layer_1.weight, max_diff=diff)))
"""


def test_spmd_on_four_devices_matches_the_cpu_with_the_global_batch() -> None:
    out = run_script(SPMD_JOB, devices=4)
    assert (out["strategy"], out["world"], out["steps"], out["cpu_steps"]) == ("spmd", 4, 16, 16)
    assert out["ties_kept"] and out["tied"]
    assert out["max_diff"] < 1e-5


SLOW_RUN = """
import sys, time
import torch, torch.nn.functional as F
from torch.utils.data import Dataset
from models import WeightSharingModule
import tiekit


class Slow(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.05)
        return torch.randn(32), torch.randn(10)


if __name__ == "__main__":
    tiekit.fit(WeightSharingModule, Slow(), loss_fn=F.mse_loss, strategy="xla", devices=2, batch_size=4,
               max_steps=500, checkpoint_dir=sys.argv[1], checkpoint_every=1, progress=False)
"""


def test_the_replicas_end_when_the_process_that_called_fit_is_killed(tmp_path: Path) -> None:
    """torch_xla.launch's replica process outlived a killed caller: it trained on, wrote
    checkpoints and held the folder's lock against the run started again in its place (the
    lock named the orphan), then waited forever to hand back its result."""
    import psutil

    script, folder = tmp_path / "slow_run.py", tmp_path / "run"
    script.write_text(SLOW_RUN)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    caller = subprocess.Popen([sys.executable, str(script), str(folder)], env=env, stderr=subprocess.PIPE)
    family: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while not list(folder.glob("step-*")):  # the replicas are training
            assert caller.poll() is None, caller.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.2)
        family = psutil.Process(caller.pid).children(recursive=True)
        assert family, "fit runs its replicas in a process of their own"
        caller.kill()
        caller.wait(timeout=60)
        _, alive = psutil.wait_procs(family, timeout=60)
        assert not alive, f"still running after the caller was killed: {alive}"
        steps = sorted(folder.glob("step-*"))
        time.sleep(2)
        assert sorted(folder.glob("step-*")) == steps  # nobody writes any more
    finally:
        for process in [*family, psutil.Process(caller.pid) if caller.poll() is None else None]:
            if process is not None:
                with contextlib.suppress(psutil.Error):
                    process.kill()


def test_a_killed_replica_process_is_reported_with_the_last_checkpoint(tmp_path: Path) -> None:
    """fit said the replicas' process "died before they finished (XLA prints why above)", where
    nothing was printed (a SIGKILL), and did not say where to resume from."""
    import psutil

    script, folder = tmp_path / "slow_run.py", tmp_path / "run"
    script.write_text(SLOW_RUN)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    caller = subprocess.Popen([sys.executable, str(script), str(folder)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not list(folder.glob("step-*")):
            assert caller.poll() is None and time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.2)
        replicas = [p for p in psutil.Process(caller.pid).children() if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(replicas) == 1, replicas
        replicas[0].kill()
        _, error = caller.communicate(timeout=120)
    finally:
        caller.kill()
    assert "TiekitError: the process running the 2 replicas ended before they finished: killed" in error, error[-3000:]
    assert f'resume="last" would go on from: {folder}{os.sep}step-' in error, error[-3000:]


UNDER_TORCHRUN = """
import torch, torch.nn.functional as F
from torch.utils.data import TensorDataset
from models import WeightSharingModule
import tiekit

if __name__ == "__main__":
    data = TensorDataset(torch.randn(32, 32), torch.randn(32, 10))
    result = tiekit.fit(WeightSharingModule, data, loss_fn=F.mse_loss, strategy="xla", max_steps=2, batch_size=4,
                        progress=False)
    print("trained", result.strategy, result.world_size, result.steps, result.ties_kept, flush=True)
"""


def test_xla_replicas_under_torchrun_train_in_the_process_torchrun_started(tmp_path: Path) -> None:
    """Under torchrun, torch_xla.launch runs the replica in the caller itself: the parent-death
    arrangement of a launched process took the caller for a dead parent and killed it (SIGKILL,
    no message)."""
    script = tmp_path / "under_torchrun.py"
    script.write_text(UNDER_TORCHRUN)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    torchrun = Path(sys.executable).parent / "torchrun"
    done = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node=1", str(script)],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0 and "trained xla 1 2 True" in done.stdout, (done.stdout + done.stderr)[-3000:]
