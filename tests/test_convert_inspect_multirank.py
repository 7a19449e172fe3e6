"""``tiekit inspect --check-values`` of folders saved by 2 FSDP2 ranks, whose tensors are row chunks."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from launching import base_env, free_port, run_ok

from tiekit.cli import main

SAVE = textwrap.dedent(
    """
    import sys, warnings
    import torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    import tiekit

    warnings.simplefilter("ignore")
    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False), nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].weight = model[0].weight
    model = tiekit.shard(model)
    tiekit.save_sharded(model, f"{out}/sharded")
    dcp.save(model.state_dict(), checkpoint_id=f"{out}/plain")  # stores both names of the tie
    del model  # a live sharded model keeps the group, and so do torch 2.14's DTensor caches: its gloo
    tiekit.clear_dtensor_caches()  # threads then end in interpreter shutdown, which can abort the process
    dist.barrier()  # both done before either closes: gloo can abort a process whose peer left first
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def two_rank_saves(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("two-ranks")
    port = str(free_port())
    run_ok([[sys.executable, "-c", SAVE, str(rank), port, str(out)] for rank in range(2)], env=base_env(), cwd=out)
    return out


@pytest.mark.parametrize(("folder", "groups"), [("sharded", []), ("plain", [["0.weight", "1.weight"]])])
def test_check_values_reads_tensors_saved_in_row_chunks(
    two_rank_saves: Path, capsys: pytest.CaptureFixture[str], folder: str, groups: list[list[str]]
) -> None:
    code = main(["inspect", str(two_rank_saves / folder), "--check-values", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err  # 2.weight and 3.weight share a shape: both read, as row chunks, and compared
    assert json.loads(out)["identical"] == groups
