"""Edges of the core API found by probing: a mixin plan cached past a change of memory, a view in
another dtype, an assign-load of a state dict whose tied names are left out or disagree."""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from models import assert_unchanged, snapshot
from torch import nn

import tiekit
from tiekit import TieError


class ViewOfWeight(tiekit.TPUMixin, nn.Module):
    """A weight and a buffer that is its transpose (a view group)."""

    def __init__(self, persistent: bool = True) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6))
        self.register_buffer("wt", self.w.detach().t(), persistent=persistent)


@pytest.fixture(params=[False, True], ids=["swap_off", "swap_on"])
def swap_flag(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Run with and without torch.__future__.set_swap_module_params_on_conversion."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(request.param)
    yield request.param
    torch.__future__.set_swap_module_params_on_conversion(before)


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# -- the mixin's cached plan -------------------------------------------------------------------


def test_the_mixin_replans_when_a_view_buffer_is_no_longer_a_view() -> None:
    """``w.data = new`` registers nothing, so the cached plan still said wt is a view of w and the
    next cast rebuilt wt from w's new memory: wt silently lost its own values (probe)."""
    model = ViewOfWeight()
    model.double()
    model.float()  # the plan is cached while wt is a view of w
    with torch.no_grad():
        model.w.data = torch.randn(4, 6)
    wt = model.wt.clone()
    model.double()
    assert torch.equal(model.wt, wt.double()) and not same_memory(model.wt, model.w)


def test_the_mixin_reuses_its_plan_while_the_ties_hold() -> None:
    model = ViewOfWeight()
    plan = model.tie_plan()
    model.double()
    with torch.no_grad():
        model.w.mul_(2)  # new values in the same memory: the plan still holds
    assert model.tie_plan() is plan
    assert same_memory(model.wt, model.w) and torch.equal(model.wt, model.w.t())


# -- a view in another dtype -------------------------------------------------------------------


def with_int_view(model: nn.Module, twice: bool = False) -> nn.Module:
    """``model`` with a.w and a buffer b.bits over a.w's memory as int32 (and c.bits, the same
    tensor, with ``twice``)."""
    torch.manual_seed(0)
    model.a, model.b = nn.Module(), nn.Module()
    model.a.w = nn.Parameter(torch.randn(4, 6))
    model.b.register_buffer("bits", model.a.w.detach().view(torch.int32))
    if twice:
        model.c = nn.Module()
        model.c.register_buffer("bits", model.b.bits)
    return model


class MixinModule(tiekit.TPUMixin, nn.Module):
    pass


def convert(model: nn.Module, how: str) -> None:
    if how == "move":
        tiekit.move(model, dtype=torch.float64)
    elif how == "move_with_plan":
        tiekit.move(model, dtype=torch.float64, plan=tiekit.find_ties(model))
    elif how == "move_with_json_plan":  # the JSON has no place for the view: the model is asked
        tiekit.move(model, dtype=torch.float64, plan=tiekit.TiePlan.from_json(tiekit.find_ties(model).to_json()))
    elif how == "preserve_ties_with_json_plan":
        with tiekit.preserve_ties(model, plan=tiekit.TiePlan.from_json(tiekit.find_ties(model).to_json())):
            model.double()
    elif how == "preserve_ties":
        with tiekit.preserve_ties(model):
            model.double()
    elif how == "mixin_load":
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    else:
        model.double()


def test_a_view_in_another_dtype_is_recorded_apart_from_the_groups() -> None:
    """It made a view group holding only its source, and nothing said the sharing was dropped."""
    plan = tiekit.find_ties(with_int_view(nn.Module()))
    assert plan.groups == ()
    assert plan.reinterpreting == (tiekit.plan.ReinterpretingView("b.bits", "a.w", "int32", "float32"),)
    assert "b.bits (int32) over a.w (float32)" in str(plan)
    assert tiekit.TiePlan.from_json(plan.to_json()) == plan  # the JSON has no place for it

    twice = tiekit.find_ties(with_int_view(nn.Module(), twice=True))
    assert [g.names for g in twice.groups] == [("b.bits", "c.bits")]  # still one tensor under both names


@pytest.mark.parametrize(
    "how",
    [
        "move",
        "move_with_plan",
        "move_with_json_plan",
        "preserve_ties",
        "preserve_ties_with_json_plan",
        "mixin",
        "mixin_load",
    ],
)
def test_a_conversion_refuses_a_view_in_another_dtype_before_converting(how: str) -> None:
    """After a move b.bits was a copy of its own, without a word (probe)."""
    model = with_int_view(MixinModule() if how.startswith("mixin") else nn.Module())
    before = snapshot(model)
    with pytest.raises(TieError, match=r"'b\.bits' \(int32\) views the memory of 'a\.w' \(float32\) in another dtype"):
        convert(model, how)
    assert_unchanged(model, before)
    assert same_memory(model.b.bits, model.a.w)


@pytest.mark.parametrize("meta", [False, True], ids=["real", "meta"])
def test_a_model_with_a_view_in_another_dtype_saves_and_loads(tmp_path: Path, meta: bool) -> None:
    saved = with_int_view(nn.Module())
    tiekit.save_model(saved, tmp_path / "m.safetensors")
    with torch.device("meta" if meta else "cpu"):
        model = with_int_view(nn.Module())
    if not meta:
        with torch.no_grad():
            model.a.w.zero_()
    tiekit.load_model(model, tmp_path / "m.safetensors")
    assert torch.equal(model.a.w, saved.a.w) and torch.equal(model.b.bits, saved.b.bits)
    assert same_memory(model.b.bits, model.a.w) != meta  # loaded in place; from meta each is its own


# -- load_state_dict(assign=True) of a mixin model ---------------------------------------------


class TiedLM(tiekit.TPUMixin, nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_an_assign_load_leaving_out_a_tied_name_ties_it_to_the_loaded_tensor_of_another_dtype(swap_flag: bool) -> None:
    """The state dict of safetensors.load_file on a tiekit file, in float32, into a bfloat16 model:
    the mixin raised 'head.weight is torch.bfloat16 but its tie source embed.weight is
    torch.float32' after torch had replaced embed.weight, leaving the model untied (probe)."""
    state = {"embed.weight": torch.randn(10, 4)}
    model = TiedLM().to(torch.bfloat16)
    model.load_state_dict(state, strict=False, assign=True)
    assert model.head.weight is model.embed.weight
    assert model.embed.weight.dtype == torch.float32 and torch.equal(model.embed.weight, state["embed.weight"])

    views = ViewOfWeight().to(torch.bfloat16)  # the view buffer left out follows the loaded source
    views.load_state_dict({"w": torch.randn(4, 6)}, strict=False, assign=True)
    assert views.wt.dtype == torch.float32 and same_memory(views.wt, views.w) and torch.equal(views.wt, views.w.t())


def test_an_assign_load_giving_only_a_tied_name_ties_the_source_to_it() -> None:
    """The source kept its old tensor and the tied name was re-pointed at it: the loaded values were lost."""
    state = {"head.weight": torch.randn(10, 4)}
    model = TiedLM()
    model.load_state_dict(state, strict=False, assign=True)
    assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, state["head.weight"])


def test_an_assign_load_of_both_names_of_a_tie_in_agreement_loads() -> None:
    source = TiedLM()
    for state in (source.state_dict(), {k: v.clone() for k, v in source.state_dict().items()}):
        model = TiedLM()
        model.load_state_dict(state, assign=True)
        assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, source.embed.weight)


