"""retie / verify / move / preserve_ties / TPUMixin on CPU and meta: every case also shows the break."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from models import MixinWeightSharingModule, ViewBuffers, WeightSharingModule, gpt2
from torch import nn

import tiekit
from tiekit import TieError, TieWarning, find_ties

FLAGS = [False, True]


@pytest.fixture(params=FLAGS, ids=["swap_off", "swap_on"])
def swap_flag(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Run with and without torch.__future__.set_swap_module_params_on_conversion."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(request.param)
    yield request.param
    torch.__future__.set_swap_module_params_on_conversion(before)


def unique_params(model: nn.Module) -> int:
    return len(list(model.parameters()))


def shares_memory(view: torch.Tensor, base: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


# -- to_empty from meta ---------------------------------------------------------------------


def test_to_empty_from_meta_breaks_ties_and_preserve_ties_keeps_them() -> None:
    with torch.device("meta"):
        plain = WeightSharingModule()
        kept = WeightSharingModule()
    plain.to_empty(device="cpu")
    assert plain.layer_1.weight is not plain.layer_3.weight  # the bug tiekit exists for
    assert unique_params(plain) == 3

    with tiekit.preserve_ties(kept) as plan:
        kept.to_empty(device="cpu")
    assert kept.layer_1.weight is kept.layer_3.weight
    assert unique_params(kept) == plan.unique_count == 2


def test_mixin_to_empty_from_meta(swap_flag: bool) -> None:
    with torch.device("meta"):
        model = MixinWeightSharingModule()
    model.to_empty(device="cpu")
    assert model.layer_1.weight is model.layer_3.weight and model.layer_1.weight.device.type == "cpu"
    assert unique_params(model) == 2


def test_views_rebuilt_after_to_empty() -> None:
    with torch.device("meta"):
        model = ViewBuffers()
    with tiekit.preserve_ties(model):
        model.to_empty(device="cpu")
    with torch.no_grad():
        model.w.copy_(torch.arange(24.0).view(4, 6))
    assert torch.equal(model.wt, model.w.t()) and torch.equal(model.ws, model.w[:, 2:5])
    assert torch.equal(model.wv, model.w.reshape(24))


# -- dtype casts -----------------------------------------------------------------------------


def test_dtype_cast_breaks_view_buffers_and_move_rebuilds_them() -> None:
    plain = ViewBuffers()
    plain.to(torch.float64)
    assert not shares_memory(plain.wt, plain.w)  # .to(dtype) replaced the buffers with copies

    model = ViewBuffers()
    tiekit.move(model, dtype=torch.float64)
    assert model.wt.dtype == torch.float64 and shares_memory(model.wt, model.w)
    with torch.no_grad():
        model.w.mul_(2)
    assert torch.equal(model.wt, model.w.t()) and torch.equal(model.ws, model.w[:, 2:5])
    assert not model.wt.requires_grad and model.w.requires_grad


@pytest.mark.parametrize("cast", ["half", "bfloat16", "double"])
def test_mixin_dtype_casts_keep_ties(cast: str, swap_flag: bool) -> None:
    model = MixinWeightSharingModule()
    getattr(model, cast)()
    assert model.layer_1.weight is model.layer_3.weight
    assert model.layer_1.weight.dtype == getattr(torch, {"half": "float16"}.get(cast, cast)) or cast == "double"


# -- load_state_dict(assign=True) ---------------------------------------------------------------


def test_assign_load_breaks_ties_and_mixin_keeps_them() -> None:
    state = {k: v.clone() for k, v in WeightSharingModule().state_dict().items()}
    plain = WeightSharingModule()
    plain.load_state_dict(state, assign=True)
    assert plain.layer_1.weight is not plain.layer_3.weight

    model = MixinWeightSharingModule()
    model.load_state_dict(state, assign=True)
    assert model.layer_1.weight is model.layer_3.weight
    assert torch.equal(model.layer_1.weight, state["layer_1.weight"])
    assert unique_params(model) == 2


def test_preserve_ties_around_assign_load_of_gpt2() -> None:
    model = gpt2()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with tiekit.preserve_ties(model):
        model.load_state_dict(state, assign=True)
    assert model.lm_head.weight is model.transformer.wte.weight


# -- retie errors leave the model untouched ---------------------------------------------------


def test_retie_missing_name_raises_and_changes_nothing() -> None:
    model = WeightSharingModule()
    plan = find_ties(model)
    model.to_empty(device="cpu")
    del model.layer_3
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(TieError, match=r"'layer_3\.weight'.*no module at 'layer_3'"):
        tiekit.retie(model, plan)
    assert {n: p for n, p in model.named_parameters()} == before


def test_retie_shape_mismatch_names_the_path_and_changes_nothing() -> None:
    model = nn.Module()
    model.a = nn.Linear(3, 3)
    model.b = nn.Linear(3, 3)
    model.b.weight = model.a.weight
    model.c = nn.Linear(3, 3)
    model.c.bias = model.a.bias
    plan = find_ties(model)
    model.c.bias = nn.Parameter(torch.zeros(3))
    model.b.weight = nn.Parameter(torch.zeros(4, 3))
    with pytest.raises(TieError, match=r"'b\.weight' has shape \(4, 3\), expected \(3, 3\)"):
        tiekit.retie(model, plan)
    assert model.c.bias is not model.a.bias  # the valid group was not applied either


def test_retie_dtype_mismatch() -> None:
    model = WeightSharingModule()
    plan = find_ties(model)
    model.layer_3.weight = nn.Parameter(model.layer_1.weight.detach().double())
    with pytest.raises(TieError, match=r"'layer_3\.weight' is torch\.float64 but its tie source"):
        tiekit.retie(model, plan)


# -- verify -------------------------------------------------------------------------------


def test_verify_message_uses_lightning_counts_and_lists_groups() -> None:
    model = WeightSharingModule()
    plan = find_ties(model)
    model.layer_3.weight = nn.Parameter(model.layer_1.weight.detach().clone())
    with pytest.raises(TieError) as info:
        tiekit.verify(model, plan)
    message = str(info.value)
    assert "Before: 2 After: 3" in message
    assert "layer_3.weight is not layer_1.weight" in message
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = tiekit.verify(model, plan, on_error="warn")
    assert not report and (report.before, report.after) == (2, 3)
    assert [w.category for w in caught] == [TieWarning]
    tiekit.retie(model, plan)
    assert tiekit.verify(model, plan).ok


def test_verify_fails_a_plan_whose_source_has_another_shape() -> None:
    """retie refused the plan, verify passed it (probe): a plan of another model."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    data = tiekit.find_ties(model).to_dict()
    data["groups"][0]["shape"] = [4, 10]
    plan = tiekit.TiePlan.from_dict(data)
    with pytest.raises(TieError, match=r"0.weight has shape \(10, 4\), the plan expects \(4, 10\)"):
        tiekit.verify(model, plan)


