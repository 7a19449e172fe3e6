"""Lightning's multi-process strategies with KeepTies and TiedCheckpointIO: real Trainers, two
processes each, run in subprocesses with a deadline (`launching.run_together`).

Lightning calls ``CheckpointIO.save_checkpoint`` on global rank 0 only, and with ``ddp_spawn``
hands the trained weights back to the main process through the same plugin, on rank 0 only. A
save that waited for the other ranks hung ``ddp`` at the first checkpoint and broke
``ddp_spawn`` at the end of fit; tiekit's saves are local, and these runs prove both work:
checkpoints every 4 steps, written once by rank 0, a resume that starts at step 4 and ends
with the weights of the uninterrupted run, ties and views intact in every process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launching import BIN, EXAMPLES, audit_env, base_env, renames, run_ok, run_together

pytest.importorskip("lightning.pytorch")

pytestmark = pytest.mark.slow

CHECKPOINTS = {"epoch=0-step=4.ckpt": [0], "epoch=1-step=8.ckpt": [0]}


def run_example(tmp_path: Path, strategy: str) -> str:
    audit = tmp_path / "audit"
    command = [str(BIN / "python"), str(EXAMPLES / "launch_lightning.py"), strategy, "out"]
    [run] = run_ok([command], env=base_env(**audit_env(audit)), cwd=tmp_path)
    out = tmp_path / "out"
    # Every checkpoint written once, by rank 0, as a tied safetensors file.
    assert renames(audit, out / "first" / "checkpoints") == CHECKPOINTS
    assert renames(audit, out / "resumed" / "checkpoints") == {"epoch=1-step=8.ckpt": [0]}
    for rank in range(2):
        assert f"rank {rank}: training starts at step 0" in run.output
        assert f"rank {rank}: training starts at step 4" in run.output
    return run.output


# On the newest-torch stack only (see the spawn test).
@pytest.mark.newest_torch_only
def test_ddp_checkpoints_every_4_steps_and_resumes_tied(tmp_path: Path) -> None:
    output = run_example(tmp_path, "ddp")
    for rank in range(2):  # ddp: every process runs the script, and checks its replica
        assert f"rank {rank}: ddp: resumed at step 4, ties held, weights match" in output


# Lightning's DDP runs on the newest-torch stack only; on torch 2.9.1 Lightning runs its XLA strategy
# (tests/test_integrations_lightning.py).
@pytest.mark.newest_torch_only
def test_ddp_spawn_checkpoints_resumes_and_hands_the_weights_back_tied(tmp_path: Path) -> None:
    output = run_example(tmp_path, "ddp_spawn")
    # The main process checked the weights the workers handed back through TiedCheckpointIO.
    assert "rank 0: ddp_spawn: resumed at step 4, ties held, weights match" in output


SPAWN_NO_CHECKPOINTS = """
import sys

sys.path.insert(0, sys.argv[1])
import lightning.pytorch as pl
import torch
from launch_lightning import TiedLM, data  # which also closes the gloo group at exit (see there)

from tiekit.integrations.lightning import KeepTies, TiedCheckpointIO


class Probe(pl.Callback):
    def on_train_start(self, trainer, module):
        view = module.embed_t.data_ptr() == module.embed.weight.data_ptr()
        print(f"rank {trainer.global_rank}: tied {module.head.weight is module.embed.weight}, view {view}", flush=True)


if __name__ == "__main__":
    model = TiedLM()
    before = model.embed.weight.detach().clone()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=2, plugins=[TiedCheckpointIO()],
        callbacks=[KeepTies(), Probe()], enable_checkpointing=False, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data())
    trained = not torch.equal(model.embed.weight, before)
    print(f"main: weights back {trained}, tied {model.head.weight is model.embed.weight}", flush=True)
"""


# On the newest-torch stack only (see the spawn test).
@pytest.mark.newest_torch_only
def test_ddp_spawn_without_checkpoints_hands_back_weights_and_copies_view_buffers(tmp_path: Path) -> None:
    # The reported failure: with no checkpointing, fit failed at its very end, when rank 0 hands
    # the weights back through TiedCheckpointIO (a save that waited for rank 1, which had
    # finished: "Connection closed by peer"). Here the main process gets them, tied.
    # And why launch_lightning.py passes KeepTies(plan=...): on the CPU, ddp_spawn's workers copy
    # every parameter and buffer (Lightning's _disable_module_memory_sharing) before any
    # callback runs. Parameter ties survive (each parameter is copied once); a buffer that was
    # a view arrives as a copy, and a plan made in the worker cannot know it was a view.
    (tmp_path / "probe.py").write_text(SPAWN_NO_CHECKPOINTS)
    [run] = run_ok([[str(BIN / "python"), "probe.py", str(EXAMPLES)]], env=base_env(), cwd=tmp_path)
    assert "main: weights back True, tied True" in run.output
    for rank in range(2):
        assert f"rank {rank}: tied True, view False" in run.output


STAGE_AFTER_A_RANK_0_LOAD = """
import sys

sys.path.insert(0, sys.argv[1])
import lightning.pytorch as pl
import torch
from launch_lightning import TiedLM, data

from tiekit.integrations.lightning import KeepTies


