"""tiekit's saves under real launchers: two processes (or replicas) per run, never a hang.

Each test runs an example of ``examples/launch_*.py`` under its real launcher (plain
torch.distributed processes, torchrun on one node and on two, torch.multiprocessing.spawn,
accelerate launch, torch_xla.launch, tiekit.fit), with a deadline and SIGKILL for every process
left (`launching.run_together`). Each file's writes are counted from the outside: an audit
hook in every launched Python process logs each rename that publishes a file, with its rank.

The bug these guard against: saves used to wait for every rank inside ``save_model``, so the
everyday ``if rank == 0: save(...)`` followed by ``dist.barrier()`` deadlocked (rank 0 in the
hidden barrier, the others in the user's). `test_a_hidden_barrier_in_save_model_fails_the_test`
puts that barrier back and checks the harness fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from launching import BIN, EXAMPLES, ROOT, audit_env, base_env, free_port, renames, run_ok, run_together

import tiekit

pytestmark = pytest.mark.slow

WORLD = 2
TORCHRUN_EXAMPLE = str(EXAMPLES / "launch_torchrun.py")


def plain_processes(script: list[str], port: int) -> list[list[str]]:
    """The environment torchrun would give, set by hand: no launcher at all."""
    return [
        [
            "env",
            f"RANK={rank}",
            f"LOCAL_RANK={rank}",
            f"WORLD_SIZE={WORLD}",
            "MASTER_ADDR=127.0.0.1",
            f"MASTER_PORT={port}",
            str(BIN / "python"),
            *script,
        ]
        for rank in range(WORLD)
    ]


def torchrun_two_nodes(script: list[str], port: int) -> list[list[str]]:
    """Two torchrun agents, one process each, meeting through the c10d rendezvous."""
    return [
        [
            str(BIN / "torchrun"),
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=tiekit-test",
            *script,
        ]
        for node in range(2)
    ]


def messages(output: str) -> list[str]:
    """The example's "rank N: ..." messages, also where two processes' lines ran together."""
    return [m.strip() for line in output.splitlines() for m in re.split(r"(?=rank \d+: )", line) if m.strip()]


def check_save_patterns(out: Path, audit: Path, output: str) -> None:
    """What `launch_torchrun.save_patterns` must leave behind, read from the files, the renames
    and the output of every rank."""
    written = renames(audit, out)
    # 1. One writer: rank 0 wrote the file; the barrier, a load and an all_reduce followed on both.
    assert written["writer.safetensors"] == [0]
    # 2. Every rank called collective_save_model with one path: one write, by rank 0.
    assert written["shared.safetensors"] == [0]
    # 3. Per-rank paths: each rank wrote its own file, through the collective and locally.
    for rank in range(WORLD):
        assert written[f"rank{rank}.safetensors"] == [rank]
        assert written[f"local{rank}.safetensors"] == [rank]
    # 4. Failing writers: nothing was published under the blocked path (a regular file) ...
    assert (out / "blocked").is_file() and not any(name.startswith("blocked") for name in written)
    assert written["again0.safetensors"] == [0] and f"again{WORLD - 1}.safetensors" not in written
    for rank in range(WORLD):
        # ... and every rank, the writer itself included, got the error naming the failing rank.
        assert f"rank {rank}: writer pattern: saved by rank 0, all_reduce 3" in output
        assert f"rank {rank}: shared path: written once, present on return" in output
        failures = [m for m in messages(output) if m.startswith(f"rank {rank}: writer failure seen: ")]
        assert len(failures) == 2, output
        assert "collective_save_model failed on 1 of 2 rank(s): rank 0 (" in failures[0]
        assert "blocked/shared.safetensors): CheckpointError: " in failures[0]
        assert f"rank {WORLD - 1} (" in failures[1] and f"blocked/rank{WORLD - 1}.safetensors" in failures[1]


def run_patterns(tmp_path: Path, commands: list[list[str]]) -> None:
    out, audit = tmp_path / "out", tmp_path / "audit"
    runs = run_ok(commands, env=base_env(**audit_env(audit)), cwd=tmp_path)
    check_save_patterns(out, audit, "\n".join(r.output for r in runs))


def test_save_patterns_in_plain_torch_distributed_processes(tmp_path: Path) -> None:
    run_patterns(tmp_path, plain_processes([TORCHRUN_EXAMPLE, "out"], free_port()))


# The launcher's handling, not torch's: on the newest-torch stack only (plain processes run on both).
@pytest.mark.newest_torch_only
def test_save_patterns_under_torchrun_on_one_node(tmp_path: Path) -> None:
    torchrun = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={WORLD}", TORCHRUN_EXAMPLE, "out"]
    run_patterns(tmp_path, [torchrun])


# The launcher's handling, not torch's: on the newest-torch stack only (plain processes run on both).
@pytest.mark.newest_torch_only
def test_save_patterns_under_torchrun_on_two_nodes(tmp_path: Path) -> None:
    run_patterns(tmp_path, torchrun_two_nodes([TORCHRUN_EXAMPLE, "out"], free_port()))


# The launcher's handling, not torch's: on the newest-torch stack only (plain processes run on both).
@pytest.mark.newest_torch_only
def test_save_patterns_under_torch_multiprocessing_spawn(tmp_path: Path) -> None:
    run_patterns(tmp_path, [[str(BIN / "python"), str(EXAMPLES / "launch_spawn.py"), "out"]])


HIDDEN_BARRIER = '''
"""The old tiekit: save_model waited for every rank after writing (a hidden barrier)."""
import runpy, sys

import torch.distributed as dist

import tiekit

_save = tiekit.save_model


def save_model(*args, **kwargs):
    _save(*args, **kwargs)
    dist.barrier()


tiekit.save_model = save_model
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


@pytest.mark.newest_torch_only
def test_a_hidden_barrier_in_save_model_fails_the_test(tmp_path: Path) -> None:
    # The rank-0 pattern with the old save_model: rank 0 waits in the save's barrier while
    # rank 1 waits in the user's; they pair up, and the next collectives do not: a hang, which
    # the harness turns into a failure. The same run without the barrier is done in 2.5-3.5 s
    # (test_save_patterns_in_plain_torch_distributed_processes); a run too slow to reach the save
    # within the deadline fails the last line instead of passing.
    (tmp_path / "old_tiekit.py").write_text(HIDDEN_BARRIER)
    commands = plain_processes([str(tmp_path / "old_tiekit.py"), TORCHRUN_EXAMPLE, "out"], free_port())
    with pytest.raises(AssertionError, match=r"killed: not done within 8 s"):
        run_together(commands, env=base_env(), cwd=tmp_path, timeout=8)
    assert (tmp_path / "out" / "writer.safetensors").is_file()  # it got as far as the save


def accelerate_launch(script: Path, *args: str) -> list[str]:
    """``accelerate launch`` of ``script`` on WORLD gloo CPU processes: --multi_gpu is its torchrun
    launcher (with --cpu, accelerate 1.x starts one process unless mpirun is configured)."""
    options = ["--multi_gpu", f"--num_processes={WORLD}", "--num_machines=1", "--mixed_precision=no"]
    options += ["--dynamo_backend=no", f"--main_process_port={free_port()}"]
    return [str(BIN / "accelerate"), "launch", *options, str(script), *args]


# The launcher's handling, not torch's: on the newest-torch stack only (plain processes run on both).
@pytest.mark.newest_torch_only
def test_accelerate_launch_main_process_and_collective_saves(tmp_path: Path) -> None:
    # `accelerate launch --cpu --num_processes 2` starts ONE process (accelerate 1.x sends --cpu
    # to its single-process launcher unless mpirun is configured); --multi_gpu is its torchrun
    # launcher, and Accelerator(cpu=True) makes the processes gloo CPU processes.
    audit = tmp_path / "audit"
    command = accelerate_launch(EXAMPLES / "launch_accelerate.py", "out")
    [run] = run_ok([command], env=base_env(**audit_env(audit)), cwd=tmp_path)
    for rank in range(WORLD):
        assert f"process {rank}: saved and reloaded tied ({WORLD} processes)" in run.output
    assert renames(audit, tmp_path / "out") == {"collective.safetensors": [0], "main.safetensors": [0]}


ACCELERATE_FSDP2 = """
import sys
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch import nn
from models import gpt2
import tiekit
from tiekit.integrations.accelerate import prepare_tied