def test_rebind_optimizer_names_an_argument_of_the_wrong_type() -> None:
    model = WeightSharingModule()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TieError, match=r"rebind_optimizer: optimizer must be a torch.optim.Optimizer, not a"):
        tiekit.rebind_optimizer(model, model, {})  # type: ignore[arg-type]
    with pytest.raises(TieError, match=r"rebind_optimizer: names maps id\(parameter\) to its name .*not a list"):
        tiekit.rebind_optimizer(optimizer, model, ["layer_1.weight"])  # type: ignore[arg-type]
    with pytest.raises(TieError, match=r"rebind_optimizer: expected a torch.nn.Module, got str"):
        tiekit.rebind_optimizer(optimizer, "model", {})  # type: ignore[arg-type]


def test_verify_rejects_unknown_on_error() -> None:
    model = WeightSharingModule()
    with pytest.raises(tiekit.TieError, match="on_error"):  # a ValueError before: tiekit's own errors only
        tiekit.verify(model, find_ties(model), on_error="ignore")  # type: ignore[arg-type]


def test_move_and_preserve_ties_refuse_unknown_on_error_before_anything_moves() -> None:
    """The final verify named it, after the model was cast already."""
    model = WeightSharingModule()
    with pytest.raises(tiekit.TieError, match=r"tiekit.move: on_error must be 'raise' or 'warn', not 'ignore'"):
        tiekit.move(model, torch.float64, on_error="ignore")  # type: ignore[arg-type]
    assert model.layer_1.weight.dtype == torch.float32 and model.layer_3.weight is model.layer_1.weight
    refused = pytest.raises(tiekit.TieError, match=r"tiekit.preserve_ties: on_error must be")
    with refused, tiekit.preserve_ties(model, on_error="ignore"):  # type: ignore[arg-type]
        model.double()
    assert model.layer_1.weight.dtype == torch.float32


# -- move --------------------------------------------------------------------------------


def test_move_requires_a_target() -> None:
    with pytest.raises(tiekit.TieError, match="needs a device, a dtype"):
        tiekit.move(WeightSharingModule())


def test_move_takes_a_dtype_in_place_of_the_device_as_module_to_does() -> None:
    """move(model, torch.float64) raised torch's "device() received an invalid combination of
    arguments" (probe); nn.Module.to takes it as a cast."""
    model = WeightSharingModule()
    tiekit.move(model, torch.float64)
    assert model.layer_1.weight.dtype == torch.float64 and model.layer_3.weight is model.layer_1.weight
    with pytest.raises(tiekit.TieError, match="'cpux' is not a device"):
        tiekit.move(model, "cpux")
    assert model.layer_1.weight.dtype == torch.float64  # untouched
    with pytest.raises(tiekit.TieError, match="is not a device"):
        tiekit.move(model, torch.float32, dtype=torch.float16)
    # torch's own TypeError before (an integer dtype is no cast .to() makes)
    for dtype in (torch.int8, "float16"):
        with pytest.raises(
            tiekit.TieError, match=f"dtype must be a floating point or complex torch.dtype .*, not {dtype!r}"
        ):
            tiekit.move(model, "cpu", dtype)  # type: ignore[arg-type]
    assert model.layer_1.weight.dtype == torch.float64 and model.layer_3.weight is model.layer_1.weight


