"""Checkpoints and XLA (XLA:CPU here): loading into models whose ties a move broke, onto the
device from meta, saving with one batched transfer, and one writer among several replicas."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch
from models import gpt2

import tiekit
from tiekit import load_model, save_model

pytestmark = pytest.mark.xla

IDS = torch.tensor([[1, 5, 9, 2, 7, 3]])


@pytest.fixture
def saved(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(0)
    model = gpt2().eval()
    save_model(model, tmp_path / "m.safetensors")
    return model, tmp_path / "m.safetensors"


def logits_close(a: torch.nn.Module, b: torch.nn.Module, device: torch.device) -> bool:
    return torch.allclose(a(IDS).logits, b(IDS.to(device)).logits.cpu(), atol=1e-5)


def test_load_into_a_model_whose_ties_the_xla_move_broke(saved, xla_device) -> None:  # type: ignore[no-untyped-def]
    source, path = saved
    plain = gpt2().eval().to(xla_device)
    assert plain.lm_head.weight is not plain.transformer.wte.weight  # the move broke the tie
    with pytest.raises(RuntimeError):
        safetensors.torch.load_model(plain, path)

    model = gpt2().eval().to(xla_device)
    embedding = model.transformer.wte.weight
    assert len(list(model.parameters())) == tiekit.find_ties(source).unique_count + 1
    result = load_model(model, path)
    assert [g.names for g in result.retied] == [("transformer.wte.weight", "lm_head.weight")]
    assert model.lm_head.weight is model.transformer.wte.weight is embedding  # copied in place
    assert len(list(model.parameters())) == tiekit.find_ties(source).unique_count
    assert model.lm_head.weight.device == xla_device
    assert logits_close(source, model, xla_device)


def test_meta_model_materialises_straight_onto_xla(saved, xla_device) -> None:  # type: ignore[no-untyped-def]
    source, path = saved
    with torch.device("meta"):
        model = gpt2().eval()
    load_model(model, path, device="xla")
    assert all(t.device == xla_device for t in model.state_dict().values())
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(list(model.parameters())) == tiekit.find_ties(source).unique_count
    assert logits_close(source, model, xla_device)


def test_an_xla_device_index_this_process_lacks_is_a_checkpoint_error(saved) -> None:  # type: ignore[no-untyped-def]
    """torch_xla's IndexError came out of load_model (adversarial probe)."""
    import torch_xla.runtime as xr

    _, path = saved
    model = gpt2()
    absent = f"xla:{xr.addressable_device_count()}"
    with pytest.raises(tiekit.CheckpointError, match=rf"m\.safetensors: cannot load onto device '{absent}'"):
        load_model(model, path, device=absent)
    assert model.lm_head.weight is model.transformer.wte.weight and model.lm_head.weight.device.type == "cpu"


def test_cpu_model_loaded_onto_xla_moves_everything(saved, xla_device) -> None:  # type: ignore[no-untyped-def]
    source, path = saved
    model = gpt2().eval()
    load_model(model, path, device=xla_device)
    assert all(t.device == xla_device for t in model.state_dict().values())
    assert model.lm_head.weight is model.transformer.wte.weight
    assert logits_close(source, model, xla_device)


def test_saving_from_xla_moves_each_unique_tensor_once(tmp_path: Path, xla_device) -> None:  # type: ignore[no-untyped-def]
    import torch_xla
    import torch_xla.debug.metrics as met

    model = tiekit.move(gpt2(), "xla")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(IDS.to(xla_device), labels=IDS.to(xla_device)).loss.backward()
    optimizer.step()
    torch_xla.sync()
    unique = sum(p.numel() * p.element_size() for p in model.parameters())

    met.clear_all()
    save_model(model, tmp_path / "m.safetensors")
    assert met.metric_data("TransferFromDeviceTime")[0] == 1  # one batched transfer
    assert met.metric_data("InboundData")[1] == unique  # the unique bytes, never the tied copy

    met.clear_all()
    tiekit.save_checkpoint(tmp_path / "c.safetensors", model=model, optimizer=optimizer, step=1)
    assert met.metric_data("TransferFromDeviceTime")[0] == 1
    on_device = [v for s in optimizer.state.values() for v in s.values() if v.device.type == "xla"]
    state_bytes = sum(v.numel() * v.element_size() for v in on_device)  # Adam's step counters stay on CPU
    assert met.metric_data("InboundData")[1] == unique + state_bytes

    cpu = gpt2()
    cpu_optimizer = torch.optim.AdamW(cpu.parameters(), lr=1e-2)
    assert tiekit.load_checkpoint(tmp_path / "c.safetensors", model=cpu, optimizer=cpu_optimizer)["step"] == 1
    assert torch.equal(cpu.transformer.wte.weight, model.transformer.wte.weight.cpu())
    exp_avg = optimizer.state[model.transformer.wte.weight]["exp_avg"]
    assert torch.equal(cpu_optimizer.state[cpu.transformer.wte.weight]["exp_avg"], exp_avg.cpu())