# accelerate 1.15 runs FSDP on GPUs only (its state never turns MULTI_CPU into FSDP): setting the
# type by hand, on both states, is the only way to run its real FSDP2 code (_prepare_fsdp2,
# fsdp2_prepare_model, torch's fully_shard) on the CPU. Nothing of accelerate or tiekit is mocked.
acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
PartialState().distributed_type = DistributedType.FSDP
acc.state.distributed_type = DistributedType.FSDP
rank = acc.process_index


def use(**settings):
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **settings)


def broken_gpt2():  # its declared tie broken into equal copies, as a plain .to(xla) leaves it
    model = gpt2()
    model.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach().clone())
    return model


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(96, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 96, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.embed(ids))))


class TiedByHand(TiedLM):
    def tie_weights(self):  # a tie_weights() that does not restore this tie
        pass


def with_adamw(model):
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def refused(model, match):
    try:
        prepare_tied(acc, *with_adamw(model))
    except tiekit.TieError as exc:
        assert match in str(exc), str(exc)
        return str(exc)
    raise AssertionError("not refused")


use()
plain, _ = acc.prepare(*with_adamw(broken_gpt2()))
assert plain.lm_head.weight is not plain.transformer.wte.weight  # the control: two tensors, trained apart
model, optimizer = prepare_tied(acc, *with_adamw(broken_gpt2()))
assert type(model).__name__ == "FSDPGPT2LMHeadModel" and model.lm_head.weight is model.transformer.wte.weight
assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters())) == 28
ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(rank))
acc.backward(model(input_ids=ids, labels=ids).loss)
optimizer.step()
assert model.lm_head.weight is model.transformer.wte.weight
print(f"process {rank}: declared tie made again under FSDP2", flush=True)