@pytest.mark.parametrize(
    "build,state,match",
    [
        (
            TiedLM,
            lambda: {"embed.weight": torch.randn(10, 4), "head.weight": torch.randn(10, 4).bfloat16()},
            r"'head\.weight' and 'embed\.weight' differ \(dtype torch\.bfloat16 and torch\.float32\)",
        ),
        (
            TiedLM,
            lambda: {"embed.weight": torch.randn(10, 4), "head.weight": torch.randn(10, 4)},
            r"'head\.weight' and 'embed\.weight' differ \(values\), but in the model 'head\.weight' is the same tensor",
        ),
        (
            ViewOfWeight,
            lambda: {"w": torch.randn(4, 6), "wt": torch.randn(6, 4)},
            r"'wt' and 'w' differ \(values\), but in the model 'wt' is a view of it",
        ),
        (ViewOfWeight, lambda: {"wt": torch.randn(6, 4)}, r"gives 'wt', a view of 'w', without 'w'"),
        *[
            (build, lambda: {"w": torch.randn(6, 4).t()}, r"'w' is not contiguous, so 'wt' cannot be rebuilt")
            for build in (ViewOfWeight, lambda: ViewOfWeight(persistent=False))
        ],
    ],
    ids=["dtypes", "values", "view_values", "view_alone", "noncontiguous_source", "noncontiguous_source_nonpersistent"],
)
def test_an_assign_load_that_cannot_be_one_tie_is_refused_before_loading(build, state, match: str) -> None:  # type: ignore[no-untyped-def]
    """Both names given in different dtypes raised only after torch's load had changed the model;
    in different values the source's silently won. A source that is not contiguous, given
    without its view, was refused by retie only after torch had assigned it (probe)."""
    model = build()
    before = snapshot(model)
    with pytest.raises(TieError, match=match):
        model.load_state_dict(state(), strict=False, assign=True)
    assert_unchanged(model, before)


