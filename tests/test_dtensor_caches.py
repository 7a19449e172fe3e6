"""`tiekit.clear_dtensor_caches`: on torch 2.14, DTensor's caches keep an FSDP2 run's device mesh,
and through it its gloo group, alive after ``destroy_process_group()`` until interpreter exit,
where the group's threads can abort the process (a 2-rank test script aborted that way in CI)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from launching import base_env, free_port, run_ok

pytest.importorskip("torch.distributed.fsdp")

TORCH = tuple(int(part) for part in torch.__version__.split(".")[:2])

RUN = """
import gc, json, sys, weakref
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
import tiekit

out, port, clear = sys.argv[1], sys.argv[2], sys.argv[3] == "clear"
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16, bias=False))
model[2].weight = model[0].weight
model = tiekit.shard(model)
loss = model(torch.tensor([[1, 2]])).sum()  # DTensor ops: sharding propagation, redistribution
loss.backward()
if clear:  # mid-run too: later DTensor work refills the caches and computes the same
    tiekit.clear_dtensor_caches()
    assert torch.equal(model(torch.tensor([[1, 2]])).sum(), loss), "another result after clearing"
tiekit.save_sharded(model, f"{out}/sharded")
dcp.save(model.state_dict(), checkpoint_id=f"{out}/plain")
groups = [weakref.ref(g) for g in dist.distributed_c10d._world.pg_map]
del model, loss  # loss keeps its graph, which holds the sharded parameters
if clear:
    tiekit.clear_dtensor_caches()
dist.destroy_process_group()
gc.collect()
print(json.dumps([len(groups), sum(g() is not None for g in groups)]))
"""


def groups_alive_after_destroy(tmp_path: Path, mode: str) -> list[int]:
    """[groups made, groups alive after destroy_process_group and a collection] in a fresh process."""
    out = tmp_path / mode
    out.mkdir()
    [run] = run_ok([[sys.executable, "-c", RUN, str(out), str(free_port()), mode]], env=base_env(), cwd=out)
    alive: list[int] = json.loads(run.output.strip().splitlines()[-1])
    return alive


def test_clearing_the_caches_frees_the_group_of_a_sharded_model(tmp_path: Path) -> None:
    # cleared once mid-run (the run checks its loss is unchanged) and once before destroying
    made, alive = groups_alive_after_destroy(tmp_path, "clear")
    assert made >= 1 and alive == 0


@pytest.mark.skipif(TORCH < (2, 14), reason="torch 2.9's caches keep no group (measured); the control is 2.14's")
def test_without_clearing_torch_2_14_keeps_the_group_alive(tmp_path: Path) -> None:
    made, alive = groups_alive_after_destroy(tmp_path, "keep")
    assert made >= 1 and alive == made


FIT_IN_YOUR_GROUP = """
import gc, json, sys, weakref
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
import tiekit

class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Linear(8, 8), nn.Linear(8, 8)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(torch.relu(self.embed(x)))

if __name__ == "__main__":
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 8))
    result = tiekit.fit(Tied, data, strategy="fsdp", loss_fn=F.mse_loss, batch_size=4, max_steps=2, progress=False)
    groups = [weakref.ref(g) for g in dist.distributed_c10d._world.pg_map]
    dist.destroy_process_group()  # the script's group: fit leaves it to the script
    gc.collect()
    print(json.dumps([result.strategy, len(groups), sum(g() is not None for g in groups)]))
"""


def test_fit_with_fsdp_in_your_own_group_leaves_nothing_holding_it(tmp_path: Path) -> None:
    """fit under torchrun in a group the script made shards its own copy and hands back a plain
    model; on torch 2.14 DTensor's caches kept the group past the script's destroy_process_group."""
    (tmp_path / "fit_in_your_group.py").write_text(FIT_IN_YOUR_GROUP)
    env = base_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    command = [sys.executable, "fit_in_your_group.py", str(free_port())]
    [run] = run_ok([command], env=env, cwd=tmp_path)
    strategy, made, alive = json.loads(run.output.strip().splitlines()[-1])
    assert strategy == "fsdp" and made >= 1 and alive == 0, run.output