def test_a_declared_tie_applied_by_a_move_leaves_the_optimizer_one_parameter_with_the_sources_state(
    tmp_path: Path,
) -> None:
    """Two separate tensors, an optimizer over both, a declared tie: after the move they are one
    parameter, and so is the optimizer's entry (the embedding's, with its state). The optimizer kept
    the old head tensor beside it, with a misleading warning, and save_checkpoint refused it."""
    model = nn.Module()
    model.embed, model.head = nn.Embedding(32, 8), nn.Linear(8, 32, bias=False)
    optimizer = torch.optim.AdamW(model.parameters())
    model.head(model.embed(torch.tensor([1, 2]))).sum().backward()
    optimizer.step()
    embed_state = {k: v.clone() for k, v in optimizer.state[model.embed.weight].items()}
    plan = find_ties(model, declared={"head.weight": "embed.weight"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", TieWarning)  # nothing in the optimizer is a stranger
        tiekit.move(model, "cpu", optimizer=optimizer, plan=plan)
    assert model.head.weight is model.embed.weight
    assert optimizer.param_groups[0]["params"] == [model.embed.weight]
    assert all(torch.equal(optimizer.state[model.embed.weight][k], v) for k, v in embed_state.items())
    tiekit.save_checkpoint(tmp_path / "c.safetensors", model=model, optimizer=optimizer)


def test_move_rebinds_an_optimizer_by_name_and_warns_about_strangers() -> None:
    with torch.device("meta"):
        model = WeightSharingModule()
    model.to_empty(device="cpu")
    tiekit.retie(model, find_ties(WeightSharingModule()))
    with torch.no_grad():  # to_empty leaves whatever memory held: NaNs would make allclose fail at random
        for param in model.parameters():
            param.normal_()
    stranger = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.Adam([*model.parameters(), stranger], lr=0.1)
    model(torch.ones(1, 32)).sum().backward()
    optimizer.step()
    old_state = optimizer.state[model.layer_1.weight]["exp_avg"].clone()
    with pytest.warns(TieWarning, match="1 tensor"):
        tiekit.move(model, dtype=torch.float64, optimizer=optimizer)
    params = optimizer.param_groups[0]["params"]
    assert params[0] is model.layer_1.weight and params[1] is model.layer_2.weight and params[2] is stranger
    state = optimizer.state[model.layer_1.weight]
    assert state["exp_avg"].dtype == torch.float64 and torch.allclose(state["exp_avg"].float(), old_state)
    assert state["step"].device.type == "cpu"


# -- mixin details ---------------------------------------------------------------------------


class DeclaredTies(tiekit.TPUMixin, nn.Module):
    tied_weights: ClassVar[dict[str, str]] = {"head.weight": "embed.weight"}

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.head = nn.Linear(4, 11, bias=False)
        if tie:
            self.tie_weights()


def test_declared_ties_apply_on_request_and_after_moves() -> None:
    untied = DeclaredTies(tie=False)
    assert untied.head.weight is not untied.embed.weight
    model = DeclaredTies()
    assert model.head.weight is model.embed.weight
    with torch.device("meta"):
        meta = DeclaredTies(tie=False)  # built untied on meta: the declaration still ties it
    meta.to_empty(device="cpu")
    assert meta.head.weight is meta.embed.weight and unique_params(meta) == 1


class HoldsADeclaringMixin(tiekit.TPUMixin, nn.Module):
    """A mixin model holding another whose declared tie it is built without."""

    tied_weights: ClassVar[dict[str, str]] = {"out.weight": "inner.embed.weight"}

    def __init__(self) -> None:
        super().__init__()
        self.inner = DeclaredTies(tie=False)
        self.out = nn.Linear(4, 11, bias=False)


@pytest.mark.parametrize("how", ["cast", "to_empty", "tie_weights", "assign_load"])
def test_the_declared_ties_of_a_mixin_inside_a_mixin_apply_with_the_outer_ones(how: str) -> None:
    """Only the outermost mixin plans a conversion, and it read only its own tied_weights: the
    inner mixin's declared tie, which the inner module alone applies on every move, was left out."""
    alone = DeclaredTies(tie=False).double()  # the inner model converted by itself ties
    assert alone.head.weight is alone.embed.weight
    if how == "to_empty":
        with torch.device("meta"):
            model = HoldsADeclaringMixin()
        model.to_empty(device="cpu")
    else:
        model = HoldsADeclaringMixin()
        if how == "cast":
            model.double()
        elif how == "tie_weights":
            model.tie_weights()
        else:
            # Only the sources: the tied names are filled from them, not reported missing.
            model.load_state_dict({"inner.embed.weight": torch.randn(11, 4)}, assign=True)
    assert model.inner.head.weight is model.inner.embed.weight
    assert model.out.weight is model.inner.embed.weight
    assert unique_params(model) == 1
    control = nn.Module()  # a plain container does not plan: each mixin inside converts its own subtree
    control.held = HoldsADeclaringMixin()
    control.double()
    assert control.held.inner.head.weight is control.held.inner.embed.weight


@pytest.mark.parametrize("how", ["move", "preserve_ties"])
@pytest.mark.parametrize("nested", [False, True])
def test_move_applies_a_mixins_declared_tie_it_was_built_without(how: str, nested: bool) -> None:
    """The moving plan kept only declared ties whose tensors were equal, while the mixin's own
    _apply ties every declaration: tiekit.move tied the model, then raised "tied weights are no
    longer shared ... Before: 2 After: 1" (probe). It plans the mixin's declarations as the mixin does."""
    model: nn.Module = HoldsADeclaringMixin() if nested else DeclaredTies(tie=False)
    inner = model.inner if nested else model
    prefix = "inner." if nested else ""
    assert not torch.equal(inner.head.weight, inner.embed.weight)  # never tied: the values differ
    source = inner.embed.weight.detach().clone()
    control = copy.deepcopy(model)
    without = find_ties(control)  # planned without the declarations, as the move planned before
    control.to(torch.float64)  # the mixin ties them: that plan's check then fails
    with pytest.raises(TieError, match=f"Before: {3 if nested else 2} After: 1"):
        tiekit.verify(control, without)
    if how == "move":
        tiekit.move(model, torch.float64)
    else:
        with tiekit.preserve_ties(model) as plan:
            model.to(torch.float64)
        assert plan.source_of(f"{prefix}head.weight") == f"{prefix}embed.weight"
    assert inner.head.weight is inner.embed.weight
    assert torch.equal(inner.embed.weight, source.double())  # the target took the source's values
    assert unique_params(model) == 1


@pytest.mark.parametrize("how", ["move", "preserve_ties"])
def test_a_given_plan_without_a_mixins_declared_tie_is_refused_before_the_move(how: str) -> None:
    """A plan from find_ties (which reads no tied_weights) of a mixin model built without its tie:
    the mixin tied the model during the move, then the plan's count check raised "no longer
    shared ... Before: 2 After: 1" on a model already converted (probe today51)."""
    model = DeclaredTies(tie=False)
    plan = find_ties(model)
    assert plan.groups == ()
    control = DeclaredTies(tie=False)  # the mixin alone ties it when converted: the plan would be wrong
    control.double()
    assert control.head.weight is control.embed.weight
    said = r"the plan given does not tie 'head.weight' to 'embed.weight', which a TPUMixin's tied_weights"
    with pytest.raises(TieError, match=said):
        if how == "move":
            tiekit.move(model, torch.float64, plan=plan)
        else:
            with tiekit.preserve_ties(model, plan=plan):
                model.double()
    assert model.head.weight is not model.embed.weight and model.embed.weight.dtype == torch.float32  # untouched
    tiekit.move(model, torch.float64, plan=find_ties(model, declared={"head.weight": "embed.weight"}))  # the advice
    assert model.head.weight is model.embed.weight


def test_declared_that_contradicts_a_mixins_tied_weights_is_refused() -> None:
    """declared= overrode the mixin's declaration without a word: preserve_ties tied head to other,
    and the model's own next .to raised a conflict (probe today51)."""

    class WithOther(DeclaredTies):
        def __init__(self) -> None:
            super().__init__(tie=False)
            self.other = nn.Embedding(11, 4)

    model = WithOther()
    refused = pytest.raises(TieError, match=r"declared ties 'head.weight' to 'other.weight', but a TPUMixin's")
    with refused, tiekit.preserve_ties(model, declared={"head.weight": "other.weight"}):
        model.double()
    assert model.head.weight is not model.other.weight and model.head.weight.dtype == torch.float32
    with tiekit.preserve_ties(model, declared={"head.weight": "embed.weight"}):  # the same tie: no conflict
        model.double()
    assert model.head.weight is model.embed.weight


def test_saving_a_mixin_model_that_does_not_hold_its_declared_tie_warns(tmp_path: Path) -> None:
    """save_model wrote the two tensors without a word, and a new model of the class (which ties
    them) then refused the file with "load into a model built without this tie", which that class
    cannot be (probe today51). The save says so, and how to store one copy."""
    model = DeclaredTies(tie=False)
    path = tmp_path / "untied.safetensors"
    with pytest.warns(
        TieWarning, match=r"DeclaredTies declares ties .* do not hold.*: head.weight -> embed.weight"
    ) as w:
        tiekit.save_model(model, path)
    assert [warning.filename for warning in w] == [__file__]  # the line that saved
    with pytest.warns(TieWarning, match=r"declares ties .* do not hold") as w:
        tiekit.save_checkpoint(tmp_path / "training.safetensors", model=model, step=1)  # another depth, one line
    assert [warning.filename for warning in w] == [__file__]
    with pytest.raises(tiekit.CheckpointError, match=r"saved from a model that did not hold this tie .*tie_weights"):
        tiekit.load_model(DeclaredTies(), path)
    model.tie_weights()  # the advice: one copy, the source's values, and no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", TieWarning)
        tiekit.save_model(model, tmp_path / "tied.safetensors")
    loaded = DeclaredTies(tie=False)
    tiekit.load_model(loaded, tmp_path / "tied.safetensors")
    assert loaded.head.weight is loaded.embed.weight and torch.equal(loaded.embed.weight, model.embed.weight)


@pytest.mark.parametrize("nested", [False, True])
def test_tied_weights_that_are_no_mapping_are_a_tie_error_naming_the_class(nested: bool, tmp_path: Path) -> None:
    """Reading every mixin's declarations called .items() on them first: a list was a bare
    AttributeError (probe), where find_ties' check named it (a list or tuple of pairs alike)."""

    class PairsDeclared(DeclaredTies):
        tied_weights = (("head.weight", "embed.weight"),)  # type: ignore[assignment]

        def __init__(self) -> None:
            super().__init__(tie=False)

    model: nn.Module = PairsDeclared()
    if nested:
        outer = HoldsADeclaringMixin()
        outer.inner = model
        model = outer
    with pytest.raises(TieError, match=r"PairsDeclared.tied_weights maps tied names .* not a tuple"):
        model.double()
    # tiekit.move and save_model read every declaration too: they were a bare AttributeError (probe).
    with pytest.raises(TieError, match=r"PairsDeclared.tied_weights maps tied names .* not a tuple"):
        tiekit.move(model, torch.float64)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    path = tmp_path / "model.safetensors"
    with pytest.raises(tiekit.CheckpointError, match=r"PairsDeclared.tied_weights maps tied names .* not a tuple"):
        tiekit.save_model(model, path)
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_declared_tie_conflict_is_a_tie_error() -> None:
    class Conflict(DeclaredTies):
        tied_weights: ClassVar[dict[str, str]] = {"head.weight": "other.weight"}

        def __init__(self) -> None:
            super().__init__(tie=False)
            self.other = nn.Embedding(11, 4)
            self.head.weight = self.embed.weight

    with pytest.raises(TieError, match="conflicts"):
        Conflict().tie_weights()


def test_nested_mixin_modules_plan_once_at_the_top(monkeypatch: pytest.MonkeyPatch) -> None:
    class Inner(tiekit.TPUMixin, nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

    class Outer(tiekit.TPUMixin, nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = Inner()
            self.b = Inner()
            self.b.lin.weight = self.a.lin.weight

    calls: list[str] = []
    real = tiekit.mixin.find_ties

    def counting(model: nn.Module, **kwargs: object) -> tiekit.TiePlan:
        calls.append(type(model).__name__)
        return real(model, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tiekit.mixin, "find_ties", counting)
    with torch.device("meta"):
        model = Outer()
    model.to_empty(device="cpu")
    assert calls == ["Outer"]
    assert model.b.lin.weight is model.a.lin.weight


def test_mixin_with_gradients_from_both_uses_accumulating() -> None:
    with torch.device("meta"):
        model = MixinWeightSharingModule()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p)
    x = torch.randn(5, 32)
    model(x).sum().backward()
    grad = model.layer_1.weight.grad
    assert grad is not None and model.layer_3.weight.grad is grad
    h1 = x @ model.layer_1.weight.t()
    h2 = h1 @ model.layer_2.weight.t()
    # d/dW of sum(h2 @ W.T) plus the path through layer_1: both uses land in one gradient.
    expected_layer_3 = torch.ones(5, 10).t() @ h2
    assert not torch.allclose(grad, expected_layer_3)
    w = model.layer_1.weight.detach().clone().requires_grad_(True)
    out = ((x @ w.t()) @ model.layer_2.weight.detach().t()) @ w.t()
    out.sum().backward()
    assert torch.allclose(grad, w.grad)


def test_a_dtype_cast_on_the_cpu_converts_each_tensor_once() -> None:
    calls: list[int] = []
    model = WeightSharingModule()

    def count(t: torch.Tensor) -> torch.Tensor:
        calls.append(id(t))
        return t.to(torch.float64)

    with tiekit.preserve_ties(model):
        model._apply(count)
    assert len(calls) == len(set(calls)) == 2  # layer_1/layer_3 share one weight: 2 tensors, 3 names
    plain: list[int] = []
    WeightSharingModule()._apply(lambda t: plain.append(id(t)) or t)  # the control: torch asks per owner
    assert len(plain) == 3
    assert model.layer_1.weight.dtype == torch.float64 and model.layer_3.weight is model.layer_1.weight


def test_a_module_registered_twice_keeps_its_own_values_when_parameters_are_replaced() -> None:
    """torch visits a module registered under two parents twice; where a conversion replaces
    Parameter objects (always on XLA), the second visit meets the new Parameter, which could take
    the id of an earlier module's freed weight: that weight's conversion came back (probe: wrong
    values in 1 process of 2 on torch 2.14.1)."""
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        for before in range(1, 40):  # models of other sizes: the id a freed tensor leaves is reused in some
            root = nn.Module()
            root.pre = nn.ModuleList([nn.Linear(4, 4, bias=False) for _ in range(before)])
            block = nn.Linear(4, 4, bias=False)
            root.p1, root.p2 = nn.Sequential(block), nn.Sequential(block)
            expected = block.weight.detach().double()
            tiekit.move(root, dtype=torch.float64)
            assert torch.equal(root.p1[0].weight.detach(), expected) and root.p1[0].weight is root.p2[0].weight
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)


def cast_to_double(model: nn.Module, how: str) -> None:
    """``model`` to float64 through `tiekit.move`, `tiekit.preserve_ties` around ``.double()``, or
    ``.double()`` of a `tiekit.TPUMixin` model (``how``: "move", "preserve_ties", "mixin")."""
    if how == "move":
        tiekit.move(model, dtype=torch.float64)
    elif how == "preserve_ties":
        with tiekit.preserve_ties(model):
            model.double()
    else:
        model.double()


@pytest.mark.parametrize("how", ["move", "preserve_ties", "mixin"])
def test_a_tied_weight_with_a_gradient_casts_when_torch_swaps_tensors(how: str) -> None:
    """With swap_module_params_on_conversion, torch swaps the converted gradient into the old one's
    object: the cached conversion met at the weight's second owner then held the old float32
    gradient, and torch refused it (a raw RuntimeError, the model left half cast)."""

    class Mixed(tiekit.TPUMixin, WeightSharingModule):
        pass

    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model = Mixed() if how == "mixin" else WeightSharingModule()
        model(torch.randn(2, 32)).sum().backward()
        grad = model.layer_1.weight.grad
        assert grad is not None
        expected = grad.detach().double()
        cast_to_double(model, how)
        weight = model.layer_1.weight
        assert weight is model.layer_3.weight and weight.dtype == torch.float64
        assert weight.grad is not None and torch.equal(weight.grad, expected)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


class OverlappingSlices(nn.Module):
    """Two parameters over overlapping rows of one hidden tensor: no named tensor covers their
    shared memory, so retie cannot rebuild it after a move."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.randn(4, 6)
        self.a, self.b = nn.Module(), nn.Module()
        self.a.w, self.b.w = nn.Parameter(base[:3]), nn.Parameter(base[1:])


class MixinOverlappingSlices(tiekit.TPUMixin, OverlappingSlices):
    pass


@pytest.mark.parametrize("how", ["move", "preserve_ties", "mixin"])
def test_a_plan_retie_cannot_apply_is_refused_before_anything_converts(how: str) -> None:
    """Only a plan passed in was checked first: without one, the model was converted, then the
    retie failed and the model was left cast with its memory sharing lost (probe)."""
    model = MixinOverlappingSlices() if how == "mixin" else OverlappingSlices()
    shared = model.a.w.untyped_storage().data_ptr()
    with pytest.raises(TieError, match=r"cannot rebuild view 'b\.w': it reaches outside its source 'a\.w'"):
        cast_to_double(model, how)
    assert model.a.w.dtype == model.b.w.dtype == torch.float32
    assert model.a.w.untyped_storage().data_ptr() == model.b.w.untyped_storage().data_ptr() == shared


@pytest.mark.parametrize("how", ["move", "preserve_ties"])
def test_a_plan_of_a_model_with_a_layer_less_is_refused_before_anything_converts(how: str) -> None:
    """Every name and shape of the plan fits; only the parameter count after the move told, and the
    model was cast by then, the error saying a tie had broken (probe)."""

    def built(extra_layer: bool) -> nn.Sequential:
        layers = [nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False)]
        model = nn.Sequential(*layers, *([nn.Linear(4, 4)] if extra_layer else []))
        model[2].weight = model[0].weight
        return model

    plan, model = tiekit.find_ties(built(extra_layer=False)), built(extra_layer=True)
    refused = pytest.raises(TieError, match=r"the plan counts 3 distinct parameters, Sequential would hold 5 .*another")
    with refused:
        if how == "move":
            tiekit.move(model, dtype=torch.float64, plan=plan)
        else:
            with tiekit.preserve_ties(model, plan=plan):
                pytest.fail("the block ran")
    assert model[0].weight.dtype == torch.float32 and model[2].weight is model[0].weight

    # A tie a plain move broke counts as it will be once tied again: the plan still fits.
    plan = tiekit.find_ties(model)
    model[2].weight = nn.Parameter(model[0].weight.detach().clone())
    tiekit.move(model, dtype=torch.float64, plan=plan)
    assert model[2].weight is model[0].weight and model[0].weight.dtype == torch.float64


def test_preserve_ties_refuses_to_drop_values_an_assign_load_gave_a_tied_name_apart() -> None:
    """A state dict whose tied names hold different values, loaded with assign=True inside the block:
    the tie was made again from the source, the other values dropped silently (probe; the mixin
    refuses the same load). Equal values, as a tied model's own state dict has, load tied."""
    state = gpt2().state_dict()
    state["lm_head.weight"] = state["transformer.wte.weight"] + 1.0  # a fine-tuned head, saved apart

    plain = gpt2()
    plain.load_state_dict(state, assign=True)  # without tiekit: the tie is gone
    assert plain.lm_head.weight is not plain.transformer.wte.weight

    model = gpt2()
    refused = pytest.raises(TieError, match=r"inside the block '[\w.]+' and '[\w.]+', tied .*different values")
    with refused, tiekit.preserve_ties(model):
        model.load_state_dict(state, assign=True)
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])  # nothing dropped: left as loaded
    assert torch.equal(model.transformer.wte.weight, state["transformer.wte.weight"])

    same = gpt2()
    with tiekit.preserve_ties(same):
        same.load_state_dict(gpt2().state_dict(), assign=True)
    assert same.lm_head.weight is same.transformer.wte.weight


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
        self.head.weight = self.wte.weight


