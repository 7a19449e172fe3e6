"""Moves convert each tensor object once (issue 13): host-to-device transfers, counted by
torch_xla's own metrics, equal the model's unique tensors, where a plain ``.to(xla)`` copies a
tied weight once per owning module."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from models import MixinWeightSharingModule, WeightSharingModule, gpt2, llama, t5
from torch import nn

import tiekit

pytestmark = pytest.mark.xla


@pytest.fixture(params=[False, True], ids=["assign", "swap"])
def swap(request: pytest.FixtureRequest) -> Iterator[bool]:
    """With and without torch.__future__.set_swap_module_params_on_conversion."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(request.param)
    yield bool(request.param)
    torch.__future__.set_swap_module_params_on_conversion(before)


def transfers_during(work: Callable[[], object]) -> int:
    import torch_xla
    import torch_xla.debug.metrics as met

    def count() -> int:
        data = met.metric_data("TransferToDeviceTime")
        return 0 if data is None else int(data[0])

    torch_xla.sync()
    before = count()
    work()
    torch_xla.sync()
    return count() - before


def unique_tensors(model: nn.Module) -> int:
    return len({id(t) for t in [*model.parameters(), *model.buffers()]})


@pytest.mark.parametrize("build", [gpt2, llama, t5], ids=["gpt2", "llama-tied", "t5"])
def test_move_transfers_each_unique_tensor_once(build: Callable[[], nn.Module], swap: bool) -> None:
    torch.manual_seed(0)
    model = build()
    unique = unique_tensors(model)
    plain = copy.deepcopy(model)
    # The control: torch converts per owning module, so a tied weight crosses twice, unless
    # swap_module_params_on_conversion keeps the Parameter object (the second owner then holds
    # the moved one already).
    crossed = transfers_during(lambda: plain.to("xla"))
    assert crossed == unique if swap else crossed > unique
    assert transfers_during(lambda: tiekit.move(model, "xla")) == unique
    assert unique_tensors(model) == unique  # and the ties hold


def test_preserve_ties_and_the_mixin_transfer_once(swap: bool) -> None:
    model = WeightSharingModule()
    unique = unique_tensors(model)
    with tiekit.preserve_ties(model):
        assert transfers_during(lambda: model.to("xla")) == unique
    assert model.layer_3.weight is model.layer_1.weight

    mixed = MixinWeightSharingModule()
    assert transfers_during(lambda: mixed.to("xla")) == unique
    assert mixed.layer_3.weight is mixed.layer_1.weight


def test_the_moved_values_are_the_models(swap: bool) -> None:
    torch.manual_seed(0)
    model = gpt2()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    tiekit.move(model, "xla", dtype=torch.bfloat16)
    assert model.lm_head.weight is model.transformer.wte.weight
    for name, value in model.state_dict().items():
        assert torch.equal(value.cpu(), expected[name].to(value.dtype)), name


