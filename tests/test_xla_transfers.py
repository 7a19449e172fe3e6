"""Moves convert each tensor object once (issue 13): host-to-device transfers, counted by
torch_xla's own metrics, equal the model's unique tensors, where a plain ``.to(xla)`` copies a
tied weight once per owning module."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path

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


def test_loads_onto_xla_stream_through_the_host_in_bounded_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiekit import devices
    from tiekit.checkpoint import loading

    torch.manual_seed(0)
    source = gpt2()
    tiekit.save_model(source, tmp_path / "m.safetensors")
    budget = 20_000
    monkeypatch.setattr(loading, "STAGING_BYTES", budget)
    batches: list[list[int]] = []
    real = devices.to_device

    def spy(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        batches.append([t.numel() * t.element_size() for t in tensors])
        return real(tensors, device)

    monkeypatch.setattr(devices, "to_device", spy)
    with torch.device("meta"):
        model = gpt2()
    tiekit.load_model(model, tmp_path / "m.safetensors", device="xla")
    assert len(batches) > 1
    assert all(sum(sizes) <= budget or len(sizes) == 1 for sizes in batches)  # a larger tensor goes alone
    assert sum(len(sizes) for sizes in batches) == unique_tensors(source)  # each unique tensor once
    assert model.lm_head.weight is model.transformer.wte.weight
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name].cpu(), value), name