REPLICAS = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import torch, torch_xla
    import torch_xla.runtime as xr
    from torch import nn
    import tiekit

    lock = threading.Lock()
    local_done = threading.Event()

    def record(kind, **fields):
        with lock:
            print("EVENT " + json.dumps({"kind": kind, "ordinal": xr.global_ordinal(), "t": time.time(), **fields}),
                  flush=True)

    def audit(event, args):
        if event == "os.rename" and str(args[1]).endswith(".safetensors"):
            record("rename", dst=str(args[1]))

    sys.addaudithook(audit)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 16)
            self.head = nn.Linear(16, 64, bias=False)
            self.head.weight = self.embed.weight
            with torch.no_grad():  # the same values in every replica, without the shared RNG
                self.embed.weight.copy_(torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16))

    def replica(index):
        shared, local = sys.argv[1], sys.argv[2]
        model = tiekit.move(Tied(), "xla")
        # A local save on replica 0 alone returns without the other replica, which waits for it.
        if xr.global_ordinal() == 0:
            tiekit.save_model(model, local)
            record("local_returned")
            local_done.set()
        else:
            record("local_seen", done=local_done.wait(60))
        # Every replica calls the collective save; the master comes late: the others must wait.
        if xr.global_ordinal() == 0:
            time.sleep(1.0)
        tiekit.collective_save_model(model, shared)
        record("returned", exists=os.path.exists(shared))
        check = Tied()
        tiekit.load_model(check, shared)
        assert check.head.weight is check.embed.weight
        record("loaded")
        # DCP needs a process per rank: launch threads are refused before anything is written.
        for kind, call in (("save_sharded", tiekit.save_sharded), ("load_sharded", tiekit.load_sharded)):
            try:
                call(check, shared + ".sharded")
                record(kind, error=None)
            except tiekit.CheckpointError as exc:
                record(kind, error=str(exc))

    if __name__ == "__main__":
        torch_xla.launch(replica)
    """
)


def test_only_the_master_replica_writes_and_the_others_wait(tmp_path: Path) -> None:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}
    shared, local = tmp_path / "model.safetensors", tmp_path / "local.safetensors"
    script = tmp_path / "replicas.py"  # launch's worker processes re-import the main module from a file
    script.write_text(REPLICAS)
    run = subprocess.run(
        [sys.executable, str(script), str(shared), str(local)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    events = [json.loads(line[6:]) for line in run.stdout.splitlines() if line.startswith("EVENT ")]
    # tiekit.save_model is local: replica 0 saved alone and returned; replica 1 saw it finish.
    assert [e["ordinal"] for e in events if e["kind"] == "local_returned"] == [0]
    assert [(e["ordinal"], e["done"]) for e in events if e["kind"] == "local_seen"] == [(1, True)]
    # tiekit.collective_save_model: one write, by ordinal 0; every replica returns once the file is there.
    renames = [e for e in events if e["kind"] == "rename" and e["dst"] == str(shared)]
    assert [e["ordinal"] for e in renames] == [0]
    returned = {e["ordinal"]: e for e in events if e["kind"] == "returned"}
    assert sorted(returned) == [0, 1]
    assert all(e["exists"] and e["t"] >= renames[0]["t"] for e in returned.values())
    assert sorted(e["ordinal"] for e in events if e["kind"] == "loaded") == [0, 1]
    for kind in ("save_sharded", "load_sharded"):
        refused = {e["ordinal"]: e["error"] for e in events if e["kind"] == kind}
        assert sorted(refused) == [0, 1]
        for error in refused.values():
            assert f"model.safetensors.sharded: {kind} runs torch.distributed.checkpoint, which needs one" in error
            assert "the 2 replicas here are threads of one process" in error
            # What to do instead: a load was told how to save (probe)
            instead = "collective_save_checkpoint" if kind == "save_sharded" else "load the folder in one replica"
            assert instead in error, error
    assert not (tmp_path / "model.safetensors.sharded").exists()


def test_a_save_of_pending_values_writes_what_the_model_then_holds(tmp_path: Path, xla_device) -> None:  # type: ignore[no-untyped-def]
    """After an optimizer step not yet run on the device, the save fetched its tensors in a graph
    of their own, which rounded some of them differently from the graph that later computed the
    model's: the file was off by the last bit (probe; torch_xla's own xm.save is exact)."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = gpt2(vocab_size=101).eval()
    tiekit.move(model, xla_device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(1, 90, (2, 8), device=xla_device)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # pending: nothing synced
    save_model(model, tmp_path / "m.safetensors")
    stored = load_file(tmp_path / "m.safetensors")
    held = {k: v.cpu() for k, v in model.state_dict().items()}
    assert [k for k in stored if not torch.equal(stored[k], held[k])] == []