# -- a mixin model loaded through a module holding it ------------------------------------------


def holding(model: nn.Module, how: str) -> nn.Module:
    """``model`` inside a plain container, or wrapped by torch.compile (not compiled until called)."""
    return nn.Sequential(model) if how == "sequential" else torch.compile(model)  # type: ignore[return-value]


@pytest.mark.parametrize("how", ["sequential", "compile"])
def test_a_mixin_model_held_by_another_module_keeps_its_tie_through_an_assign_load(how: str, swap_flag: bool) -> None:
    """torch loads a held module through its _load_from_state_dict, never calling the mixin's
    load_state_dict: head.weight kept the old tensor, embed.weight got the new one (probe)."""
    model = TiedLM()
    outer = holding(model, how)
    state = {k: torch.randn_like(v) for k, v in outer.state_dict().items()}
    key = next(k for k in state if k.endswith("embed.weight"))
    state[key.replace("embed", "head")] = state[key]
    outer.load_state_dict(state, assign=True)
    assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, state[key])


def test_an_assign_load_through_a_container_that_cannot_be_one_tie_is_refused_before_loading() -> None:
    model = TiedLM()
    before = snapshot(model)
    state = {"0.embed.weight": torch.randn(10, 4), "0.head.weight": torch.randn(10, 4)}
    with pytest.raises(TieError, match=r"'head\.weight' and 'embed\.weight' differ \(values\)"):
        nn.Sequential(model).load_state_dict(state, assign=True)
    assert_unchanged(model, before)