def test_preserve_ties_keeps_the_tensor_an_assign_load_gave_one_name_of_a_tie() -> None:
    """A state dict holding the tie under one name (a de-duplicated file): under the source, the
    others are tied to it; under another name (safetensors' save_model may keep that one), the tie
    takes the loaded tensor (the source's old values were kept, the loaded ones dropped, before),
    as TPUMixin's loads do. Neither is refused: nothing is lost."""
    for name in ("wte.weight", "head.weight"):
        plain, model, loaded = TiedLM(), TiedLM(), torch.randn(10, 4)
        plain.load_state_dict({name: loaded}, strict=False, assign=True)
        assert plain.head.weight is not plain.wte.weight  # without tiekit: split, one name stale
        with tiekit.preserve_ties(model):
            model.load_state_dict({name: loaded}, strict=False, assign=True)
        assert model.head.weight is model.wte.weight and torch.equal(model.wte.weight, loaded)


def test_preserve_ties_ties_a_replaced_source_and_a_meta_model_materialized_name_by_name() -> None:
    """Refused by the first version of the check (adversarial probe): a module replaced inside the
    block (set_input_embeddings), and a meta model given new memory per owning module, each name
    initialised apart (a materializer's way): the tie takes the source's tensor, as before."""
    model = TiedLM()
    with tiekit.preserve_ties(model):
        model.wte = nn.Embedding(10, 4)
    assert model.head.weight is model.wte.weight

    # A new head module (resize_token_embeddings makes one) gives nothing: the trained embedding
    # stays, as transformers' tie_weights keeps it (the next version had it overwritten).
    model = TiedLM()
    trained = model.wte.weight.detach().clone()
    with tiekit.preserve_ties(model):
        model.head = nn.Linear(4, 10, bias=False)
    assert model.head.weight is model.wte.weight and torch.equal(model.wte.weight, trained)

    # A frozen tie given a new Parameter under its other name stays frozen (it became trainable).
    model = TiedLM()
    model.wte.weight.requires_grad_(False)
    with tiekit.preserve_ties(model):
        model.head.weight = nn.Parameter(torch.randn(10, 4))
    assert model.head.weight is model.wte.weight and not model.wte.weight.requires_grad

    with torch.device("meta"):
        model = TiedLM()
    with tiekit.preserve_ties(model):
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = nn.Parameter(torch.empty_like(p, device="cpu").normal_())
    assert model.head.weight is model.wte.weight and model.wte.weight.device.type == "cpu"


