"""Loads into a model already on XLA:CPU take over the memory they read (issue 13,
`tiekit.checkpoint.adoption`): each tensor lets go of its device buffer, its new values are read
into memory of its own, and the device takes that memory over. No weight is transferred and
nothing is compiled, also for a tensor a 2-rank save stored as row chunks in two shard files.
Peak host memory of the same loads is measured in tests/test_xla_transfers.py."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from launching import base_env, free_port, run_ok
from torch import nn

import tiekit
from tiekit.checkpoint import streaming

pytestmark = pytest.mark.xla

SAVE = textwrap.dedent(
    """
    import sys, warnings
    import torch, torch.distributed as dist
    from torch import nn
    import tiekit

    warnings.simplefilter("ignore")
    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(600, 16), nn.Linear(16, 600, bias=False), nn.Linear(16, 16))
    model[1].weight = model[0].weight
    model = tiekit.shard(model)
    tiekit.save_sharded(model, out)
    del model
    tiekit.clear_dtensor_caches()
    dist.barrier()
    dist.destroy_process_group()
    """
)


def build(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(600, 16), nn.Linear(16, 600, bias=False), nn.Linear(16, 16))
    model[1].weight = model[0].weight
    return model


@pytest.fixture(scope="module")
def two_rank_save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `save_sharded` folder of 2 FSDP2 ranks: each tensor stored as two row chunks, one per rank."""
    out = tmp_path_factory.mktemp("two-ranks") / "ckpt"
    port = str(free_port())
    run_ok(
        [[sys.executable, "-c", SAVE, str(rank), port, str(out)] for rank in range(2)], env=base_env(), cwd=out.parent
    )
    return out


def counted(work: Callable[[], object]) -> tuple[int, int]:
    """(bytes sent to the device, graphs compiled) while ``work`` runs and its results settle."""
    import torch_xla
    import torch_xla.debug.metrics as met

    def now() -> tuple[int, int]:
        sent, compiled = met.metric_data("OutboundData"), met.metric_data("CompileTime")
        return (0 if sent is None else int(sent[1])), (0 if compiled is None else int(compiled[0]))

    torch_xla.sync()
    before = now()
    work()
    torch_xla.sync()
    after = now()
    return after[0] - before[0], after[1] - before[1]


def test_a_sharded_load_of_row_chunks_into_a_model_on_xla_cpu_sends_and_compiles_nothing(
    two_rank_save: Path, xla_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each tensor's two row chunks (two shard files) are read into one block the device takes
    over. The control, by transfers with the embedding in pieces (a TPU's path), sends the
    weights and compiles the piece writer: the counts can tell the two apart."""
    expected = build(seed=1)
    tiekit.load_sharded(expected, two_rank_save)  # on the CPU: the reference values

    model = tiekit.move(build(seed=2), xla_device)
    embedding = model[0].weight
    (torch.ones(3, device=xla_device) * 2).cpu()  # the compiler started, as in training
    sent, compiled = counted(lambda: tiekit.load_sharded(model, two_rank_save))
    assert (sent, compiled) == (0, 0)
    assert model[0].weight is embedding and model[1].weight is embedding  # in place, still tied
    for name, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name].cpu(), value), name

    monkeypatch.setattr(tiekit.devices, "adopts_host_memory", lambda device: False)
    monkeypatch.setattr(streaming, "STAGING_BYTES", 8192)  # the embedding (38,400 bytes) in pieces
    monkeypatch.setattr(streaming, "_PIECES_COST", 0)
    control = tiekit.move(build(seed=2), xla_device)
    sent, compiled = counted(lambda: tiekit.load_sharded(control, two_rank_save))
    assert sent >= sum(t.nbytes for t in expected.parameters()) and compiled >= 1
    assert torch.equal(control[0].weight.cpu(), expected[0].weight)


def test_an_in_place_load_casts_on_the_host_and_leaves_tensors_sharing_a_buffer_alone(
    tmp_path: Path, xla_device: torch.device
) -> None:
    """A bfloat16 file into a float32 model on XLA:CPU: cast on the host, taken over, nothing sent.
    The model's tensors let go of their buffers before the new values are read; a tensor outside
    the model that XLA made share one of those buffers (``copy_`` between XLA tensors shares it)
    keeps its own values: the load never writes into a buffer, it replaces it."""
    saved = build(seed=1).to(torch.bfloat16)
    path = tmp_path / "ckpt.safetensors"
    tiekit.save_checkpoint(path, model=saved, step=4)
    model = tiekit.move(build(seed=2), xla_device)
    kept = torch.empty(model[2].weight.shape, device=xla_device)
    kept.copy_(model[2].weight)
    import torch_xla

    torch_xla.sync()
    before = kept.cpu()
    from tiekit import devices

    assert len(set(devices.xla_buffer_handles([kept, model[2].weight]))) == 1  # one buffer, two tensors

    sent, compiled = counted(lambda: tiekit.load_checkpoint(path, model=model))
    assert (sent, compiled) == (0, 0)
    assert model[1].weight is model[0].weight and model[0].weight.dtype == torch.float32
    for name, value in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name].cpu(), value.float()), name
    assert torch.equal(kept.cpu(), before)
    assert not torch.equal(before, saved[2].weight.float())  # the control: the load did change the model's


@pytest.mark.parametrize("adopt", [True, False], ids=["adopt", "transfer"])
def test_an_in_place_load_into_inference_tensors_on_xla_loads_as_on_the_cpu(
    tmp_path: Path, xla_device: torch.device, monkeypatch: pytest.MonkeyPatch, adopt: bool
) -> None:
    """A model moved under ``torch.inference_mode`` holds inference tensors, which refuse in-place
    writes outside it; a load into such a CPU model reads straight into its memory and works.
    On XLA the load's writes run in inference mode for them: before, torch's raw RuntimeError,
    and on XLA:CPU the weights left zeros (released before the refused write)."""
    if not adopt:
        monkeypatch.setattr(tiekit.devices, "adopts_host_memory", lambda device: False)
    saved = build(seed=1)
    path = tmp_path / "m.safetensors"
    tiekit.save_model(saved, path)
    with torch.inference_mode():
        model = tiekit.move(build(seed=2), xla_device)
    assert model[0].weight.is_inference()
    tiekit.load_model(model, path)
    assert model[1].weight is model[0].weight
    for name, value in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name].cpu(), value), name


def test_a_load_whose_buffers_another_tensor_shares_does_not_wait_for_them_to_be_freed(
    tmp_path: Path, xla_device: torch.device
) -> None:
    """Released buffers that an EMA copy still shares free nothing: the wait for the memory to come
    back ends when it stops falling (a few ms), not at its half-second bound once per batch (24
    batches of 1 MiB took 12 s; a probe's 48 took 23.6 s, the transfer path 0.1 s)."""
    import time

    def layers(seed: int) -> nn.Sequential:
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(24)])

    path = tmp_path / "m.safetensors"
    tiekit.save_checkpoint(path, model=layers(1), step=1)
    model = tiekit.move(layers(2), xla_device)
    ema = tiekit.move(layers(3), xla_device)
    ema.load_state_dict(model.state_dict())  # copy_ between XLA tensors: the EMA shares every buffer
    before = ema[0].weight.cpu()
    started = time.monotonic()
    tiekit.load_checkpoint(path, model=model)
    took = time.monotonic() - started
    assert took < 4.0, f"the load took {took:.1f} s"  # 12 s before; 0.1-0.3 s measured
    assert torch.equal(model[0].weight.cpu(), layers(1)[0].weight)
    assert torch.equal(ema[0].weight.cpu(), before)  # the EMA keeps its values
