"""`tiekit.load_model` / `tiekit.load_checkpoint` (single files) into a model sharded with XLA SPMD
(`tiekit.move` + `shard_parameters`), on 2 XLA:CPU devices in a fresh process.

Every parameter keeps its sharding (the load once left each one ``{replicated}``: every device
holding the whole model, silently), the values are the file's, the tie is kept, and with an
optimizer the moments come back sharded as their parameter (once unannotated) and the next step
is the one the saving model takes. A load that replaces the parameters (``dtype="file"``, a
bfloat16 file) gives the new ones the old ones' shardings. Each load runs twice: with the
default staging, every tensor written whole; with staging buffers of 2 KiB, the embedding written
in pieces of rows and the other tensors through reused buffers.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_train_xla import run_script

pytestmark = pytest.mark.xla

JOB = """
import json, pathlib, tempfile, torch, torch_xla
import torch_xla.core.xla_model as xm
from torch import nn
import tiekit
from tiekit import devices
from tiekit.checkpoint import streaming
from tiekit.backends.xla_spmd import shard_parameters, spmd_mesh

device, mesh, _, _ = spmd_mesh("fsdp")

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(200, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 200, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.embed(ids)))).square().mean()

def spmd_model(seed):
    torch.manual_seed(seed)
    model = LM()
    tiekit.move(model, device)
    shard_parameters(model, mesh)
    return model

def step(model, optimizer):
    optimizer.zero_grad()
    model(torch.arange(8).to(device)).backward()
    optimizer.step()
    torch_xla.sync()

def spec(t):
    return torch_xla._XLAC._get_xla_sharding_spec(t)

def host(model):
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}

def shard_rows(t):
    xm.wait_device_ops()
    return [int(shard.shape[0]) for shard, _ in torch_xla._XLAC._get_local_shards([t])[0]]

root = pathlib.Path(tempfile.mkdtemp())
saving = spmd_model(0)
adamw = torch.optim.AdamW(saving.parameters(), lr=1e-2)
step(saving, adamw)
saved = host(saving)
saved_moments = {k: adamw.state[saving.embed.weight][k].cpu() for k in ("exp_avg", "exp_avg_sq")}
tiekit.save_model(saving, root / "m.safetensors")
tiekit.save_checkpoint(root / "c.safetensors", model=saving, optimizer=adamw, step=1)
half = LM()
half.load_state_dict(saved)
tiekit.save_model(half.to(torch.bfloat16), root / "h.safetensors")  # loaded with dtype="file": new tensors
saved_half = {k: v.to(torch.bfloat16) for k, v in saved.items()}
step(saving, adamw)  # the step the loaded models must take too
next_step = host(saving)

out = {}
for staging in ("default", "2 KiB"):
    if staging == "2 KiB":
        streaming.STAGING_BYTES = 2048  # the embedding (12800 bytes, 6400 in bfloat16) in pieces
        streaming._PIECES_COST = 0
    for how in ("load_model", "load_checkpoint", "load_model dtype=file"):
        model = spmd_model(1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        before = {n: spec(p) for n, p in model.named_parameters()}
        if how == "load_model":
            tiekit.load_model(model, root / "m.safetensors")
        elif how == "load_model dtype=file":
            tiekit.load_model(model, root / "h.safetensors", dtype="file")
        else:
            tiekit.load_checkpoint(root / "c.safetensors", model=model, optimizer=optimizer)
        torch_xla.sync()
        loaded = host(model)
        expected = saved_half if how.endswith("dtype=file") else saved
        result = dict(
            before=before,
            after={n: spec(p) for n, p in model.named_parameters()},
            embed_rows=shard_rows(model.embed.weight),
            values=sorted(loaded) == sorted(expected) and all(
                loaded[k].dtype == expected[k].dtype and torch.equal(loaded[k], expected[k]) for k in expected
            ),
            tied=model.head.weight is model.embed.weight,
            buffers=len(set(devices.xla_buffer_handles([model.embed.weight, model.head.weight]))),
        )
        if how == "load_checkpoint":
            moments = optimizer.state[model.embed.weight]
            result["moment_specs"] = {k: spec(moments[k]) for k in ("exp_avg", "exp_avg_sq")}
            result["moments"] = all(torch.equal(moments[k].cpu(), v) for k, v in saved_moments.items())
            step(model, optimizer)
            stepped = host(model)
            result["step_diff"] = max((stepped[k] - next_step[k]).abs().max().item() for k in next_step)
            result["specs_after_step"] = {n: spec(p) for n, p in model.named_parameters()}
        out[f"{how} {staging}"] = result
print(json.dumps(out))
"""

SHARDED = {"embed.weight": "{devices=[2,1]0,1}", "mid.weight": "{devices=[2,1]0,1}", "mid.bias": "{devices=[2]0,1}"}
LOADS = [
    f"{how} {staging}"
    for how in ("load_model", "load_checkpoint", "load_model dtype=file")
    for staging in ("default", "2 KiB")
]


@pytest.fixture(scope="module")
def out() -> dict[str, Any]:
    return run_script(JOB, devices=2)


@pytest.mark.parametrize("load", LOADS)
def test_a_load_keeps_each_parameters_spmd_sharding(out: dict[str, Any], load: str) -> None:
    found = out[load]
    assert found["before"] == SHARDED
    assert found["after"] == SHARDED, "the load left the parameters sharded otherwise (each device whole?)"
    assert found["embed_rows"] == [100, 100]  # each device holds its half of the tied embedding, not all 200 rows
    assert found["values"] and found["tied"] and found["buffers"] == 1


@pytest.mark.parametrize("staging", ["default", "2 KiB"])
def test_load_checkpoint_gives_the_optimizer_state_its_parameters_sharding(out: dict[str, Any], staging: str) -> None:
    found = out[f"load_checkpoint {staging}"]
    assert found["moments"]
    assert found["moment_specs"] == {"exp_avg": SHARDED["embed.weight"], "exp_avg_sq": SHARDED["embed.weight"]}
    assert found["specs_after_step"] == SHARDED
    assert found["step_diff"] == 0.0  # the step the saving model took after the save