inner = acc.unwrap_model(model)  # saved sharded, loaded into a plain model built untied
tiekit.save_sharded(inner, sys.argv[1], optimizer=optimizer)
loaded = broken_gpt2()
tiekit.load_sharded(loaded, sys.argv[1])
assert loaded.lm_head.weight is loaded.transformer.wte.weight
assert torch.equal(loaded.transformer.wte.weight, inner.transformer.wte.weight.full_tensor())
print(f"process {rank}: saved sharded and loaded tied", flush=True)

use(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=100)
plain, _ = acc.prepare(*with_adamw(TiedLM()))
assert plain.head.weight is not plain.embed.weight  # the control: split into two units
model = TiedLM()
message = refused(model, "min_num_params=100) would put the tied embed.weight (unit 'embed'), head.weight (unit")
assert type(model) is TiedLM and model.head.weight is model.embed.weight, "changed before the refusal"

use(cpu_ram_efficient_loading=True)
plain, _ = acc.prepare(*with_adamw(TiedLM()))
assert plain.head.weight is not plain.embed.weight  # the control: broken by the move to meta
model = TiedLM()
refused(model, "cpu_ram_efficient_loading=True, which moves the model to the meta device")
assert type(model) is TiedLM and model.head.weight is model.embed.weight, "changed before the refusal"
refused(TiedByHand(), "cpu_ram_efficient_loading=False for a model whose tie_weights() does not restore")
print(f"process {rank}: accelerate's settings refused", flush=True)
# FSDP2's meshes stay alive in torch's DTensor caches: cleared, gloo's threads cannot abort the exit.
acc.wait_for_everyone()
tiekit.clear_dtensor_caches()
acc.end_training()
"""


# accelerate's and torch's FSDP2 code on CPU processes: the same on both stacks, run once.
@pytest.mark.newest_torch_only
def test_prepare_tied_under_accelerates_fsdp2(tmp_path: Path) -> None:
    """prepare_tied moved the model only for strategies that do not place it themselves: under
    FSDP2 a declared tie broken into equal copies (a plain .to) stayed broken, and the TieError
    came after accelerate had wrapped the model. accelerate's size-based wrap and
    cpu_ram_efficient_loading (model without tie_weights) split or broke a tie, refused only after
    prepare had changed the model, with advice (fully_shard, tiekit.shard) no accelerate user can
    follow (probe)."""
    script = tmp_path / "fsdp2.py"
    script.write_text(ACCELERATE_FSDP2)
    env = base_env(PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}")
    [run] = run_ok([accelerate_launch(script, str(tmp_path / "ckpt"))], env=env, cwd=tmp_path, timeout=120)
    for rank in range(WORLD):
        assert f"process {rank}: declared tie made again under FSDP2" in run.output
        assert f"process {rank}: saved sharded and loaded tied" in run.output
        assert f"process {rank}: accelerate's settings refused" in run.output


@pytest.mark.xla
def test_torch_xla_launch_on_two_xla_cpu_devices(tmp_path: Path) -> None:
    audit = tmp_path / "audit"
    command = [str(BIN / "python"), str(EXAMPLES / "launch_xla.py"), "out"]
    env = base_env(**audit_env(audit), PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(WORLD))
    [run] = run_ok([command], env=env, cwd=tmp_path)
    for rank in range(WORLD):
        assert f"replica {rank} of {WORLD}: saved and reloaded tied" in run.output
    written = renames(audit, tmp_path / "out")
    # Replicas are threads of one process here: the audit hook asked tiekit which one renamed.
    assert written == {
        "writer.safetensors": [0],
        "shared.safetensors": [0],
        **{f"replica{r}.safetensors": [r] for r in range(WORLD)},
    }


def test_fit_spawns_ddp_processes_and_checkpoints_from_the_master(tmp_path: Path) -> None:
    audit = tmp_path / "audit"
    command = [str(BIN / "python"), str(EXAMPLES / "launch_fit.py"), "out"]
    [run] = run_ok([command], env=base_env(**audit_env(audit)), cwd=tmp_path)
    assert "ddp on 2: ['step-00000002.safetensors', 'step-00000004.safetensors']" in run.output
    assert renames(audit, tmp_path / "out") == {"step-00000002.safetensors": [0], "step-00000004.safetensors": [0]}


def test_fit_under_torchrun_uses_its_processes(tmp_path: Path) -> None:
    audit = tmp_path / "audit"
    command = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={WORLD}", str(EXAMPLES / "launch_fit.py")]
    [run] = run_ok([[*command, "out"]], env=base_env(**audit_env(audit)), cwd=tmp_path)
    assert run.output.count("ddp on 2: ['step-00000002.safetensors', 'step-00000004.safetensors']") == WORLD
    assert renames(audit, tmp_path / "out") == {"step-00000002.safetensors": [0], "step-00000004.safetensors": [0]}


def without_local_rank(commands: list[list[str]]) -> list[list[str]]:
    """`plain_processes` as a launcher that sets RANK and WORLD_SIZE only (docs/launching.md's
    "no launcher" form)."""
    return [[part for part in command if not part.startswith("LOCAL_RANK=")] for command in commands]


def test_fit_joins_processes_started_without_local_rank(tmp_path: Path) -> None:
    """Without LOCAL_RANK, fit took each process for a run of its own: with devices=2 each spawned
    two replicas more, and the second run in the folder was refused by the first's lock."""
    audit = tmp_path / "audit"
    commands = without_local_rank(plain_processes([str(EXAMPLES / "launch_fit.py"), "out"], free_port()))
    assert not any("LOCAL_RANK" in " ".join(c) for c in commands)
    runs = run_ok(commands, env=base_env(**audit_env(audit)), cwd=tmp_path)
    for run in runs:
        assert "ddp on 2: ['step-00000002.safetensors', 'step-00000004.safetensors']" in run.output, run.output
    assert renames(audit, tmp_path / "out") == {"step-00000002.safetensors": [0], "step-00000004.safetensors": [0]}


