"""`tiekit.move(model, dtype)` of an FSDP2 model, in 2 gloo processes on 127.0.0.1: before the
first forward it casts and trains; after it, FSDP2 has fixed each parameter's dtype (its
all-gather buffers keep it) and a cast breaks the next forward deep in torch, so the move refuses
by name and leaves the model as it was; `preserve_ties` around your own cast says what it broke
and how to undo it."""

from __future__ import annotations

import json
import sys
from typing import Any

from launching import base_env, free_port, run_ok

SCRIPT = """
import json, sys, torch, torch.distributed as dist
from torch import nn
import tiekit

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)


class MixinSequential(tiekit.TPUMixin, nn.Sequential):
    pass


def tied(kind=nn.Sequential):
    torch.manual_seed(0)
    model = kind(nn.Embedding(101, 16), nn.Linear(16, 16), nn.Linear(16, 101, bias=False))
    model[2].weight = model[0].weight
    return tiekit.shard(model)


def step(model, optimizer):
    model(torch.randint(0, 101, (4, 8), generator=torch.Generator().manual_seed(1))).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


told = {}
model = tied()
optimizer = torch.optim.AdamW(model.parameters())
tiekit.move(model, torch.float64, optimizer=optimizer)  # before the first forward: a cast
step(model, optimizer)
told["cast first"] = [str(model[0].weight.dtype), model[2].weight is model[0].weight]

model = tied()
optimizer = torch.optim.AdamW(model.parameters())
step(model, optimizer)
try:
    tiekit.move(model, torch.float64, optimizer=optimizer)
    told["after a forward"] = "moved"
except tiekit.TieError as exc:
    told["after a forward"] = str(exc)
told["untouched"] = [str(p.dtype) for p in model.parameters()] == ["torch.float32"] * 3
try:
    step(model, optimizer)  # the cast's failure, had it happened: torch's "Expected out tensor to have dtype"
    told["trains on"] = model[2].weight is model[0].weight
except RuntimeError as exc:
    told["trains on"] = str(exc)
try:  # your own cast inside preserve_ties: it happened, so the error says how to undo it
    with tiekit.preserve_ties(model):
        model.to(torch.float64)
    told["preserve_ties"] = "re-tied"
except tiekit.TieError as exc:
    told["preserve_ties"] = str(exc)

model = tied(MixinSequential)  # TPUMixin's own conversions: .to(dtype) after the first forward
optimizer = torch.optim.AdamW(model.parameters())
step(model, optimizer)
try:
    model.to(torch.float64)
    told["mixin after a forward"] = "cast"
except tiekit.TieError as exc:
    told["mixin after a forward"] = str(exc)
told["mixin untouched"] = [str(p.dtype) for p in model.parameters()] == ["torch.float32"] * 3
step(model, optimizer)
told["mixin trains on"] = model[2].weight is model[0].weight
model.to(torch.float32)  # a conversion that keeps the dtype goes through
told["mixin same dtype"] = model[2].weight is model[0].weight
del model, optimizer
tiekit.clear_dtensor_caches()
dist.destroy_process_group()
print(json.dumps(told))
"""


def test_move_casts_an_fsdp2_model_before_its_first_forward_and_refuses_after(tmp_path: Any) -> None:
    port = str(free_port())
    commands = [[sys.executable, "-c", SCRIPT, str(rank), port] for rank in range(2)]
    for run in run_ok(commands, env=base_env(), cwd=tmp_path):
        told = json.loads(run.output.strip().splitlines()[-1])
        assert told["cast first"] == ["torch.float64", True], told
        assert "'0.weight' is sharded by FSDP2" in told["after a forward"], told
        assert "fixed its dtype (torch.float32) at its first forward" in told["after a forward"], told
        assert told["untouched"] is True and told["trains on"] is True, told
        assert "FSDPSequential was cast to torch.float64: '0.weight' is sharded by FSDP2" in told["preserve_ties"]
        assert "Cast it back to torch.float32 before the next forward" in told["preserve_ties"], told
        assert "cannot cast FSDPMixinSequential to torch.float64" in told["mixin after a forward"], told
        assert told["mixin untouched"] is True and told["mixin trains on"] is True, told
        assert told["mixin same dtype"] is True, told
