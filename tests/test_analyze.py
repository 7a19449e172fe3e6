"""find_ties: identity aliases, buffers, views, meta, None, nesting, declared ties, tracing, values."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from models import ViewBuffers, WeightSharingModule, albert, gpt2, llama, t5
from torch import nn

import tiekit
from tiekit import TieError, find_ties


def names_of(plan: tiekit.TiePlan) -> list[tuple[str, ...]]:
    return [g.names for g in plan.groups]


def test_seed_weight_sharing_module_has_one_group_and_two_unique_parameters() -> None:
    model = WeightSharingModule()
    plan = find_ties(model)
    assert names_of(plan) == [("layer_1.weight", "layer_3.weight")]
    group = plan.groups[0]
    assert (group.source, group.kind, group.shape, group.dtype) == ("layer_1.weight", "parameter", (10, 32), "float32")
    assert (plan.unique_count, plan.total_count) == (2, 3)
    assert plan.unique_count == len(list(model.parameters()))
    assert plan.source_of("layer_3.weight") == "layer_1.weight"
    assert plan.source_of("layer_2.weight") == "layer_2.weight"
    assert plan.tied_names == ("layer_3.weight",)


def test_untied_model_has_no_groups() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    plan = find_ties(model)
    assert len(plan) == 0 and plan.unique_count == plan.total_count == 4


def test_module_registered_twice_and_modulelist_reuse() -> None:
    block = nn.Linear(4, 4)
    model = nn.Module()
    model.a = block
    model.b = block
    model.stack = nn.ModuleList([block, nn.Linear(4, 4), block])
    plan = find_ties(model)
    assert names_of(plan) == [
        ("a.weight", "b.weight", "stack.0.weight", "stack.2.weight"),
        ("a.bias", "b.bias", "stack.0.bias", "stack.2.bias"),
    ]
    assert plan.unique_count == 4 == len(list(model.parameters()))
    assert plan.total_count == 10 == len(list(model.named_parameters(remove_duplicate=False)))


def test_tied_buffers_and_buffers_flag() -> None:
    model = nn.Module()
    model.x = nn.Module()
    model.y = nn.Module()
    table = torch.arange(6.0)
    model.x.register_buffer("table", table)
    model.y.register_buffer("table", table)
    plan = find_ties(model)
    assert names_of(plan) == [("x.table", "y.table")]
    assert plan.groups[0].kind == "buffer"
    assert len(find_ties(model, buffers=False)) == 0


def test_view_buffers_record_geometry() -> None:
    model = ViewBuffers()
    plan = find_ties(model)
    assert len(plan) == 1
    group = plan.groups[0]
    assert group.kind == "view" and group.source == "w"
    assert group.names == ("w", "wt", "ws", "wv")
    geometry = {m.name: m.view for m in group.members}
    assert geometry["w"] is None
    assert geometry["wt"] == tiekit.ViewGeometry(0, (6, 4), (1, 6))
    assert geometry["ws"] == tiekit.ViewGeometry(2, (4, 3), (6, 1))
    assert geometry["wv"] == tiekit.ViewGeometry(0, (24,), (1,))


def test_view_registered_before_its_base_still_uses_the_base_as_source() -> None:
    model = nn.Module()
    base = torch.randn(3, 5)
    model.register_buffer("first_view", base[1:, 1:3])
    model.register_buffer("base", base)
    plan = find_ties(model)
    assert plan.groups[0].source == "base"
    assert plan.groups[0].names == ("base", "first_view")
    assert plan.groups[0].member("first_view").view == tiekit.ViewGeometry(6, (2, 2), (5, 1))


def test_disjoint_slices_of_an_unregistered_base_are_not_tied() -> None:
    model = nn.Module()
    base = torch.randn(10)
    model.register_buffer("low", base[:5])
    model.register_buffer("high", base[5:])
    assert len(find_ties(model)) == 0


def test_parameter_that_is_a_view_of_another_parameter() -> None:
    model = nn.Module()
    model.big = nn.Parameter(torch.randn(8, 4))
    model.part = nn.Parameter(model.big.data[2:4])
    plan = find_ties(model)
    member = plan.groups[0].member("part")
    assert member.kind == "parameter" and member.view == tiekit.ViewGeometry(8, (2, 4), (4, 1))
    assert member.requires_grad


def test_meta_device_identity_and_views() -> None:
    with torch.device("meta"):
        model = WeightSharingModule()
        views = ViewBuffers()
    assert names_of(find_ties(model)) == [("layer_1.weight", "layer_3.weight")]
    plan = find_ties(views)
    assert plan.groups[0].names == ("w", "wt", "ws", "wv")
    assert plan.groups[0].member("ws").view == tiekit.ViewGeometry(2, (4, 3), (6, 1))


def test_none_parameters_and_buffers_are_skipped() -> None:
    model = nn.Module()
    model.lin = nn.Linear(3, 3, bias=False)  # registers bias=None
    model.register_buffer("nothing", None)
    model.other = nn.Linear(3, 3, bias=False)
    model.other.weight = model.lin.weight
    plan = find_ties(model)
    assert names_of(plan) == [("lin.weight", "other.weight")]
    assert plan.total_count == 2


def test_nested_moduledict_and_modulelist() -> None:
    shared = nn.Embedding(5, 3)
    model = nn.ModuleDict(
        {
            "enc": nn.ModuleList([nn.ModuleDict({"emb": shared})]),
            "dec": nn.ModuleDict({"inner": nn.ModuleList([shared])}),
        }
    )
    plan = find_ties(model)
    assert names_of(plan) == [("enc.0.emb.weight", "dec.inner.0.weight")]


def test_group_order_follows_registration_order() -> None:
    model = nn.Module()
    model.a = nn.Linear(2, 2)
    model.b = nn.Linear(2, 2)
    model.c = nn.Linear(2, 2)
    model.d = nn.Linear(2, 2)
    model.d.bias = model.a.bias
    model.c.weight = model.b.weight
    model.d.weight = model.a.weight
    assert [g.source for g in find_ties(model).groups] == ["a.weight", "a.bias", "b.weight"]


@pytest.mark.newest_torch_only  # the plan's own ordering, the same on both stacks: run once
def test_group_order_is_the_same_in_another_process() -> None:
    code = (
        "import sys; sys.path.insert(0, 'tests'); import torch; torch.manual_seed(0); "
        "import tiekit; from models import t5; print(tiekit.find_ties(t5()).to_json())"
    )
    started = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in started]  # two at once: each mostly imports
    assert [p.returncode for p in started] == [0, 0]
    runs = set(outputs)
    in_process = find_ties(t5()).to_json()
    assert runs == {in_process + "\n"}


def test_large_tree_does_not_recurse_too_deep() -> None:
    model: nn.Module = nn.Linear(2, 2)
    head = model
    for _ in range(400):  # named_modules recursion is per level; 400 levels stays well inside limits
        model = nn.Sequential(model)
    model.add_module("tail", head)
    plan = find_ties(model)
    assert len(plan) == 2 and plan.unique_count == 2


# -- HF models built from configs --------------------------------------------------------


def test_gpt2_wte_lm_head() -> None:
    plan = find_ties(gpt2())
    assert names_of(plan) == [("transformer.wte.weight", "lm_head.weight")]


def test_llama_tie_word_embeddings() -> None:
    plan = find_ties(llama())
    assert names_of(plan) == [("model.embed_tokens.weight", "lm_head.weight")]


def test_t5_shared_encoder_decoder_lm_head() -> None:
    plan = find_ties(t5())
    assert names_of(plan) == [
        ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight")
    ]


def test_albert_shared_layer_and_mlm_decoder() -> None:
    model = albert()
    plan = find_ties(model)
    # ALBERT shares its transformer layer by calling one module repeatedly, not by aliasing
    # names: its parameters appear once. The MLM decoder is tied to the word embeddings.
    assert names_of(plan) == [
        ("albert.embeddings.word_embeddings.weight", "predictions.decoder.weight"),
        ("predictions.bias", "predictions.decoder.bias"),
    ]
    assert plan.unique_count == len(list(model.parameters()))


# -- declared ties --------------------------------------------------------------------------


def test_declared_ties_merge_into_the_plan() -> None:
    model = nn.Module()
    model.emb = nn.Embedding(6, 4)
    model.head = nn.Linear(4, 6, bias=False)
    plan = find_ties(model, declared={"head.weight": "emb.weight"})
    assert names_of(plan) == [("emb.weight", "head.weight")]
    assert plan.unique_count == 1  # what the model will have once the declared tie is applied


def test_declared_tie_conflicting_with_a_detected_tie_is_an_error() -> None:
    model = WeightSharingModule()
    model.layer_4 = nn.Linear(32, 10, bias=False)
    with pytest.raises(TieError, match=r"conflicts with the detected tie 'layer_3\.weight' = 'layer_1\.weight'"):
        find_ties(model, declared={"layer_3.weight": "layer_4.weight"})


def test_declared_tie_errors_name_the_path() -> None:
    model = WeightSharingModule()
    with pytest.raises(TieError, match=r"'layer_9\.weight'"):
        find_ties(model, declared={"layer_9.weight": "layer_1.weight"})
    with pytest.raises(TieError, match=r"'layer_2\.weight' is \(32, 10\)"):
        find_ties(model, declared={"layer_2.weight": "layer_1.weight"})
    with pytest.raises(TieError, match="no parameter or buffer 'bias'"):
        find_ties(model, declared={"layer_2.bias": "layer_1.weight"})


# -- tracing -----------------------------------------------------------------------------


class FunctionalHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.embed(x))
        return self.head(h) + nn.functional.linear(h, self.embed.weight)


def test_trace_records_call_sites_and_cross_module_reads() -> None:
    plan = find_ties(FunctionalHead(), trace=True)
    assert plan.trace_status.startswith("traced with torch.fx")
    uses = plan.groups[0].uses
    assert tiekit.TieUse("call_module", "embed", "embed") in uses
    assert tiekit.TieUse("call_module", "head", "head") in uses
    assert tiekit.TieUse("get_attr", "embed.weight", "") in uses
    assert plan.cross_module == (tiekit.CrossModuleUse("embed.weight", ""),)


def test_trace_resolves_by_identity_not_by_fx_names() -> None:
    # fx names the tied tensor after its first name; reading it as self.head.weight must
    # still land on the group and not invent an untied "head.weight".
    class ReadsHead(FunctionalHead):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(self.embed(x), self.head.weight.t())

    plan = find_ties(ReadsHead(), trace=True)
    assert [u for u in plan.groups[0].uses if u.op == "get_attr"] == [tiekit.TieUse("get_attr", "embed.weight", "")]


def test_untraceable_model_reports_instead_of_raising() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent control flow: fx cannot trace this
                return self.lin(x)
            return x

    plan = find_ties(Branchy(), trace=True)
    assert plan.trace_status.startswith("not traceable: TraceError")
    assert plan.groups == find_ties(Branchy()).groups  # the ties themselves are still found


def test_trace_with_export_on_gpt2() -> None:
    model = gpt2()
    plan = find_ties(model, trace=True)
    assert plan.trace_status.startswith("not traceable")  # HF models defeat symbolic_trace
    plan = find_ties(model, trace=True, example_inputs=(torch.zeros(1, 8, dtype=torch.long),))
    assert plan.trace_status.startswith("traced with torch.export")
    readers = {u.module for u in plan.groups[0].uses}
    assert readers == {"transformer.wte", "lm_head"}
    assert plan.cross_module == ()


# -- suspected broken ties ---------------------------------------------------------------


def test_check_values_reports_broken_copies_apart_from_ties() -> None:
    model = WeightSharingModule()
    model.layer_4 = nn.Linear(32, 10, bias=False)
    with torch.no_grad():
        model.layer_4.weight.copy_(model.layer_1.weight)  # what a tie broken by a move looks like
    model.norm_a = nn.LayerNorm(10)  # all-ones weights: equal by construction, not suspects
    model.norm_b = nn.LayerNorm(10)
    plan = find_ties(model, check_values=True)
    assert names_of(plan) == [("layer_1.weight", "layer_3.weight")]
    assert plan.suspected == (("layer_1.weight", "layer_4.weight"),)
    assert find_ties(model).suspected == ()


def test_check_values_on_bfloat16_and_meta() -> None:
    model = nn.Module()
    model.a = nn.Parameter(torch.randn(3, 3, dtype=torch.bfloat16))
    model.b = nn.Parameter(model.a.detach().clone())
    assert find_ties(model, check_values=True).suspected == (("a", "b"),)
    with torch.device("meta"):
        meta = WeightSharingModule()
    assert find_ties(meta, check_values=True).suspected == ()


def test_cyclic_module_graph_is_a_tie_error() -> None:
    outer = nn.Module()
    inner = nn.Module()
    outer.inner = inner
    inner.back = outer
    with pytest.raises(TieError, match="cycle"):
        find_ties(outer)


def test_lazy_and_sparse_tensors() -> None:
    model = nn.Sequential(nn.LazyLinear(3), nn.Linear(3, 3))
    assert len(find_ties(model, check_values=True)) == 0  # uninitialized and untied: nothing to say
    model[1].bias = model[0].bias
    with pytest.raises(TieError, match=r"'0\.bias' is tied to '1\.bias' but is an uninitialized lazy"):
        find_ties(model)
    sparse = nn.Module()
    sparse.register_buffer("a", torch.eye(3).to_sparse())
    sparse.register_buffer("b", sparse.a)
    assert [g.names for g in find_ties(sparse, check_values=True).groups] == [("a", "b")]


def test_ties_found_whatever_the_allocation_order() -> None:
    # find_ties settles identity by sorting ids; tensors allocated in reverse registration order
    # (the source created last) and a shuffled mix must give the same groups as a brute force.
    params = [nn.Parameter(torch.randn(2)) for _ in range(40)]
    model = nn.Module()
    order = list(range(40))[::-1]
    for i, j in enumerate(order):
        model.register_parameter(f"p{i}", params[j])
    for i in range(10):  # ten late aliases of early names
        model.register_parameter(f"alias{i}", params[order[3 * i]])
    model.register_buffer("buf", params[order[0]].data)  # same storage, not the same object
    plan = find_ties(model)
    expected = {(f"p{3 * i}", f"alias{i}") for i in range(1, 10)}
    assert {g.names for g in plan.groups if g.kind == "parameter"} == expected
    (view,) = [g for g in plan.groups if g.kind == "view"]
    assert set(view.names) == {"p0", "alias0", "buf"}
    assert (plan.unique_count, plan.total_count) == (40, 50)
    assert plan.unique_count == len(list(model.parameters()))


def test_a_tensor_registered_as_buffer_first_and_parameter_later_counts_once() -> None:
    model = nn.Module()
    shared = nn.Parameter(torch.randn(3))
    model.a = nn.Module()
    model.a.register_buffer("b", shared)
    model.c = nn.Module()
    model.c.w = shared
    model.c.v = nn.Parameter(torch.randn(3))
    plan = find_ties(model)
    assert [g.names for g in plan.groups] == [("c.w", "a.b")]  # the parameter name is the source
    assert (plan.unique_count, plan.total_count) == (2, 2)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: find_ties(None), TieError, "expected a torch.nn.Module, got NoneType"),
        (lambda: find_ties(nn.Linear(2, 2), declared=["a"]), TieError, "({target: source}), not a list"),
        (lambda: tiekit.move("model", "cpu"), TieError, "expected a torch.nn.Module, got str"),
        (lambda: tiekit.preserve_ties(None).__enter__(), TieError, "expected a torch.nn.Module, got NoneType"),
        (
            lambda: tiekit.save_model(None, "unused.safetensors"),
            tiekit.CheckpointError,
            "tiekit.save_model(model, path): model must be a torch.nn.Module, not None",
        ),
    ],
)
def test_a_wrong_type_is_a_tiekit_error_naming_it(call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as raised:
        call()
    assert message in str(raised.value)


def test_a_plan_of_the_wrong_type_or_model_is_refused_before_anything_changes() -> None:
    model = WeightSharingModule()
    weight = model.layer_1.weight
    for call in (lambda: tiekit.retie(model, None), lambda: tiekit.verify(model, {"groups": []})):  # type: ignore[arg-type]
        with pytest.raises(TieError, match=r"plan must be a TiePlan .*, not a (NoneType|dict)"):
            call()
    other = find_ties(gpt2())
    with pytest.raises(TieError, match=r"'transformer.wte.weight'"), tiekit.preserve_ties(model, plan=other):
        model.to(torch.float64)  # refused on entry: the block never ran (it ran before, then failed on exit)
    with pytest.raises(TieError, match=r"'transformer.wte.weight'"):
        tiekit.move(model, dtype=torch.float64, plan=other)
    assert model.layer_1.weight is weight and weight.dtype == torch.float32