@pytest.mark.newest_torch_only  # fit's own reading of the environment, the same on both stacks
@pytest.mark.timeout(120)  # a rank outside the world waited in the rendezvous
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"RANK": "0", "WORLD_SIZE": "1"}, "single"),  # no launcher set these: not a launched run
        ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "rank must be"),
        ({"RANK": "-1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "rank must be"),
        ({"RANK": "0", "WORLD_SIZE": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "rank must be"),
    ],
)
def test_fit_reads_a_launchers_variables_only_when_a_launcher_set_them(
    env: dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RANK and WORLD_SIZE alone (a world of 1, left in a shell) made fit join a group at
    env://, which failed with torch's raw "MASTER_ADDR expected"; a rank outside the world hung
    in the rendezvous."""
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 4))
    kw = {"loss_fn": F.mse_loss, "max_steps": 1, "batch_size": 4, "progress": False}
    if expected == "single":
        assert tiekit.fit(torch.nn.Linear(4, 4), data, **kw).strategy == "single"
    else:
        with pytest.raises(tiekit.TiekitError, match=f"in the environment: the {expected}"):
            tiekit.fit(torch.nn.Linear(4, 4), data, strategy="ddp", **kw)


FIT_BY_HAND = """
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import tiekit

sys.path.insert(0, sys.argv[1])
from models import WeightSharingModule

data = TensorDataset(torch.randn(64, 32, generator=torch.Generator().manual_seed(0)), torch.randn(64, 10))
if len(sys.argv) > 2:
    print("imported", flush=True)
    sys.stdin.readline()  # joins when the test says so
result = tiekit.fit(WeightSharingModule, data, loss_fn=F.mse_loss, strategy="ddp", batch_size=4, max_steps=2,
                    progress=False)
print(f"trained: world {result.world_size}, identical {result.replicas_identical}", flush=True)
"""


def by_hand(rank: int, port: int, **extra: str) -> dict[str, str]:
    """The environment of a process started by hand as rank ``rank`` of 2 (docs/launching.md's
    "no launcher" form), or of one whose shell kept these variables from another run."""
    env = {k: v for k, v in base_env().items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)
    return env


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("rank", "absent"), [(0, "rank 1"), (1, "rank 0 (nothing listens there yet)")])
def test_a_process_started_alone_as_one_of_two_fails_saying_what_it_waits_for(
    rank: int, absent: str, tmp_path: Path
) -> None:
    """RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT left in a shell by another run, no launcher:
    fit waited in torch's env:// rendezvous for a process that never comes, 30 minutes, silently."""
    (tmp_path / "fit.py").write_text(FIT_BY_HAND)
    command = [str(BIN / "python"), str(tmp_path / "fit.py"), str(Path(__file__).parent)]
    env = by_hand(rank, free_port(), TIEKIT_JOIN_TIMEOUT="4")
    (run,) = run_together([command], env=env, cwd=tmp_path, timeout=60)
    assert run.returncode != 0, run.output
    where = f"at 127.0.0.1:{env['MASTER_PORT']} for {absent} to join"
    said = re.search(rf"tiekit: rank {rank} of 2 has waited \d+ s {re.escape(where)}. (.*)", run.output)
    assert said, run.output  # on stderr, while it waited (after 2 s: half the bound)
    gave_up = re.search(
        rf"TiekitError: rank {rank} of 2 gave up after waiting \d+ s {re.escape(where)}. (.*)", run.output
    )
    assert gave_up, run.output
    for rest in (said[1], gave_up[1]):
        assert f"RANK={rank}, WORLD_SIZE=2, MASTER_ADDR=127.0.0.1, MASTER_PORT={env['MASTER_PORT']} came from " in rest
        assert "leftovers from another run: unset them" in rest and "(TIEKIT_JOIN_TIMEOUT in the environment" in rest


@pytest.mark.timeout(120)
def test_a_rank_whose_master_port_another_program_holds_gives_up_at_its_bound(tmp_path: Path) -> None:
    """A MASTER_PORT left from another run where a program that is no store listens (it accepts,
    never answers): torch's store client waited for its handshake for good, past the bound,
    saying nothing (adversarial probe)."""
    (tmp_path / "fit.py").write_text(FIT_BY_HAND)
    command = [str(BIN / "python"), str(tmp_path / "fit.py"), str(Path(__file__).parent)]
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        accepted: list[socket.socket] = []
        stop = threading.Event()

        def accept() -> None:
            listener.settimeout(0.2)
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    accepted.append(listener.accept()[0])

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        try:
            env = by_hand(1, listener.getsockname()[1], TIEKIT_JOIN_TIMEOUT="4")
            (run,) = run_together([command], env=env, cwd=tmp_path, timeout=60)
        finally:
            stop.set()
            thread.join()
            for conn in accepted:
                conn.close()
    assert run.returncode != 0, run.output
    expected = "TiekitError: rank 1 of 2 gave up after waiting 4 s at 127.0.0.1:"
    assert expected in run.output and "does not answer as one" in run.output, run.output


@pytest.mark.timeout(120)
def test_a_join_timeout_that_is_not_seconds_is_refused(tmp_path: Path) -> None:
    """In a process of its own: before, the setting did not exist and the join waited 30 minutes."""
    (tmp_path / "fit.py").write_text(FIT_BY_HAND)
    command = [str(BIN / "python"), str(tmp_path / "fit.py"), str(Path(__file__).parent)]
    (run,) = run_together([command], env=by_hand(0, free_port(), TIEKIT_JOIN_TIMEOUT="-1"), cwd=tmp_path, timeout=60)
    assert run.returncode != 0, run.output
    expected = "TiekitError: TIEKIT_JOIN_TIMEOUT='-1' in the environment must be a positive number of seconds"
    assert expected in run.output, run.output
    assert "has waited" not in run.output


@pytest.mark.timeout(120)
def test_processes_started_by_hand_one_after_the_other_join(tmp_path: Path) -> None:
    """The docs' form without a launcher, rank 1 started first: it says it waits for rank 0 and
    trains with it once rank 0 starts, before its bound (12 s; it says so after 6)."""
    (tmp_path / "fit.py").write_text(FIT_BY_HAND)
    command = [str(BIN / "python"), str(tmp_path / "fit.py"), str(Path(__file__).parent)]
    port = free_port()
    log0, log1 = tmp_path / "rank0.log", tmp_path / "rank1.log"
    with open(log0, "wb") as out0, open(log1, "wb") as out1:
        rank1 = subprocess.Popen(command, env=by_hand(1, port, TIEKIT_JOIN_TIMEOUT="12"), stdout=out1, stderr=out1)
        rank0 = subprocess.Popen(
            [*command, "wait"], env=by_hand(0, port), stdin=subprocess.PIPE, stdout=out0, stderr=out0
        )
    try:
        deadline = time.monotonic() + 60
        while not ("has waited" in log1.read_text() and "imported" in log0.read_text()):
            assert rank1.poll() is None and rank0.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert rank0.stdin is not None
        rank0.stdin.write(b"go\n")  # rank 1 is still waiting: rank 0 joins now
        rank0.stdin.close()
        codes = [rank0.wait(timeout=90), rank1.wait(timeout=90)]
    finally:
        rank0.kill()
        rank1.kill()
    outputs = [log0.read_text(), log1.read_text()]
    assert codes == [0, 0], outputs
    said = f"s at 127.0.0.1:{port} for rank 0 (nothing listens there yet) to join"
    assert re.search(rf"tiekit: rank 1 of 2 has waited \d+ {re.escape(said)}", outputs[1]), outputs
    for output in outputs:
        assert "trained: world 2, identical True" in output, outputs
    assert "has waited" not in outputs[0]  # rank 1 was there when rank 0 came


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (  # left in a shell by another run: torch's raw "environment variable MASTER_ADDR expected"
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"},
            "RANK=1, WORLD_SIZE=2, LOCAL_RANK=1 in the environment, without MASTER_ADDR or MASTER_PORT: ",
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
            "RANK=1, WORLD_SIZE=2, MASTER_ADDR=127.0.0.1 in the environment, without MASTER_PORT: ",
        ),
        (  # torch's raw int() error
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "twenty"},
            "MASTER_PORT='twenty' in the environment must be a port number",
        ),
        (  # torch's raw "address already in use"
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "BUSY"},
            "rank 0 of 2 cannot listen on MASTER_PORT=",
        ),
        (  # "this run has 1 processes"
            {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"},
            'devices=2, but this run has 1 process, started by torchrun or your script: pass devices="auto" or 1',
        ),
    ],
)
def test_fit_refuses_a_launch_environment_it_cannot_join(
    env: dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        ports = {"PORT": str(free_port()), "BUSY": str(busy.getsockname()[1])}
        for name, value in env.items():
            monkeypatch.setenv(name, ports.get(value, value))
        data = TensorDataset(torch.randn(16, 4), torch.randn(16, 4))
        with pytest.raises(tiekit.TiekitError) as caught:
            tiekit.fit(torch.nn.Linear(4, 4), data, loss_fn=F.mse_loss, strategy="ddp", devices=2, max_steps=1)
    assert expected in str(caught.value)


OWN_GROUP = """
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import tiekit

sys.path.insert(0, sys.argv[3])
from models import WeightSharingModule

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=int(sys.argv[1]), world_size=2)
data = TensorDataset(torch.randn(64, 32, generator=torch.Generator().manual_seed(0)), torch.randn(64, 10))
kw = {"batch_size": 4, "max_steps": 3, "progress": False}
result = tiekit.fit(WeightSharingModule, data, loss_fn=F.mse_loss, strategy="ddp", **kw)
print(f"rank {dist.get_rank()}: world {result.world_size}, identical {result.replicas_identical}", flush=True)
try:
    tiekit.fit(WeightSharingModule, data, loss_fn=F.mse_loss, strategy="ddp", devices=4, **kw)
except tiekit.TiekitError as error:
    print(f"rank {dist.get_rank()}: {error}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_fit_trains_in_the_group_a_script_made_itself(tmp_path: Path) -> None:
    """Processes that made their group with init_process_group (as mp.spawn scripts do), without
    torchrun's variables: each trained alone on the whole dataset, world size 1, silently."""
    (tmp_path / "own_group.py").write_text(OWN_GROUP)
    port, tests = free_port(), str(Path(__file__).parent)
    commands = [[str(BIN / "python"), str(tmp_path / "own_group.py"), str(rank), str(port), tests] for rank in range(2)]
    env = {k: v for k, v in base_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    output = "\n".join(r.output for r in run_ok(commands, env=env, cwd=tmp_path))
    assert "rank 0: world 2, identical True" in output and "rank 1: world 2, identical True" in output, output
    for rank in range(2):  # devices=4 in a group of 2 was ignored: it trained on 2
        assert f"rank {rank}: devices=4, but this run has 2 processes, started by torchrun or your script" in output


MISSING_RANK = """
import sys, time
from pathlib import Path

import torch.distributed as dist
from torch import nn

import tiekit

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    try:
        tiekit.collective_save_model(nn.Linear(2, 2), Path(sys.argv[1]) / "model.safetensors", timeout=3)
    except tiekit.TiekitError as error:
        print(f"rank 0 gave up: {error}", flush=True)
else:
    time.sleep(6)  # never calls the collective (rank 0 gives up after 3 s)
"""


@pytest.mark.newest_torch_only
def test_a_rank_that_never_calls_the_collective_is_an_error_after_its_timeout(tmp_path: Path) -> None:
    (tmp_path / "missing.py").write_text(MISSING_RANK)
    runs = run_together(
        plain_processes([str(tmp_path / "missing.py"), str(tmp_path)], free_port()), env=base_env(), cwd=tmp_path
    )
    output = "\n".join(r.output for r in runs)
    assert "rank 0 gave up: rank 0: a collective failed after " in output, output
    assert "or not every rank arrived within 3 s" in output, output
    assert "Rank 1 failed to pass monitoredBarrier" in output, output
    assert not (tmp_path / "model.safetensors").exists()


ONE_RANK_WRONG = """
import os
import sys
from pathlib import Path

import torch.distributed as dist
from torch import nn

import tiekit

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
model = nn.Linear(2, 2)


def tell(label, call):
    try:
        call()
        print(f"rank {rank}: {label}: returned", flush=True)
    except Exception as error:
        print(f"rank {rank}: {label}: {type(error).__name__}: {error}", flush=True)


# The timeouts are longer than the test's deadline: a rank left waiting fails the test.
wait = 600
tell("background on rank 1", lambda: tiekit.collective_save_checkpoint(
    out / "a.safetensors", model=model, blocking=rank == 0, timeout=wait))
tell("keyword on rank 1", lambda: tiekit.collective_save_checkpoint(
    out / "b.safetensors", model=model, timeout=wait, **({"stpe": 3} if rank else {"step": 3})))
tell("model keyword on rank 1", lambda: tiekit.collective_save_model(
    model, out / "c.safetensors", timeout=wait, **({"durabel": False} if rank else {})))
tell("save_sharded blocking on rank 0", lambda: tiekit.save_sharded(model, out / "d", blocking=rank == 0))
extra = {"a": 1, "b": 2} if rank else {"a": 1}
tell("save_sharded extra keys", lambda: tiekit.save_sharded(model, out / "e", extra=extra))
only_0 = {"a": 1} if rank == 0 else None
tell("save_sharded extra on rank 0 only", lambda: tiekit.save_sharded(model, out / "h", extra=only_0))
tell("model on the writer only", lambda: tiekit.collective_save_checkpoint(
    out / "i.safetensors", timeout=wait, **({"model": model, "step": 2} if rank == 0 else {})))
tiekit.save_sharded(model, out / "f")
if rank == 0:
    tell("saving while rank 1 loads", lambda: tiekit.save_sharded(model, out / "f"))
else:
    tell("saving while rank 1 loads", lambda: tiekit.load_sharded(nn.Linear(2, 2), out / "f"))
tell("after", lambda: tiekit.collective_save_model(model, out / "g.safetensors", timeout=wait))
dist.barrier()
dist.destroy_process_group()
"""


def test_one_rank_with_wrong_arguments_fails_every_rank_without_waiting(tmp_path: Path) -> None:
    """Each case used to leave the other rank waiting for the timeout (or hang, for save_sharded's
    blocking) or pass silently (a keyword only rank 1 misspelled, an extra key only rank 1 had);
    the collectives' timeouts (600 s) are far beyond the harness's deadline."""
    (tmp_path / "wrong.py").write_text(ONE_RANK_WRONG)
    out = tmp_path / "out"
    out.mkdir()
    runs = run_ok(plain_processes([str(tmp_path / "wrong.py"), str(out)], free_port()), env=base_env(), cwd=tmp_path)
    output = "\n".join(r.output for r in runs)
    for rank in range(WORLD):
        lines = runs[rank].output  # plain_processes: in rank order
        assert (
            f"rank {rank}: background on rank 1: TiekitError: collective_save_checkpoint failed on 1 of 2 rank(s): "
            "rank 1: TiekitError: collective_save_checkpoint writes before it returns"
        ) in lines, output
        assert (
            f"rank {rank}: keyword on rank 1: TiekitError: collective_save_checkpoint failed on 1 of 2 rank(s): "
            "rank 1: TypeError: save_checkpoint() got an unexpected keyword argument 'stpe'. Nothing was written"
        ) in lines, output
        assert "rank 1: TypeError: save_model() got an unexpected keyword argument 'durabel'" in lines, output
        assert (
            f"rank {rank}: save_sharded blocking on rank 0: CheckpointError: {out / 'd'}: save_sharded needs the "
            "same blocking on every rank (rank 0: True; rank 1: False)"
        ) in lines, output
        assert (
            f"rank {rank}: save_sharded extra keys: CheckpointError: {out / 'e'}: save_sharded was given extra keys "
            "that rank 0's extra lacks (rank 1: ['b']; rank 0: ['a']); only rank 0's extra is stored"
        ) in lines, output
        # Not refused: what rank 0 alone passes is stored; a rank that writes nothing needs no model.
        assert f"rank {rank}: save_sharded extra on rank 0 only: returned" in lines, output
        assert f"rank {rank}: model on the writer only: returned" in lines, output
        assert (
            f"rank {rank}: saving while rank 1 loads: TiekitError: rank {rank}: the ranks are in different tiekit "
            "collectives (rank 0: save_sharded; rank 1: load_sharded)"
        ) in lines, output
        assert f"rank {rank}: after: returned" in lines, output
    # Nothing was written by the refused calls; the last collective save was.
    assert sorted(p.name for p in out.iterdir()) == ["f", "g.safetensors", "h", "i.safetensors"]
    assert tiekit.load_sharded(torch.nn.Linear(2, 2), out / "h").extra == {"a": 1}


NODE_LOCAL = """
import sys
from pathlib import Path

import torch.distributed as dist
from torch import nn

import tiekit

shared, own = Path(sys.argv[1]), Path(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
model = nn.Linear(2, 2)
calls = {
    "model": lambda: tiekit.collective_save_model(model, shared / "m.safetensors", timeout=600),
    "checkpoint": lambda: tiekit.collective_save_checkpoint(shared / "c.safetensors", model=model, timeout=600),
    "per-rank": lambda: tiekit.collective_save_model(model, shared / f"r{rank}.safetensors", timeout=600),
    "truly shared": lambda: tiekit.collective_save_model(model, own / "s.safetensors", timeout=600),
    # A file path saved as shards holds no file at the path: its index and shards are beside it.
    "shards": lambda: tiekit.collective_save_model(model, own / "h.safetensors", max_shard_size=16, timeout=600),
    "local shards": lambda: tiekit.collective_save_model(model, shared / "h.safetensors", max_shard_size=16),
}
for label, call in calls.items():
    try:
        call()
        print(f"rank {rank}: {label}: returned", flush=True)
    except Exception as error:
        print(f"rank {rank}: {label}: {type(error).__name__}: {error}", flush=True)
dist.destroy_process_group()
"""


def test_a_shared_path_on_node_local_disks_fails_every_rank(tmp_path: Path) -> None:
    """One path string, a different folder on each rank, as on two nodes' own disks: ``local``
    links to ``/proc/self/cwd`` and each rank runs in its own folder. Rank 1 used to return as
    if saved, with no file at its path (its next load: "no such checkpoint file")."""
    (tmp_path / "node_local.py").write_text(NODE_LOCAL)
    disks = [tmp_path / f"disk{rank}" for rank in range(WORLD)]
    for disk in disks:
        disk.mkdir()
    (tmp_path / "local").symlink_to("/proc/self/cwd")
    # Node 1 holds an earlier run's file at the checkpoint path: seen, but not the file rank 0 wrote.
    (disks[1] / "c.safetensors").write_bytes(b"an earlier run's checkpoint")
    shared, own = tmp_path / "local", tmp_path
    commands = [
        ["env", "-C", str(disk), *command]
        for disk, command in zip(
            disks, plain_processes([str(tmp_path / "node_local.py"), str(shared), str(own)], free_port()), strict=True
        )
    ]
    runs = run_ok(commands, env=base_env(), cwd=tmp_path)
    output = "\n".join(r.output for r in runs)
    for rank in range(WORLD):
        lines = runs[rank].output
        assert (
            f"rank {rank}: model: CheckpointError: collective_save_model: 1 of 2 rank(s) do not see the file another "
            f"rank wrote for them: rank 1 cannot open {shared / 'm.safetensors'} (No such file or directory) "
            "(written by rank 0)"
        ) in lines, output
        assert "node-local disks?" in lines and "if tiekit.is_writer()" in lines, output
        assert (
            f"rank {rank}: checkpoint: CheckpointError: collective_save_checkpoint: 1 of 2 rank(s) do not see the "
            f"file another rank wrote for them: rank 1 sees another file at {shared / 'c.safetensors'} (27 bytes"
        ) in lines, output
        # Unchanged: per-rank paths, and one path that is the same file on every rank.
        assert f"rank {rank}: per-rank: returned" in lines, output
        assert f"rank {rank}: truly shared: returned" in lines, output
        assert f"rank {rank}: shards: returned" in lines, output  # failed: "No such file ... h.safetensors"
        assert f"rank 1 cannot open {shared / 'h.safetensors'} (No such file or directory)" in lines, output
    # What rank 0 wrote is kept, a good file on its disk; rank 1's earlier file is untouched.
    assert tiekit.load_model(torch.nn.Linear(2, 2), disks[0] / "m.safetensors") is not None
    assert (disks[0] / "c.safetensors").is_file() and not (disks[1] / "m.safetensors").exists()
    assert (disks[1] / "c.safetensors").read_bytes() == b"an earlier run's checkpoint"
    assert sorted(p.name for p in disks[1].glob("r*.safetensors")) == ["r1.safetensors"]