def test_on_error_warn_moves_with_a_plan_counting_fewer_parameters_and_warns() -> None:
    """The count refused up front raised whatever on_error said (adversarial probe); the docs say
    on_error="warn" turns the count check into a TieWarning."""
    for how in ("move", "preserve_ties"):
        model = TiedLM()
        plan = tiekit.find_ties(model)
        model.adapter = nn.Linear(4, 4)  # added after planning
        with pytest.warns(TieWarning, match="do not match the tie plan"):
            if how == "move":
                tiekit.move(model, torch.float64, plan=plan, on_error="warn")
            else:
                with tiekit.preserve_ties(model, plan=plan, on_error="warn"):
                    model.double()
        assert model.head.weight is model.wte.weight and model.wte.weight.dtype == torch.float64


def test_the_count_check_counts_a_parameter_view_registered_at_two_paths_once() -> None:
    """retie rebuilds one Parameter per view geometry, shared by both paths of a module registered
    twice: counted as two, the plan was called another model's (adversarial probe)."""

    class Viewing(nn.Module):
        def __init__(self, w: torch.Tensor) -> None:
            super().__init__()
            self.v = nn.Parameter(w.detach().t())

    model = nn.Module()
    model.w = nn.Parameter(torch.randn(3, 4))
    model.b1 = model.b2 = Viewing(model.w)
    plan = tiekit.find_ties(model)
    model.double()  # a plain cast: v is a copy of its own now
    tiekit.move(model, "cpu", plan=plan)
    assert model.b1.v is model.b2.v and model.b1.v.data_ptr() == model.w.data_ptr()
    assert len(list(model.parameters())) == plan.unique_count == 2


