"""Ties on the real XLA runtime (torch_xla, PJRT_DEVICE=CPU): each test also shows the break."""

from __future__ import annotations

import warnings

import pytest
import torch
from models import MixinWeightSharingModule, ViewBuffers, WeightSharingModule, gpt2, llama
from torch import nn

import tiekit
from tiekit import devices

pytestmark = pytest.mark.xla


def unique_params(model: nn.Module) -> int:
    return len(list(model.parameters()))


def test_seed_module_loses_its_tie_on_xla_without_tiekit(xla_device: torch.device) -> None:
    model = WeightSharingModule()
    assert unique_params(model) == 2
    model.to(xla_device)
    assert unique_params(model) == 3
    assert model.layer_1.weight is not model.layer_3.weight


@pytest.mark.parametrize("swap", [False, True], ids=["swap_off", "swap_on"])
def test_seed_module_with_mixin_keeps_its_tie_on_xla(xla_device: torch.device, swap: bool) -> None:
    model = MixinWeightSharingModule()
    assert unique_params(model) == 2
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        model.to(xla_device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert unique_params(model) == 2
    assert model.layer_1.weight is model.layer_3.weight
    assert model.layer_1.weight.device.type == "xla"


def test_tied_weight_is_one_device_buffer(xla_device: torch.device) -> None:
    plain = WeightSharingModule().to(xla_device)
    tied = MixinWeightSharingModule().to(xla_device)
    for model, expected in ((plain, 3), (tied, 2)):
        handles = devices.xla_buffer_handles([model.layer_1.weight, model.layer_2.weight, model.layer_3.weight])
        assert len(set(handles)) == expected


def test_training_on_xla_matches_cpu_and_keeps_the_tie(xla_device: torch.device) -> None:
    torch.manual_seed(0)
    reference = MixinWeightSharingModule()
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    batches = [(torch.randn(8, 32), torch.randn(8, 10)) for _ in range(5)]

    def train(model: nn.Module, device: torch.device) -> nn.Module:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for x, y in batches:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            devices.sync()
        return model

    cpu_model = train(reference, torch.device("cpu"))
    xla_model = MixinWeightSharingModule()
    xla_model.load_state_dict(state)
    xla_model.to(xla_device)
    train(xla_model, xla_device)
    assert xla_model.layer_1.weight is xla_model.layer_3.weight
    assert unique_params(xla_model) == 2
    for name, value in cpu_model.state_dict().items():
        assert torch.allclose(xla_model.state_dict()[name].cpu(), value, atol=1e-5), name


def test_untied_copy_on_xla_diverges_from_the_tied_reference(xla_device: torch.device) -> None:
    # Why the tie matters: once broken, the two copies receive different gradients.
    model = WeightSharingModule().to(xla_device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 32, device=xla_device)).pow(2).sum().backward()
    optimizer.step()
    devices.sync()
    assert not torch.equal(model.layer_1.weight.cpu(), model.layer_3.weight.cpu())


@pytest.mark.parametrize("via", ["mixin", "move"])
def test_bfloat16_on_xla_keeps_ties_and_dtype(xla_device: torch.device, via: str) -> None:
    if via == "mixin":
        model: nn.Module = MixinWeightSharingModule().to(xla_device).to(torch.bfloat16)
    else:
        model = tiekit.move(WeightSharingModule(), "xla", torch.bfloat16)
    assert model.layer_1.weight is model.layer_3.weight
    assert model.layer_1.weight.dtype == torch.bfloat16 and model.layer_1.weight.device.type == "xla"
    assert unique_params(model) == 2


def test_meta_to_xla_with_to_empty(xla_device: torch.device) -> None:
    with torch.device("meta"):
        plain = WeightSharingModule()
        model = MixinWeightSharingModule()
    plain.to_empty(device=xla_device)
    assert plain.layer_1.weight is not plain.layer_3.weight
    model.to_empty(device=xla_device)
    assert model.layer_1.weight is model.layer_3.weight and model.layer_1.weight.device.type == "xla"


def test_assign_load_of_xla_tensors(xla_device: torch.device) -> None:
    state = {k: v.to(xla_device) for k, v in WeightSharingModule().state_dict().items()}
    plain = WeightSharingModule()
    plain.load_state_dict(state, assign=True)
    assert plain.layer_1.weight is not plain.layer_3.weight
    model = MixinWeightSharingModule()
    model.load_state_dict(state, assign=True)
    assert model.layer_1.weight is model.layer_3.weight and model.layer_1.weight.device.type == "xla"


@pytest.mark.parametrize(
    "build,source,target",
    [
        (gpt2, "transformer.wte.weight", "lm_head.weight"),
        (llama, "model.embed_tokens.weight", "lm_head.weight"),
    ],
)
def test_hf_models_through_move(xla_device: torch.device, build, source: str, target: str) -> None:  # type: ignore[no-untyped-def]
    plain = build()
    plain.to(xla_device)
    assert plain.get_parameter(source) is not plain.get_parameter(target)
    model = build()
    count = unique_params(model)
    tiekit.move(model, "xla")
    assert model.get_parameter(source) is model.get_parameter(target)
    assert unique_params(model) == count
    ids = torch.randint(0, 96, (1, 6), device=xla_device)
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, 6, 96) and logits.device.type == "xla"