@pytest.mark.parametrize("load", ["load_model", "load_checkpoint"])
def test_loads_onto_xla_stream_through_the_host_in_bounded_batches(
    load: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load_model of a meta model onto XLA, and load_checkpoint into a model already there, by
    transfers: the path of a device whose memory is not the host's (a TPU). XLA:CPU takes the
    memory a load reads over instead, tested below; turned off here to test the transfers."""
    import torch_xla.debug.metrics as met

    from tiekit.checkpoint import streaming

    monkeypatch.setattr(tiekit.devices, "adopts_host_memory", lambda device: False)

    torch.manual_seed(0)
    source = gpt2()
    path = tmp_path / "m.safetensors"
    if load == "load_model":
        tiekit.save_model(source, path)
        with torch.device("meta"):
            model = gpt2()
    else:
        tiekit.save_checkpoint(path, model=source, step=3)
        model = gpt2()  # other values
        tiekit.move(model, "xla")
    budget = 10_000  # the embedding (12,288 bytes) and the MLP weights (16,384) are larger
    monkeypatch.setattr(streaming, "STAGING_BYTES", budget)
    unique = list({t.data_ptr(): t for t in source.state_dict().values()}.values())  # tied: one
    larger = sorted((t.nbytes for t in unique if t.nbytes > budget), reverse=True)
    met.clear_all()
    if load == "load_model":
        tiekit.load_model(model, path, device="xla")
    else:
        assert tiekit.load_checkpoint(path, model=model)["step"] == 3
    count, total, samples = met.metric_data("OutboundData")  # bytes of each host-to-device transfer
    sent = [int(value) for _, value in samples]
    assert count == len(sent) == met.metric_data("TransferToDeviceTime")[0]
    assert total == sum(t.nbytes for t in unique)  # each unique tensor crossed once
    assert met.counter_value("CreateDataHandles") == len(unique)
    assert sent[: len(larger)] == larger  # larger tensors first, each alone
    assert all(size <= budget for size in sent[len(larger) :])
    assert len(sent) >= len(larger) + sum(t.nbytes for t in unique if t.nbytes <= budget) // budget
    assert model.lm_head.weight is model.transformer.wte.weight
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name].cpu(), value), name


def test_xla_cpu_takes_over_the_memory_a_load_reads_and_trains_on_it_as_on_transferred_weights(
    tmp_path: Path,
) -> None:
    """On XLA:CPU, device buffers are host memory: load_model onto it reads each tensor into memory
    of its own, which the device takes over (torch_xla's DLPack import): no transfer, no staging;
    load_checkpoint and load_sharded into a model already there likewise send no weights.
    XLA may reuse such a buffer for a step's result (parameter aliasing): six AdamW steps on the
    loaded model equal, bit for bit, the same steps on a model moved by transfers (the control
    path, which counts one transfer per unique tensor)."""
    import torch_xla
    import torch_xla.debug.metrics as met

    torch.manual_seed(0)
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    source = gpt2(**no_dropout)
    path = tmp_path / "m.safetensors"
    tiekit.save_model(source, path)

    def trained(model: nn.Module) -> dict[str, torch.Tensor]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.arange(32).view(2, 16).to(model.lm_head.weight.device)
        for _ in range(6):
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            torch_xla.sync()
        return {name: value.cpu() for name, value in model.state_dict().items()}

    with torch.device("meta"):
        adopted = gpt2(**no_dropout)
    met.clear_all()
    tiekit.load_model(adopted, path, device="xla")
    assert met.metric_data("TransferToDeviceTime") is None  # not one transfer
    assert adopted.lm_head.weight is adopted.transformer.wte.weight
    for name, value in source.state_dict().items():
        assert torch.equal(adopted.state_dict()[name].cpu(), value), name

    # Into models already on XLA, in place: each batch's block of host memory becomes the buffers
    # of several tensors (64-byte aligned views of it), which the model's tensors then hold.
    tiekit.save_checkpoint(tmp_path / "ckpt.safetensors", model=source, step=1)
    tiekit.save_sharded(source, tmp_path / "sharded")
    in_place = {"load_checkpoint": gpt2(**no_dropout), "load_sharded": gpt2(**no_dropout)}  # other values
    for name, model in in_place.items():
        tiekit.move(model, "xla")
        met.clear_all()
        if name == "load_checkpoint":
            tiekit.load_checkpoint(tmp_path / "ckpt.safetensors", model=model)
        else:
            tiekit.load_sharded(model, tmp_path / "sharded")
        sent = met.metric_data("OutboundData")
        assert sent is None or sent[1] < 1024, (name, sent)  # a piece's row offset at most, no weights
        assert model.lm_head.weight is model.transformer.wte.weight

    moved = gpt2(**no_dropout)
    tiekit.load_model(moved, path)
    assert transfers_during(lambda: tiekit.move(moved, "xla")) == unique_tensors(moved)
    control = trained(moved)
    for model in (adopted, *in_place.values()):
        ours = trained(model)
        assert model.lm_head.weight is model.transformer.wte.weight
        assert not torch.equal(ours["transformer.wte.weight"], source.state_dict()["transformer.wte.weight"])
        assert all(torch.equal(ours[name], control[name]) for name in control)


def test_a_tensor_dlpack_cannot_carry_is_transferred_on_xla_cpu(tmp_path: Path) -> None:
    """DLPack has no float8 dtype (torch raises BufferError): such a tensor crosses by transfer,
    the others are taken over as read. A load with one raised that BufferError before."""
    import torch_xla.debug.metrics as met

    def build() -> nn.Module:
        model = WeightSharingModule()
        model.register_buffer("scales", torch.linspace(-2, 2, 64).to(torch.float8_e4m3fn))
        return model

    source = build()
    tiekit.save_model(source, tmp_path / "m.safetensors")
    with torch.device("meta"):
        model = build()
    met.clear_all()
    tiekit.load_model(model, tmp_path / "m.safetensors", device="xla")
    assert met.metric_data("OutboundData")[1] == 64  # the float8 buffer's bytes alone
    assert model.layer_3.weight is model.layer_1.weight
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name].cpu().float(), value.float()), name


# The lines of the peak-RSS scripts below that start the measure: ``peak()``, then ``before``.
_RESET_PEAK = """
def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
# The setup's transfers (a move) finish on XLA:CPU's threads after their calls return, holding
# host copies until then, and a buffer let go of while its transfer runs is freed only after it:
# wait until every tensor is ready, and hand every freed block back, so that the growth from here
# is the load's own (without this, an in-place load seemed to grow by 0.03-0.26x by the race).
import ctypes
tiekit.devices.wait_until_ready([*model.parameters(), *model.buffers()])
ctypes.CDLL(None).malloc_trim(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak restarts from what the process holds now
before = peak()
"""
_CONFIG = dict(n_layer=8, n_embd=256, n_head=4, vocab_size=8000, n_positions=64, bos_token_id=0, eos_token_id=0)
_PEAK = (
    f"CONFIG = {_CONFIG!r}\n"
    + """
import sys, torch, torch_xla, transformers, tiekit
from tiekit.checkpoint import streaming
mode = sys.argv[2]  # "adopt": XLA:CPU takes the memory read over; else by transfers, as on a TPU
if mode != "adopt":
    tiekit.devices.adopts_host_memory = lambda device: False
if mode == "whole":
    streaming._pieces = lambda *args: []  # a dominant tensor sent whole
config = transformers.GPT2Config(**CONFIG)
with torch.device("meta"):
    model = transformers.GPT2LMHeadModel(config)
torch_xla.sync()
"""
    + _RESET_PEAK
    + """
tiekit.load_model(model, sys.argv[1], device="xla")
torch_xla.sync()
assert model.lm_head.weight is model.transformer.wte.weight
print(peak() - before)
"""
)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak RSS")
def test_a_load_onto_xla_holds_little_host_memory_beyond_the_device_copy(tmp_path: Path) -> None:
    """XLA:CPU device buffers are host memory, so the floor is the file's bytes once. Reading the
    whole file first and transferring it in one batch peaks at 2.0x (tiekit before streaming,
    caba64f; the plain safetensors path at 2.6x); the bound leaves room for the runtime's own
    allocations in a 34 MB model. The embedding is 24% of it: by transfers (a TPU's path) a tensor
    larger than the staging buffer briefly exists three times (docs/benchmarks.md). XLA:CPU takes
    over the memory the load reads into instead: within 15% of the file."""
    import subprocess
    import sys

    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(**_CONFIG)
    path = tmp_path / "m.safetensors"
    tiekit.save_model(transformers.GPT2LMHeadModel(config), path)
    growth = {}
    for mode in ("adopt", "pieces"):
        done = subprocess.run(
            [sys.executable, "-c", _PEAK, str(path), mode], capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, done.stderr[-3000:]
        growth[mode] = int(done.stdout.strip().splitlines()[-1]) / path.stat().st_size
    assert growth["pieces"] <= 1.4, f"peak RSS grew by {growth['pieces']:.2f}x the file by transfers"
    assert growth["adopt"] <= 1.15, f"peak RSS grew by {growth['adopt']:.2f}x the file on XLA:CPU"


def run_peak_script(script: str, *args: str) -> tuple[float, int]:
    """Run a peak-RSS script in a fresh process: (the sum of the loaded weights, bytes of peak growth)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    total, grown = done.stdout.strip().splitlines()[-2:]
    return float(total), int(grown)


# An embedding of 66 MB, 90% of the model: large enough that pieces pay for their compilation.
_IN_PLACE = dict(n_layer=2, n_embd=256, n_head=4, vocab_size=64_000, n_positions=64, bos_token_id=0, eos_token_id=0)
_IN_PLACE_PEAK = (
    f"CONFIG = {_IN_PLACE!r}\n"
    + """
import sys, torch, torch_xla, transformers, tiekit
from tiekit.checkpoint import streaming
if sys.argv[2] != "adopt":  # by transfers, as on a TPU
    tiekit.devices.adopts_host_memory = lambda device: False
if sys.argv[2] == "whole":
    streaming._pieces = lambda *args: []  # the control
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))  # other values than the file's
tiekit.move(model, "xla")
(torch.ones(3, device=model.lm_head.weight.device) * 2).cpu()  # as in training: the compiler started
torch_xla.sync()
"""
    + _RESET_PEAK
    + """
assert tiekit.load_checkpoint(sys.argv[1], model=model)["step"] == 5
torch_xla.sync()
grown = peak() - before
assert model.lm_head.weight is model.transformer.wte.weight
print(sum(p.detach().double().sum().item() for p in model.parameters()))
print(grown)
"""
)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak RSS")
def test_a_load_into_a_model_on_xla_overwrites_it_in_place_batch_by_batch(tmp_path: Path) -> None:
    """load_checkpoint into a model already on XLA writes each batch into the model's tensors as it
    arrives, and a large tensor in pieces: holding the new values aside, with the embedding whole,
    grew GPT-2 small by 0.66x the file beyond the model, now 0.20x. The control sends the
    embedding whole, which briefly exists three times beside the model (1.85-1.96x measured). By
    transfers (a TPU's path, 0.23-0.25x: staging of a 64th of the load, the piece writer's
    compilation), and on XLA:CPU, where each tensor lets go of its buffer and the device takes
    over the memory its new values are read into (0.03x: no staging, no pieces, no compilation).
    The compiler has started (as in a training process): its first compilation's 40-60 MB would
    swamp this 72 MB model."""

    import transformers

    torch.manual_seed(0)
    saved = transformers.GPT2LMHeadModel(transformers.GPT2Config(**_IN_PLACE))
    path = tmp_path / "m.safetensors"
    tiekit.save_checkpoint(path, model=saved, step=5)
    expected = sum(p.detach().double().sum().item() for p in saved.parameters())
    growth = {}
    for mode in ("adopt", "pieces", "whole"):
        total, grown = run_peak_script(_IN_PLACE_PEAK, str(path), mode)
        assert total == pytest.approx(expected, rel=1e-9)  # the file's values, not the model's own
        growth[mode] = grown / path.stat().st_size
    assert growth["adopt"] <= 0.15, f"on XLA:CPU, peak RSS grew by {growth['adopt']:.2f}x the file"
    assert growth["pieces"] <= 0.7, f"peak RSS grew by {growth['pieces']:.2f}x the file"
    assert growth["whole"] >= 0.9, f"the control grew by {growth['whole']:.2f}x only"


_SHARDED_PEAK = (
    """
import ast, sys, torch, torch_xla, transformers, tiekit
import tiekit.dcp.loading
import tiekit.checkpoint.streaming
CONFIG = ast.literal_eval(sys.argv[2])
tiekit.dcp.loading.STAGING_BYTES = 1 << 20  # tensors above it stream by transfers (the rest through DCP)
tiekit.checkpoint.streaming._PIECES_COST = 4 << 20  # an embedding of 8 MB goes in pieces too
if sys.argv[3] != "adopt":  # by transfers, as on a TPU
    tiekit.devices.adopts_host_memory = lambda device: False
if sys.argv[3].startswith("dcp"):
    tiekit.dcp.loading._streamed_rows = lambda *args: ({}, {})  # the control: every tensor through DCP's reader
if sys.argv[3] == "dcp-unsynced":
    tiekit.dcp.loading._weights_planner = lambda targets: None  # DCP's own planner: copies pending to the end
config = transformers.GPT2Config(**CONFIG)
model = transformers.GPT2LMHeadModel(config)  # other values than the checkpoint's
tiekit.move(model, "xla")
(torch.ones(3, device=model.lm_head.weight.device) * 2).cpu()  # the compiler started, as in training
torch_xla.sync()
"""
    + _RESET_PEAK
    + """
tiekit.load_sharded(model, sys.argv[1])
torch_xla.sync()
grown = peak() - before
assert model.lm_head.weight is model.transformer.wte.weight
print(sum(p.detach().double().sum().item() for p in model.parameters()))
print(grown)
"""
)


def sharded_load_growth(config: dict[str, Any], mode: str, tmp_path: Path) -> float:
    """Peak RSS growth of load_sharded into a model on XLA, over the checkpoint's bytes, in a fresh
    process; the values loaded checked against the saved model's."""

    import transformers

    torch.manual_seed(0)
    saved = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))
    path = tmp_path / "ckpt"
    if not path.exists():
        tiekit.save_sharded(saved, path)
    total, grown = run_peak_script(_SHARDED_PEAK, str(path), repr(config), mode)
    expected = sum(p.detach().double().sum().item() for p in saved.parameters())
    assert total == pytest.approx(expected, rel=1e-9)  # the checkpoint's values, not the model's own
    return grown / sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak RSS")
def test_a_sharded_load_streams_a_dominant_tensor_into_a_model_on_xla_in_place(tmp_path: Path) -> None:
    """load_sharded streams whole tensors bound for XLA from the shard files, a large one in pieces
    written in place (GPT-2 small: 0.15x the checkpoint beyond the model, 0.45-0.52x through DCP).
    The control reads through DCP, which loads each tensor whole with ``torch.load`` and copies
    it in: the 66 MB embedding briefly exists several times beside the model."""
    streamed = sharded_load_growth(_IN_PLACE, "stream", tmp_path)
    adopted = sharded_load_growth(_IN_PLACE, "adopt", tmp_path)  # XLA:CPU: every tensor streamed, adopted
    through_dcp = sharded_load_growth(_IN_PLACE, "dcp", tmp_path)
    assert streamed <= 0.5, f"peak RSS grew by {streamed:.2f}x the checkpoint"  # 0.27x measured
    assert adopted <= 0.15, f"on XLA:CPU, peak RSS grew by {adopted:.2f}x the checkpoint"  # 0.05x measured
    # The control fails that bound: 0.84-1.98x measured (0.90x in one CI run, 0.91-1.72x with the
    # code of 8712ed3 on 2026-11-25: how much DCP's copies overlap XLA:CPU's varies by run).
    assert through_dcp > 0.5, f"the control grew by {through_dcp:.2f}x only: the test cannot tell the two apart"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak RSS")
def test_a_sharded_load_into_a_model_on_xla_holds_little_host_memory_beyond_it(tmp_path: Path) -> None:
    """What load_sharded does not stream (tensors not stored as rows), DCP reads in place into
    the model's XLA tensors by transfers (a TPU's path); here every tensor goes that way. Each
    value DCP copies in is pending XLA work holding the old buffer and the new one until the
    graph runs. Left to the end (the control, DCP's own planner) the load holds the model about
    twice: 1.28-1.51x the checkpoint. Running the pending copies every staging buffer's worth
    bounds it: 0.80x, the rest being replaced buffers XLA:CPU frees some time after their
    tensors let go of them (on a TPU, device memory). On XLA:CPU itself, adoption: 0.11x."""
    growth = sharded_load_growth(_CONFIG, "dcp", tmp_path)
    control = sharded_load_growth(_CONFIG, "dcp-unsynced", tmp_path)
    assert growth <= 1.05, f"peak RSS grew by {growth:.2f}x the checkpoint"
    assert control >= 1.15, f"the control grew by {control:.2f}x only: the test cannot tell the two apart"


@pytest.mark.parametrize("device", ["cpu", "xla"])
def test_write_rows_writes_in_place_with_one_graph_for_every_offset(device: str) -> None:
    """``devices.write_rows`` puts rows at a row offset in place; on XLA the offset is data, so
    pieces of one shape at offsets 0, 1 (torch_xla makes those two constants when they are
    scalars) and any other run one compiled graph, where slice assignment compiles one per offset."""
    import torch_xla.debug.metrics as met

    from tiekit import devices

    def compilations() -> int:
        data = met.metric_data("CompileTime")
        return 0 if data is None else int(data[0])

    dev = devices.resolve_device(device)
    assert dev is not None
    expected = torch.arange(7 * 3 * 2, dtype=torch.float32).reshape(7, 3, 2)
    target = torch.zeros(7, 3, 2, device=dev)
    devices.sync()
    before = compilations()
    for first in (0, 1, 4, 2):  # the last overlaps the pieces before it
        devices.write_rows(target, first, expected[first : first + 3].to(dev))
        devices.sync()
    assert torch.equal(target.cpu(), expected)
    if device == "xla":
        assert compilations() - before == 1
        before = compilations()
        for first in (0, 2):
            target[first : first + 3] = expected[first : first + 3].to(dev)  # the control
            devices.sync()
        assert compilations() - before == 2


@pytest.mark.parametrize("load", ["load_model", "load_checkpoint"])
def test_a_dominant_tensor_crosses_in_pieces_written_into_one_device_tensor(
    load: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor whose three brief copies (staging, torch_xla's, the device's) would outweigh the
    whole load, here the embedding at 82% of the model, crosses in pieces of whole rows that
    each fit a staging buffer, written into one device tensor by one compiled graph; the
    control, with pieces turned off, sends it whole. By transfers, as on a TPU (XLA:CPU's
    taking over of host memory turned off)."""
    import torch_xla.debug.metrics as met

    from tiekit.checkpoint import streaming

    monkeypatch.setattr(tiekit.devices, "adopts_host_memory", lambda device: False)

    torch.manual_seed(0)
    source = gpt2(vocab_size=2000, n_layer=1)
    embedding = source.transformer.wte.weight
    path = tmp_path / "m.safetensors"
    if load == "load_model":
        tiekit.save_model(source, path)
    else:
        tiekit.save_checkpoint(path, model=source, step=3)
    budget = 16_384  # of the other tensors none is larger
    monkeypatch.setattr(streaming, "STAGING_BYTES", budget)
    monkeypatch.setattr(streaming, "_PIECES_COST", 4 * budget)  # in proportion to this small model
    row = embedding[0].nbytes
    count = (budget - 63) // row
    pieces = -(-embedding.shape[0] // count)

    def load_and_report() -> tuple[list[int], int, nn.Module]:
        if load == "load_model":
            with torch.device("meta"):
                model = gpt2(vocab_size=2000, n_layer=1)
        else:
            model = gpt2(vocab_size=2000, n_layer=1)  # other values
            tiekit.move(model, "xla")
        met.clear_all()
        if load == "load_model":
            tiekit.load_model(model, path, device="xla")
        else:
            assert tiekit.load_checkpoint(path, model=model)["step"] == 3
        sent = [int(value) for _, value in met.metric_data("OutboundData")[2]]
        compiled = met.metric_data("CompileTime")
        return sent, 0 if compiled is None else int(compiled[0]), model

    sent, compilations, model = load_and_report()
    assert max(sent) <= budget
    assert sent.count(count * row) == pieces
    assert compilations <= 3  # a zero tensor, the write, the in-place copies of load_checkpoint
    assert model.lm_head.weight is model.transformer.wte.weight
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name].cpu(), value), name

    monkeypatch.setattr(streaming, "_pieces", lambda *args: [])
    sent, _, model = load_and_report()
    assert max(sent) == embedding.nbytes
    assert model.lm_head.weight is model.transformer.wte.weight


_DOMINANT = dict(n_layer=1, n_embd=256, n_head=4, vocab_size=128_000, n_positions=64, bos_token_id=0, eos_token_id=0)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak RSS")
def test_a_load_whose_embedding_dominates_the_model_holds_it_once(tmp_path: Path) -> None:
    """An embedding of 98% of the model: whole, it briefly exists two to three times (peak RSS
    growth 2.0x the file: the control); by transfers in pieces written in place on the device
    (a TPU's path), once, plus the pieces' copies and the process's first XLA compilation (about
    40 MB on XLA:CPU: 1.41x for this 134 MB file, 1.14x for a 974 MiB one in
    benchmarks/bench_device_load.py). XLA:CPU takes over the memory the load reads into: the
    file's bytes once, 1.0x."""
    import subprocess
    import sys

    import transformers

    torch.manual_seed(0)
    path = tmp_path / "m.safetensors"
    tiekit.save_model(transformers.GPT2LMHeadModel(transformers.GPT2Config(**_DOMINANT)), path)
    growth = {}
    for mode in ("adopt", "pieces", "whole"):
        script = _PEAK.replace(repr(_CONFIG), repr(_DOMINANT))
        done = subprocess.run(
            [sys.executable, "-c", script, str(path), mode], capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, done.stderr[-3000:]
        growth[mode] = int(done.stdout.strip().splitlines()[-1]) / path.stat().st_size
    assert growth["adopt"] <= 1.15, f"peak RSS grew by {growth['adopt']:.2f}x the file on XLA:CPU"
    assert growth["pieces"] <= 1.6, f"by transfers, peak RSS grew by {growth['pieces']:.2f}x"  # 1.41x measured
    assert growth["whole"] >= 1.85, f"the control grew by {growth['whole']:.2f}x only"  # 1.98-2.01x measured