def test_move_refuses_an_optimizer_that_is_not_one_before_moving() -> None:
    model = WeightSharingModule()
    with pytest.raises(TieError, match=r"optimizer must be a torch\.optim\.Optimizer, not a list"):
        tiekit.move(model, dtype=torch.float64, optimizer=list(model.parameters()))  # type: ignore[arg-type]
    assert model.layer_1.weight.dtype == torch.float32


@pytest.mark.parametrize("how", ["move", "preserve_ties"])
def test_a_declared_tie_a_plain_move_broke_is_restored_by_the_next_tiekit_move(how: str) -> None:
    """transformers declares lm_head.weight -> transformer.wte.weight; after a plain .to(xla) broke
    it (two equal copies), move and preserve_ties planned from the broken model and kept it broken,
    verify passing (probe, XLA). A tie trained apart (values differ) stays two tensors: nothing lost."""
    broken, apart = gpt2(), gpt2()
    for model in (broken, apart):
        model.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach().clone())
    with torch.no_grad():
        apart.lm_head.weight.add_(1.0)
    for model in (broken, apart):
        if how == "move":
            tiekit.move(model, dtype=torch.float64)
        else:
            with tiekit.preserve_ties(model):
                model.double()
    assert broken.lm_head.weight is broken.transformer.wte.weight and len(list(broken.parameters())) == 28
    assert apart.lm_head.weight is not apart.transformer.wte.weight and len(list(apart.parameters())) == 29
    control = gpt2()
    control.lm_head.weight = nn.Parameter(control.transformer.wte.weight.detach().clone())
    control.double()  # the control: a plain cast leaves it broken
    assert control.lm_head.weight is not control.transformer.wte.weight