class LM(TiedLM):
    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)

    test_step = validation_step


if __name__ == "__main__":
    model = LM()
    keep = KeepTies()
    options = dict(accelerator="cpu", enable_checkpointing=False, logger=False, enable_progress_bar=False,
                   enable_model_summary=False)
    trainer = pl.Trainer(devices=2, strategy="ddp", max_steps=2, callbacks=[keep], **options)
    trainer.fit(model, data())
    if trainer.global_rank == 0:  # Lightning's advice: test on one device, rank 0 alone (rank 1 waits below)
        pl.Trainer(devices=1, callbacks=[keep], **options).test(model, data(), verbose=False)
        print("rank 0: tested alone", flush=True)
    torch.distributed.barrier()
    if trainer.global_rank == 0:  # weights loaded on rank 0 alone, with assign=True: its tie breaks
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    print(f"rank {trainer.global_rank}: tied {model.head.weight is model.embed.weight}", flush=True)
    try:
        trainer.validate(model, data(), verbose=False)
    except Exception as exc:
        print(f"rank {trainer.global_rank}: {type(exc).__name__}: {exc}", flush=True)
        raise
"""


@pytest.mark.newest_torch_only
def test_a_tie_broken_on_one_rank_between_stages_is_refused_on_every_rank(tmp_path: Path) -> None:
    """KeepTies' between-stage check ran per rank: rank 0 raised its TieError alone and rank 1
    failed in DDP's first broadcast ("Connection closed by peer"), naming no tie. The ranks
    compare what they found: each raises a TieError naming every rank's."""
    (tmp_path / "probe.py").write_text(STAGE_AFTER_A_RANK_0_LOAD)
    [run] = run_together([[str(BIN / "python"), "probe.py", str(EXAMPLES)]], env=base_env(), cwd=tmp_path)
    assert run.returncode != 0
    # A one-device stage rank 0 runs alone checks alone: its check gathered over the DDP group and
    # waited for rank 1 for good (the group's 30 minutes; probe today52).
    assert "rank 0: tested alone" in run.output
    assert "rank 0: tied False" in run.output and "rank 1: tied True" in run.output  # the break, on rank 0 only
    said = (
        "TieError: KeepTies: at the start of validate, the ranks' LM no longer hold the same ties they held at the "
        "end of the stage before (rank 0: head.weight is not embed.weight, embed_t is not a view of embed.weight; "
        "rank 1: holds every tie)"
    )
    for rank in range(2):
        assert f"rank {rank}: {said}" in run.output, run.output[-3000:]
    assert "Connection closed by peer" not in run.output


XLA_TWO_DEVICES = """
import sys

sys.path.insert(0, sys.argv[1])
import lightning.pytorch as pl
import torch
from launch_lightning import TiedLM, data
from lightning.pytorch.accelerators import XLAAccelerator
from lightning.pytorch.strategies import XLAStrategy

from tiekit.integrations.lightning import KeepTies


class XLACPUAccelerator(XLAAccelerator):
    # Lightning counts TPU chips (asking the GCE metadata server) to decide whether XLA is
    # there and how many devices it has; XLA:CPU has none. Everything else is Lightning's.
    @staticmethod
    def is_available():
        return True

    @staticmethod
    def parse_devices(devices):
        return int(devices)

    @staticmethod
    def get_parallel_devices(devices):
        return [torch.device("xla", i) for i in range(int(devices))]


if __name__ == "__main__":
    trainer = pl.Trainer(
        accelerator=XLACPUAccelerator(), devices=2, strategy=XLAStrategy(), max_steps=2, callbacks=[KeepTies()],
        enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(TiedLM(), data())
    print("trained on 2 XLA:CPU devices")
"""


@pytest.mark.xla
def test_lightning_xla_strategy_on_two_xla_cpu_devices_aborts_in_lightnings_first_broadcast(tmp_path: Path) -> None:
    # Not tiekit's: Lightning's XLAStrategy runs one launch thread per XLA:CPU device, and its
    # first collective (Trainer.log_dir -> XLAStrategy.broadcast -> xm.collective_broadcast, before
    # any callback) is compiled by both threads at once; each compile gets its own op_id, the
    # rendezvous never completes and XLA aborts the process. If this starts passing, Lightning
    # on several XLA:CPU devices works: test KeepTies there and update docs/launching.md.
    (tmp_path / "xla_two.py").write_text(XLA_TWO_DEVICES)
    env = base_env(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2", PYTHONFAULTHANDLER="1")
    [run] = run_together([[str(BIN / "python"), "xla_two.py", str(EXAMPLES)]], env=env, cwd=tmp_path)
    assert run.returncode != 0 and "trained on 2 XLA:CPU devices" not in run.output
    # The launch process dies under Lightning's pool; how it dies varies. 12 of 12 runs here end in
    # the rendezvous timeout; CI at 7504bed saw the process die before it, with no message (the
    # child's own output lost with it). Where (XLAStrategy.broadcast) shows only when faulthandler
    # dumps the launch thread's stack, in 3 of 5 runs (CI at 4b9d8e2 failed on requiring it).
    assert "BrokenProcessPool" in run.output, run.output[-3000:]