class TiedLMWithHead(tiekit.TPUMixin, nn.Module):
    """A mixin model holding a mixin model, tied across the two."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TiedLM()
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.lm.embed.weight


def test_a_mixin_model_inside_a_mixin_model_is_re_tied_by_the_outer_one() -> None:
    model = TiedLMWithHead()
    state = {"lm.embed.weight": torch.randn(10, 4)}
    nn.Sequential(model).load_state_dict({f"0.{k}": v for k, v in state.items()}, strict=False, assign=True)
    assert model.out.weight is model.lm.embed.weight is model.lm.head.weight
    assert torch.equal(model.out.weight, state["lm.embed.weight"])


class Failing(nn.Module):
    def _load_from_state_dict(self, *args: object) -> None:
        raise ValueError("this module cannot load")


def test_an_assign_load_that_failed_half_way_does_not_stop_the_next_one() -> None:
    """The mixin's check before a load leaves its plan for the re-tie after it; a load that raises
    in between must not leave the next load thinking another mixin module handles it."""
    broken = TiedLM()
    broken.extra = Failing()
    with pytest.raises(ValueError, match="cannot load"):
        broken.load_state_dict(TiedLM().state_dict(), strict=False, assign=True)
    model = TiedLM()
    state = {"0.embed.weight": torch.randn(10, 4)}
    nn.Sequential(model).load_state_dict(state, strict=False, assign=True)
    assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, state["0.embed.weight"])


# -- strict loads of a mixin model whose state dict leaves tied names out -----------------------


@pytest.mark.parametrize("assign", [True, False], ids=["assign", "in_place"])
@pytest.mark.parametrize("given", ["source", "tied_name", "view_source"])
def test_a_strict_load_leaving_out_tied_names_its_tie_fills_loads(given: str, assign: bool, swap_flag: bool) -> None:
    """The state dict of safetensors.load_file on a tiekit file, with the default strict=True:
    torch raised 'Missing key(s)' for head.weight after it had assigned embed.weight, and the
    mixin never re-tied: the model was left untied and half-loaded (probe)."""
    model: nn.Module = ViewOfWeight() if given == "view_source" else TiedLM()
    name = {"source": "embed.weight", "tied_name": "head.weight", "view_source": "w"}[given]
    state = {name: torch.randn_like(model.get_parameter(name))}
    result = model.load_state_dict(state, assign=assign)
    assert result.missing_keys == [] and result.unexpected_keys == []
    if given == "view_source":
        assert same_memory(model.wt, model.w) and torch.equal(model.wt, state["w"].t())
    else:
        assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, state[name])


def test_a_strict_load_of_a_de_duplicated_file_loads(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    saved = TiedLM()
    tiekit.save_model(saved, tmp_path / "m.safetensors")
    state = load_file(tmp_path / "m.safetensors")
    assert list(state) == ["embed.weight"]
    model = TiedLM()
    model.load_state_dict(state, assign=True)
    assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, saved.embed.weight)


@pytest.mark.parametrize("assign", [True, False], ids=["assign", "in_place"])
def test_a_strict_load_missing_other_keys_raises_as_torch_does_with_the_ties_restored(assign: bool) -> None:
    """Through a container, so that the names carry its prefix: only the keys nothing filled are
    reported, in torch's words, after the load (as torch's own strict load)."""
    model = TiedLM()
    outer = nn.Sequential(model, nn.Linear(2, 2))
    state = {"0.embed.weight": torch.randn(10, 4), "stale.key": torch.zeros(1)}
    message = 'Missing key(s) in state_dict: "1.weight", "1.bias". \n\tUnexpected key(s) in state_dict: "stale.key". '
    with pytest.raises(RuntimeError, match=re.escape(message)):
        outer.load_state_dict(state, assign=assign)
    assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, state["0.embed.weight"])
    result = outer.load_state_dict(state, strict=False, assign=assign)
    assert result.missing_keys == ["1.weight", "1.bias"] and result.unexpected_keys == ["stale.key"]


def test_a_strict_assign_load_with_an_unexpected_key_raises_with_the_ties_restored() -> None:
    """torch raised after assigning both names of the tie: head.weight was no longer embed.weight (probe)."""
    state = {k: v.clone() for k, v in TiedLM().state_dict().items()} | {"stale.key": torch.zeros(1)}
    model = TiedLM()
    with pytest.raises(RuntimeError, match=re.escape('Unexpected key(s) in state_dict: "stale.key"')):
        model.load_state_dict(state, assign=True)
    assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, state["embed.weight"])


def test_a_load_in_place_leaves_a_declared_tie_it_does_not_apply_missing() -> None:
    """A declared tie not applied yet: copying into embed.weight does not fill head.weight."""

    class Declared(tiekit.TPUMixin, nn.Module):
        tied_weights: ClassVar[dict[str, str]] = {"head.weight": "embed.weight"}

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)

    model = Declared()
    result = model.load_state_dict({"embed.weight": torch.randn(10, 4)}, strict=False)
    assert result.missing_keys == ["head.weight"]


class TwoLayers(tiekit.TPUMixin, nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)


@pytest.mark.parametrize("moved_before", [False, True])
def test_memory_shared_by_a_data_assignment_is_kept_after_forget_plans(moved_before: bool) -> None:
    """A cached plan is re-checked only for the ties it knows: sharing made by ``.data =`` after
    it was cached made two copies on the next move (probe). Documented: call forget_plans()."""
    model = TwoLayers()
    if moved_before:
        model.double()
    model.b.weight.data = model.a.weight.data
    tiekit.mixin.forget_plans()
    model.float()
    assert same_memory(model.a.weight, model.b.weight)


# -- loads that fail half way, hooks of the model's own, threads, FSDP2 entries ------------------


class FailsOnce(nn.Module):
    """A module whose own load step raises the first time (as a broken pre hook or a Ctrl-C would)."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def _load_from_state_dict(self, *args: object) -> None:
        if not self.failed:
            self.failed = True
            raise ValueError("this module cannot load")


class SplitByAFailure(tiekit.TPUMixin, nn.Module):
    """embed, then a module that fails, then head tied to embed: a failed assign-load has assigned
    embed and not yet head, so the tie is split."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.fails = FailsOnce()
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("through", ["model", "container"])
def test_an_assign_load_that_raised_half_way_leaves_the_tie_restorable(through: str) -> None:
    """The load's post hook never runs when it raises: loaded on the model itself, its
    load_state_dict re-ties at once; through a container, the next load (or move) does, from the
    failed load's plan. It was lost for good: a new plan no longer saw the split tie."""
    model = SplitByAFailure()
    state = {"embed.weight": torch.randn(10, 4)}
    loading = model if through == "model" else nn.Sequential(model)
    prefix = "" if through == "model" else "0."
    with pytest.raises(ValueError, match="cannot load"):
        loading.load_state_dict({prefix + k: v for k, v in state.items()}, strict=False, assign=True)
    if through == "model":
        assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, state["embed.weight"])
    again = {prefix + "embed.weight": torch.randn(10, 4)}
    loading.load_state_dict(again, strict=False, assign=True)
    assert model.head.weight is model.embed.weight and len(list(model.parameters())) == 1
    assert torch.equal(model.head.weight, again[prefix + "embed.weight"])


