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
