"""How the ``.metadata`` files beside this script were made: real DCP folders of every kind tiekit
reads, written by torch 2.9.1 (``.venv``) and 2.14.1 (``.venv-latest``); tests/test_dcp_metadata_pickle.py
reads their metadata with tiekit's restricted unpickler under either torch.

    python write_folders.py OUT                    # one process: save_sharded, convert, dcp.save
    python write_folders.py OUT fsdp RANK PORT     # RANK 0 and 1 at once: FSDP2 on 2 gloo ranks
    python write_folders.py OUT spmd               # torch 2.9.1 + torch_xla: an XLA SPMD save_sharded

Then copy ``OUT/<folder>[/save-<id>]/.metadata`` here under the names used (OUT/plain_id is
dcp_save_non_tensor_entries, plain_noflat dcp_save_unflattened, fsdp2_plain dcp_save_fsdp2_2_ranks,
fsdp2_tiekit save_sharded_fsdp2_2_ranks, fsdp2_tiekit_bg save_sharded_fsdp2_background, tk_single
save_sharded_replayed, tk_dtypes save_sharded_dtypes, tk_converted convert, spmd save_sharded_xla_spmd).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
import tiekit  # noqa: E402

warnings.filterwarnings("ignore")


def tied() -> nn.Module:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    return model


def fsdp(out: Path, rank: int, port: str) -> None:
    import shard_fsdp2
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = tiekit.shard(shard_fsdp2.TiedLM(33, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 33, (2, 5))).sum().backward()
    opt.step()
    extra = {"step": 3, "tag": "x", "l": [1, 2.5], "t": torch.ones(2)}
    tiekit.save_sharded(model, out / "fsdp2_tiekit", optimizer=opt, extra=extra)
    tiekit.save_sharded(model, out / "fsdp2_tiekit_bg", blocking=False).wait(120)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": 7}, checkpoint_id=out / "fsdp2_plain")
    dist.barrier()
    dist.destroy_process_group()


def spmd(out: Path) -> None:
    os.environ.setdefault("CPU_NUM_DEVICES", "4")
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    from tiekit.backends.xla_spmd import shard_parameters, spmd_mesh

    device, mesh, _, _ = spmd_mesh("fsdp")
    model = nn.Sequential(nn.Embedding(16, 8), nn.LayerNorm(8), nn.Linear(8, 16, bias=False))
    model[2].weight = model[0].weight
    tiekit.move(model, device)
    shard_parameters(model, mesh)
    tiekit.save_sharded(model, out / "spmd", extra={"step": 2})


def single(out: Path) -> None:
    torch.manual_seed(0)
    model = tied()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.tensor([1, 2])).sum().backward()
    opt.step()
    extra = {"step": 1, "name": "n", "cfg": {"a": [1, None, "s"]}, "t": torch.zeros(3, dtype=torch.int64)}
    tiekit.save_sharded(model, out / "tk_single", optimizer=opt, extra=extra)
    tiekit.save_sharded(model, out / "tk_single", optimizer=opt)  # the second save is replayed
    dtypes = [torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32, torch.bool]
    many = nn.Module()
    for i, dtype in enumerate([*dtypes, torch.complex64, torch.float8_e4m3fn]):
        many.register_buffer(f"b{i}", torch.zeros(2, dtype=dtype))
    tiekit.save_sharded(many, out / "tk_dtypes")
    tiekit.save_model(model, out / "m.safetensors")
    tiekit.convert(out / "m.safetensors", out / "tk_converted")
    state = {
        "model": model.state_dict(),
        "step": 5,
        "name": "abc",
        "lst": [1, 2, "x"],
        "d": {"k": 1.5, "n": None},
        "b": b"raw",
        "t": torch.arange(4),
        "sc": torch.tensor(2.0),
        "opt": opt.state_dict(),
        "nc": torch.arange(12.0).reshape(3, 4).t(),
    }
    dcp.save(state, checkpoint_id=out / "plain_id")
    dcp.save(state, checkpoint_id=out / "plain_noflat", planner=dcp.DefaultSavePlanner(flatten_state_dict=False))


if __name__ == "__main__":
    target = Path(sys.argv[1])
    if sys.argv[2:3] == ["fsdp"]:
        fsdp(target, int(sys.argv[3]), sys.argv[4])
    elif sys.argv[2:3] == ["spmd"]:
        spmd(target)
    else:
        single(target)