class AliasedTiedWeight(nn.Module):
    """c2.weight is c1.weight, and a buffer over the same memory registered before them: the whole
    weight flattened (``over="whole"``), or a bigger buffer holding it (``over="bigger"``)."""

    def __init__(self, over: str) -> None:
        super().__init__()
        if over == "bigger":
            self.register_buffer("memory", torch.randn(24))
        self.c1, self.c2 = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
        if over == "bigger":
            self.c1.weight = nn.Parameter(self.memory[4:20].view(4, 4))
        self.c2.weight = self.c1.weight
        if over == "whole":
            self.register_buffer("flat", self.c1.weight.detach().view(16))


@pytest.mark.parametrize("over", ["whole", "bigger"])
def test_names_of_one_tensor_over_a_buffers_memory_stay_one_tensor(over: str) -> None:
    """Their view group recorded c1.weight and c2.weight as two view members, each rebuilt as its
    own Parameter: the move converted the model, then verify failed (Before: 1 After: 2), and a
    load into a meta model untied them without a word (probe)."""
    model = AliasedTiedWeight(over)
    buffer = "flat" if over == "whole" else "memory"
    tiekit.move(model, dtype=torch.float64)
    weight = model.c1.weight
    assert weight is model.c2.weight and weight.dtype == torch.float64
    assert weight.untyped_storage().data_ptr() == model.get_buffer(buffer).untyped_storage().data_ptr()
    control = AliasedTiedWeight(over).double()  # plain torch: the buffer no longer shares the weight's memory
    assert control.c1.weight.untyped_storage().data_ptr() != control.get_buffer(buffer).untyped_storage().data_ptr()


class ParameterAlsoABuffer(nn.Module):
    """One Parameter under a parameter name and a buffer name; ``buffer_first``: the buffer's
    module is registered first, so a walk meets the buffer name first."""

    def __init__(self, buffer_first: bool) -> None:
        super().__init__()
        if buffer_first:
            self.b = nn.Module()
        self.a = nn.Linear(4, 4)
        if not buffer_first:
            self.b = nn.Module()
        self.b.register_buffer("w", self.a.weight)


@pytest.mark.parametrize("buffer_first", [True, False], ids=["buffer-first", "parameter-first"])
def test_a_parameter_also_registered_as_a_buffer_stays_one_tensor_in_both_tables(buffer_first: bool) -> None:
    """Buffer first, the buffer name was the group's source and every conversion failed after
    converting ('tied to b.w, which is not a parameter'). Parameter first, an assign-load (torch
    moves a buffer holding a Parameter into the parameters) was re-tied with 'w' in both tables."""
    model = ParameterAlsoABuffer(buffer_first)
    assert find_ties(model).groups[0].source == "a.weight"
    tiekit.move(model, dtype=torch.float64)
    assert model.b.w is model.a.weight and model.a.weight.dtype == torch.float64
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with tiekit.preserve_ties(model):
        model.load_state_dict(state, assign=True)
    assert model.b.w is model.a.weight and "w" in model.b._buffers and "w" not in model.b._parameters
    control = ParameterAlsoABuffer(buffer_first)
    control.load_state_dict({k: v.clone() for k, v in control.state_dict().items()}, assign=True)
    assert control.b.w is not control.a.weight  # the control: torch's assign-load unties them


class DeclaringMixin(tiekit.TPUMixin, nn.Module):
    """A TPUMixin declaring b.weight -> a.weight, built untied (two equal copies)."""

    tied_weights: ClassVar[dict[str, str]] = {"b.weight": "a.weight"}

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
        self.b.weight = nn.Parameter(self.a.weight.detach().clone())