def test_a_load_hook_the_model_registered_first_sees_it_loaded_and_tied() -> None:
    """The mixin's post hook is registered at the first load; it runs before the model's own hooks,
    which saw head.weight missing and the tie split."""
    seen: list[tuple[list[str], bool]] = []

    class Hooked(TiedLM):
        def __init__(self) -> None:
            super().__init__()
            self.register_load_state_dict_post_hook(
                lambda module, keys: seen.append((list(keys.missing_keys), module.head.weight is module.embed.weight))
            )

    model = Hooked()
    for _ in range(2):
        model.load_state_dict({"embed.weight": torch.randn(10, 4)}, assign=True)
    assert seen == [([], True), ([], True)]


FSDP_ENTRIES = """
import os, torch, torch.distributed as dist
from torch import nn
import tiekit

class TiedLM(tiekit.TPUMixin, nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

dist.init_process_group("gloo", rank=0, world_size=1)
model = TiedLM()
tiekit.shard(model)
state = {k: v.detach() * 0 + 3 for k, v in model.state_dict().items()}
state["head.weight"] = state["head.weight"] * 0 + 7
try:
    model.load_state_dict(state, assign=True)
    print("loaded")
except tiekit.TieError as exc:
    print("refused", "head.weight" in str(exc), model.head.weight is model.embed.weight)
del model  # the sharded model and torch 2.14's DTensor caches keep the group past its destruction,
tiekit.clear_dtensor_caches()  # and gloo can abort the process at exit (docs/launching.md)
dist.destroy_process_group()
"""


def test_fsdp2_entries_of_one_tie_that_differ_are_refused(tmp_path: Path) -> None:
    """DTensor entries (FSDP2) report a data pointer of 0, so any two counted as one memory and were
    never compared: head.weight's values were dropped without a word. A 1-rank gloo group."""
    import subprocess
    import sys

    from launching import TIMEOUT, base_env, free_port

    script = tmp_path / "fsdp_entries.py"
    script.write_text(FSDP_ENTRIES)
    env = base_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-3:] == ["refused", "True", "True"], done.stdout


# -- a torch.compile'd model -------------------------------------------------------------------


def test_a_compiled_transformers_model_saves_moves_and_keeps_its_tie(tmp_path: Path) -> None:
    """transformers' declared ties were read through the compile wrapper, which forwards the
    attribute: their names lacked ``_orig_mod.`` and every call raised a bare KeyError (probe;
    accelerate's unwrap_model keeps the wrapper under --dynamo_backend)."""
    from models import gpt2

    compiled = torch.compile(gpt2(), backend="eager")  # compiles at its first forward: none here
    plan = tiekit.find_ties(compiled)
    assert [g.names for g in plan.groups] == [("_orig_mod.transformer.wte.weight", "_orig_mod.lm_head.weight")]
    tiekit.save_model(compiled, tmp_path / "m.safetensors")
    tiekit.save_checkpoint(tmp_path / "c.safetensors", model=compiled, step=1)
    with tiekit.preserve_ties(compiled):  # without tiekit, an assign-load of separate tensors unties
        compiled.load_state_dict({k: v.clone() for k, v in compiled.state_dict().items()}, assign=True)
    tiekit.move(compiled, dtype=torch.float64)
    inner = compiled._orig_mod
    assert inner.lm_head.weight is inner.transformer.wte.weight and inner.lm_head.weight.dtype == torch.float64
    result = tiekit.load_model(compiled, tmp_path / "m.safetensors")
    assert result.missing == () and inner.lm_head.weight is inner.transformer.wte.weight

    untied = torch.compile(gpt2(), backend="eager")
    untied.load_state_dict({k: v.clone() for k, v in untied.state_dict().items()}, assign=True)  # the control
    assert untied._orig_mod.lm_head.weight is not untied._orig_mod.transformer.wte.weight


def test_a_declared_name_found_only_through_a_wrapper_is_a_tie_error() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

        def __getattr__(self, name: str) -> object:
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.inner, name)

    with pytest.raises(TieError, match=r"has no tensor named '1\.weight' \(a wrapper forwarded the name"):
        tiekit.find_ties(Wrapper(), declared={"1.weight": "0.weight"})