def test_optimizer_built_before_the_move_keeps_training_the_model(xla_device: torch.device) -> None:
    model = WeightSharingModule()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    tiekit.move(model, xla_device, optimizer=optimizer)
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    before = model.layer_1.weight.detach().cpu().clone()
    model(torch.randn(2, 32, device=xla_device)).sum().backward()
    optimizer.step()
    devices.sync()
    assert not torch.equal(model.layer_1.weight.detach().cpu(), before)
    assert model.layer_1.weight is model.layer_3.weight


def test_view_buffers_follow_their_source_on_xla(xla_device: torch.device) -> None:
    model = tiekit.move(ViewBuffers(), xla_device)
    with torch.no_grad():
        model.w.mul_(3)
    devices.sync()
    w = model.w.detach().cpu()
    assert torch.equal(model.wt.cpu(), w.t()) and torch.equal(model.ws.cpu(), w[:, 2:5])
    assert not model.wt.requires_grad


def test_planning_views_on_xla_warns_and_a_plan_made_before_keeps_them(xla_device: torch.device) -> None:
    plan = tiekit.find_ties(ViewBuffers())
    model = tiekit.move(ViewBuffers(), xla_device)
    # On XLA the views share a storage but their geometry is hidden: planning there cannot keep them.
    with pytest.warns(tiekit.TieWarning, match=r"w, wt, ws, wv share one XLA storage .*find_ties before"):
        tiekit.move(model, "cpu")
    assert model.wt.data_ptr() != model.w.data_ptr()  # the tie is gone, as the warning said
    kept = tiekit.move(tiekit.move(ViewBuffers(), xla_device, plan=plan), "cpu", plan=plan)
    assert kept.wt.untyped_storage().data_ptr() == kept.w.untyped_storage().data_ptr()
    assert torch.equal(kept.ws, kept.w[:, 2:5])


def test_find_ties_on_xla_tensors_does_not_crash(xla_device: torch.device) -> None:
    model = MixinWeightSharingModule().to(xla_device)
    plan = tiekit.find_ties(model, check_values=True)
    assert [g.names for g in plan.groups] == [("layer_1.weight", "layer_3.weight")]
    broken = WeightSharingModule().to(xla_device)
    assert tiekit.find_ties(broken, check_values=True).suspected == (("layer_1.weight", "layer_3.weight"),)


class MixinViewBuffers(tiekit.TPUMixin, ViewBuffers):
    pass


def test_the_mixin_replans_on_xla_when_a_view_buffer_is_no_longer_a_view(xla_device: torch.device) -> None:
    """XLA hides memory, so the check of a cached plan skipped views: after ``w.data = new`` the
    plan still said wt is a view of w, and the next move rebuilt wt from w's new memory, losing
    wt's values (probe). The plan is still reused while the views hold."""
    model = MixinViewBuffers()
    plan = model.tie_plan()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tiekit.TieWarning)  # a plan made on XLA would warn of hidden views
        model.to(xla_device)
        with torch.no_grad():
            model.w.mul_(2)  # new values in the same storage: the views hold
        assert model.tie_plan() is plan
    views = {name: getattr(model, name).cpu() for name in ("wt", "ws", "wv")}
    with torch.no_grad():
        model.w.data = torch.randn(4, 6, device=xla_device)
    # The new plan is made on XLA, where the three buffers (views of w's old storage) cannot be recorded.
    with pytest.warns(tiekit.TieWarning, match="wt, ws, wv share one XLA storage"):
        model.to("cpu")
    assert all(torch.equal(getattr(model, name), values) for name, values in views.items())
    assert not any(same_storage(getattr(model, name), model.w) for name in views)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_preserve_ties_around_a_move_to_xla_reads_nothing_back_to_the_host() -> None:
    """torch wraps the converted tensor in a new Parameter per owner: the exit's check that the
    block gave the tied names no values of their own compared them on the host, two copies of the
    embedding back from the device (adversarial probe); tensors over one storage hold the same."""
    import torch_xla.debug.metrics as met

    model = nn.Sequential(nn.Embedding(5000, 64), nn.Linear(64, 5000, bias=False))
    model[1].weight = model[0].weight
    met.clear_all()
    with tiekit.preserve_ties(model):
        model.to(devices.resolve_device("xla"))
    assert model[1].weight is model[0].weight and model[0].weight.device.type == "xla"
    transfers = met.metric_data("TransferFromDeviceTime")
    assert transfers is None or transfers[0] == 0


def test_preserve_ties_on_xla_refuses_different_values_given_as_views_of_one_storage() -> None:
    """Tensors of one storage counted as equal on XLA (no pointers to compare): two rows of one
    tensor, loaded as the two names of a tie, kept one and dropped the other (adversarial probe)."""
    device = devices.resolve_device("xla")
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    tiekit.move(model, device)
    rows = torch.stack([torch.ones(10, 4), torch.full((10, 4), 2.0)]).to(device)
    with pytest.raises(tiekit.TieError, match="were given different values"), tiekit.preserve_ties(model):
        model.load_state_dict({"0.weight": rows[0], "1.weight": rows[1]}, assign=True)
    assert model[1].weight.cpu()[0, 0].item() == 2.0 and model[0].weight.cpu()[0, 0].item() == 1.0