@pytest.mark.parametrize("how", ["move", "preserve_ties"])
def test_a_declared_tie_of_a_submodule_a_plain_move_broke_is_restored_through_its_wrapper(how: str) -> None:
    """A GPT-2 held by a wrapper (a LightningModule's self.model): only the root's declarations were
    read, so a tie a plain .to broke stayed broken through move/preserve_ties of the wrapper (probe).
    Compiled submodels are read under their _orig_mod. names; transformers' own submodels once."""
    from tiekit.declarations import declared_ties

    wrapper = nn.Module()
    wrapper.model = gpt2()
    wrapper.compiled = torch.compile(gpt2(), backend="eager")
    wrapper.mixin = DeclaringMixin()
    for lm in (wrapper.model, wrapper.compiled._orig_mod):
        lm.lm_head.weight = nn.Parameter(lm.transformer.wte.weight.detach().clone())  # what a plain .to(xla) leaves
    assert declared_ties(wrapper) == {
        "model.lm_head.weight": "model.transformer.wte.weight",
        "compiled._orig_mod.lm_head.weight": "compiled._orig_mod.transformer.wte.weight",
        "mixin.b.weight": "mixin.a.weight",
    }
    assert declared_ties(wrapper.model) == {"lm_head.weight": "transformer.wte.weight"}  # at the root, as before
    control = copy.deepcopy(wrapper).double()  # a plain cast leaves them broken
    assert control.model.lm_head.weight is not control.model.transformer.wte.weight
    if how == "move":
        tiekit.move(wrapper, dtype=torch.float64)
    else:
        with tiekit.preserve_ties(wrapper):
            wrapper.double()
    for lm in (wrapper.model, wrapper.compiled._orig_mod):
        assert lm.lm_head.weight is lm.transformer.wte.weight and lm.lm_head.weight.dtype == torch.float64
    assert wrapper.mixin.b.weight is wrapper.mixin.a.weight
    assert len(list(wrapper.parameters())) == 28 + 28 + 1


class Forwarding(nn.Module):
    """Forwards unknown attributes to the model it wraps, as peft's PeftModel does (it then lends
    the wrapped model's get_expanded_tied_weights_keys and config, under the wrapped names)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.base_model = model

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.base_model, name)


@pytest.mark.parametrize("where", ["held", "root"])
def test_a_wrapper_forwarding_attributes_declares_its_models_ties_under_their_path(where: str) -> None:
    """A LightningModule holding a peft-like wrapper of a GPT-2: the wrapper lent the GPT-2's
    declarations, named without its path, and move/save_model of the holder raised "has no
    tensor named 'model.lm_head.weight'" (probe; at the root it failed before this stop too)."""
    from tiekit.declarations import declared_ties

    lm = gpt2()
    lm.lm_head.weight = nn.Parameter(lm.transformer.wte.weight.detach().clone())  # what a plain .to(xla) leaves
    model: nn.Module = Forwarding(lm)
    if where == "held":
        model = nn.Module()
        model.model = Forwarding(lm)
    prefix = "model.base_model." if where == "held" else "base_model."
    assert declared_ties(model) == {f"{prefix}lm_head.weight": f"{prefix}transformer.wte.weight"}
    control = copy.deepcopy(model).double()
    assert len(list(control.parameters())) == 29  # the control: a plain cast leaves the two copies
    tiekit.move(model, dtype=torch.float64)
    assert lm.lm_head.weight is lm.transformer.wte.weight and lm.lm_head.weight.dtype == torch.float64


def test_a_declared_tie_whose_target_a_wrapper_also_holds_moves_both_names_to_the_source(tmp_path: Path) -> None:
    """A wrapper holding a GPT-2 and its head again (self.head = model.lm_head), the head an equal
    copy of the embedding (a plain .to broke the tie): move and save_model raised "declared tie
    'model.lm_head.weight' -> ... conflicts with the detected tie 'model.lm_head.weight' =
    'model.lm_head.weight'" (probe). Every name of the head's weight follows the declared source."""
    wrapper = nn.Module()
    wrapper.model = gpt2()
    wrapper.head = wrapper.model.lm_head
    wrapper.model.lm_head.weight = nn.Parameter(wrapper.model.transformer.wte.weight.detach().clone())
    plan = tiekit.find_ties(wrapper, declared={"model.lm_head.weight": "model.transformer.wte.weight"})
    group = plan.group_of("model.transformer.wte.weight")
    assert group is not None and set(group.names) == {
        "model.transformer.wte.weight",
        "model.lm_head.weight",
        "head.weight",
    }
    control = copy.deepcopy(wrapper).double()
    assert control.head.weight is not control.model.transformer.wte.weight  # the control: still two copies
    tiekit.move(wrapper, dtype=torch.float64)
    wte = wrapper.model.transformer.wte.weight
    assert wrapper.head.weight is wte and wrapper.model.lm_head.weight is wte and wte.dtype == torch.float64
    tiekit.save_model(wrapper, tmp_path / "w.safetensors")
    from tiekit.inspection import inspect_file

    report = inspect_file(tmp_path / "w.safetensors")
    assert report.plan is not None and len(report.plan.groups) == 1
    assert "head.weight" not in {t.name for t in report.tensors}  # one copy on disk


def _twice_registered() -> nn.Module:
    model = nn.Module()
    model.a, model.b, model.x = (nn.Linear(4, 4, bias=False) for _ in range(3))
    model.b2 = model.b  # b registered twice
    return model


@pytest.mark.parametrize("first", ["b", "x"])
def test_declared_ties_through_a_twice_registered_module_do_not_depend_on_their_order(first: str) -> None:
    """x -> b2 (b's slot under its second name) and b -> a: declared x first, the chain was followed
    by name (b2 is no declared target), x joined b's slot, and b -> a raised "conflicts with the
    detected tie 'b.weight' = 'x.weight'" where the other order gave one group (probe)."""
    declared = {"b.weight": "a.weight", "x.weight": "b2.weight"}
    if first == "x":
        declared = dict(reversed(declared.items()))
    model = _twice_registered()
    plan = tiekit.find_ties(model, declared=declared)
    assert [sorted(g.names) for g in plan.groups] == [["a.weight", "b.weight", "b2.weight", "x.weight"]]
    assert plan.source_of("x.weight") == "a.weight"
    tiekit.move(model, dtype=torch.float64, plan=plan)
    assert model.x.weight is model.a.weight and model.b2.weight is model.a.weight
    with pytest.raises(tiekit.TieError, match="cycle"):
        tiekit.find_ties(_twice_registered(), declared={"a.weight": "b2.weight", "b.weight": "a.weight"})
