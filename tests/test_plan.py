"""TiePlan: immutability, queries, serialization round trips, errors, str; hypothesis vs brute force."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import ViewBuffers, WeightSharingModule, gpt2, t5
from torch import nn

import tiekit
from tiekit import TieError, TiePlan, find_ties


def test_plan_is_immutable() -> None:
    plan = find_ties(WeightSharingModule())
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.unique_count = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.groups[0].source = "x"  # type: ignore[misc]
    assert isinstance(plan.groups, tuple) and isinstance(plan.groups[0].names, tuple)


@pytest.mark.parametrize("build", [WeightSharingModule, ViewBuffers, t5])
def test_dict_and_json_round_trips(build) -> None:  # type: ignore[no-untyped-def]
    plan = find_ties(build(), check_values=True)
    assert TiePlan.from_dict(plan.to_dict()) == plan
    assert TiePlan.from_json(plan.to_json()) == plan
    assert TiePlan.from_json(plan.to_json()).to_json() == plan.to_json()
    assert json.loads(plan.to_json())["version"] == tiekit.PLAN_VERSION


def test_traced_plan_round_trips() -> None:
    model = gpt2()
    plan = find_ties(model, trace=True, example_inputs=(torch.zeros(1, 4, dtype=torch.long),))
    assert plan.groups[0].uses
    assert TiePlan.from_json(plan.to_json()) == plan


def test_equality_and_membership() -> None:
    a, b = find_ties(WeightSharingModule()), find_ties(WeightSharingModule())
    assert a == b and hash(a.groups) == hash(b.groups)
    assert "layer_3.weight" in a and "layer_2.weight" not in a
    assert a.group_of("layer_3.weight") is a.groups[0] and a.group_of("layer_2.weight") is None
    assert a != find_ties(t5())


def test_newer_version_is_refused_with_advice() -> None:
    data = find_ties(WeightSharingModule()).to_dict()
    data["version"] = tiekit.PLAN_VERSION + 1
    with pytest.raises(TieError, match="newer than this tiekit understands"):
        TiePlan.from_dict(data)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("groups"),
        lambda d: d["groups"][0].update(kind="weird"),
        lambda d: d["groups"][0].update(shape=["a"]),
        lambda d: d["groups"][0]["members"].reverse(),
        lambda d: d.update(unique_count=True),
        lambda d: d.update(version="1"),
        lambda d: d["groups"].append(d["groups"][0]),
    ],
)
def test_malformed_plans_raise_tie_error(mutate) -> None:  # type: ignore[no-untyped-def]
    data = find_ties(WeightSharingModule()).to_dict()
    mutate(data)
    with pytest.raises(TieError):
        TiePlan.from_dict(data)


def member(data: dict, name: str) -> dict:  # type: ignore[type-arg]
    return next(m for m in data["groups"][0]["members"] if m["name"] == name)  # type: ignore[no-any-return]


def view_member(data: dict, name: str) -> dict:  # type: ignore[type-arg]
    return member(data, name)["view"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: view_member(d, "wt").update(stride=[-1, 6]), "view member 'wt': field 'stride' is -1"),
        (lambda d: view_member(d, "ws").update(size=[-4, 3]), "view member 'ws': field 'size' is -4"),
        (lambda d: view_member(d, "wv").update(offset=-2), "view member 'wv': field 'offset' is -2"),
        (lambda d: view_member(d, "wv").update(stride={"0": 1}), "view member 'wv': field 'stride' is {'0': 1}"),
        (lambda d: d.update(version=True), "field 'version' is True"),
        (lambda d: d.update(groups={}), "field 'groups' is {}, not a list"),
        (lambda d: d["groups"][0].update(dtype="float99"), "tie group 'w': field 'dtype' is 'float99', not a torch"),
        # getattr(torch, "float") is torch.float32, but plans and files spell it "float32".
        (lambda d: d["groups"][0].update(dtype="float"), "tie group 'w': field 'dtype' is 'float', an alias of"),
        (lambda d: d["groups"][0].update(shape=[4, -6]), "tie group 'w': field 'shape' is -6"),
        (lambda d: d.update(total_count=-1), "field 'total_count' is -1"),
        # A string iterates as its characters: "ab" read as the suspected names "a" and "b".
        (lambda d: d.update(suspected="ab"), "field 'suspected' is 'ab', not a list"),
        (lambda d: d.update(suspected=["ab"]), "field 'suspected' has an entry 'ab', not a list of strings"),
        (lambda d: d.update(cross_module=["ab"]), "field 'cross_module' has an entry 'ab', not a list of 2"),
        (lambda d: d["groups"][0].update(uses=["abc"]), "tie group 'w': field 'uses' has an entry 'abc'"),
        # bool("false") is True.
        (lambda d: member(d, "wt").update(requires_grad="false"), "member 'wt': field 'requires_grad' is 'false'"),
        # Named "in two tie groups ('w' and 'w')" before.
        (lambda d: d["groups"][0]["members"].append(member(d, "wt")), "'wt' is listed twice in the tie group of 'w'"),
    ],
)
def test_impossible_plans_are_refused_naming_the_field(mutate, field: str) -> None:  # type: ignore[no-untyped-def]
    # Each of these used to be accepted: a negative stride failed in torch's as_strided only
    # while a load re-tied the model it had already overwritten; "groups": {} read as no ties.
    data = find_ties(ViewBuffers()).to_dict()
    mutate(data)
    with pytest.raises(TieError, match=re.escape(field)):
        TiePlan.from_dict(data)
    with pytest.raises(TieError, match=re.escape(field)):
        TiePlan.from_json(json.dumps(data))


def test_a_python_built_plan_with_a_negative_stride_is_refused_before_anything_is_retied() -> None:
    model = ViewBuffers()
    plan = find_ties(model)
    wt = plan.groups[0].member("wt")
    assert wt.view is not None
    bad_wt = dataclasses.replace(wt, view=dataclasses.replace(wt.view, stride=(-1, 6)))
    group = dataclasses.replace(plan.groups[0], members=(*plan.groups[0].members[:1], bad_wt))
    bad = TiePlan((group,), plan.unique_count, plan.total_count)
    model.wt = model.wt.clone()  # untied, so retie would re-point it
    before = model.wt
    with pytest.raises(TieError, match=r"'wt'.*negative sizes and strides"):
        tiekit.retie(model, bad)
    assert model.wt is before


def test_an_empty_view_reaches_no_element() -> None:
    assert tiekit.plan.strided_extent((3, 0), (10, 1)) == 0  # not 1 + 2 * 10 - 1
    assert tiekit.plan.strided_extent((2, 3), (3, 1)) == 6


@pytest.mark.parametrize("text", ["", "not json", "[]", '{"version": 1}', b"\xff\xfe"])
def test_bad_json_raises_tie_error(text: str) -> None:
    with pytest.raises(TieError):
        TiePlan.from_json(text)


def test_str_is_a_readable_table() -> None:
    text = str(find_ties(gpt2()))
    lines = text.splitlines()
    assert lines[0] == "TiePlan: 1 group(s), 28 unique parameter(s) under 29 name(s)"
    assert lines[1].split() == ["source", "kind", "shape", "dtype", "tied", "names"]
    assert lines[2].split() == ["transformer.wte.weight", "parameter", "96x32", "float32", "lm_head.weight"]


# -- property test: random module trees with random ties, against brute force -------------


def brute_force_groups(model: nn.Module) -> set[frozenset[str]]:
    """Pairwise comparison over every name: same object, or overlapping bytes in memory."""
    named = [
        (f"{p}.{a}" if p else a, t)
        for p, m in model.named_modules(remove_duplicate=False)
        for a, t in [*m._parameters.items(), *m._buffers.items()]
        if t is not None
    ]

    def shares(x: torch.Tensor, y: torch.Tensor) -> bool:
        if x is y:
            return True
        if x.numel() == 0 or y.numel() == 0 or x.dtype != y.dtype:
            return False
        ex = {x.data_ptr() + i * x.element_size() for i in _offsets(x)}
        return any(y.data_ptr() + i * y.element_size() in ex for i in _offsets(y))

    parent = list(range(len(named)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i in range(len(named)):
        for j in range(i + 1, len(named)):
            if shares(named[i][1], named[j][1]):
                parent[root(j)] = root(i)
    groups: dict[int, set[str]] = {}
    for i, (name, _) in enumerate(named):
        groups.setdefault(root(i), set()).add(name)
    return {frozenset(g) for g in groups.values() if len(g) > 1}


def _offsets(t: torch.Tensor) -> list[int]:
    idx = torch.zeros((), dtype=torch.long)
    for size, stride in zip(t.shape, t.stride(), strict=True):
        idx = idx.unsqueeze(-1) + torch.arange(size) * stride
    return idx.reshape(-1).tolist()


@st.composite
def random_models(draw: st.DrawFn) -> nn.Module:
    # Containers hold parameters, buffers and children; Linear leaves are what gets reused,
    # so the module graph is a DAG (torch itself cannot walk a cyclic one).
    root = nn.Module()
    containers = [root]
    leaves: list[nn.Module] = []
    tensors: list[torch.Tensor] = []
    for i in range(draw(st.integers(1, 12))):
        parent = draw(st.sampled_from(containers))
        action = draw(st.sampled_from(["container", "new", "reuse_module", "param", "buffer", "alias", "view", "none"]))
        if action == "container":
            child = nn.Module()
            parent.add_module(f"c{i}", child)
            containers.append(child)
        elif action == "new" or (action == "reuse_module" and not leaves):
            leaf = nn.Linear(draw(st.integers(1, 3)), draw(st.integers(1, 3)), bias=draw(st.booleans()))
            parent.add_module(f"m{i}", leaf)
            leaves.append(leaf)
            tensors.extend(t for t in (leaf.weight, leaf.bias) if t is not None)
        elif action == "reuse_module":
            parent.add_module(f"m{i}", draw(st.sampled_from(leaves)))
        elif action == "param":
            p = nn.Parameter(torch.randn(draw(st.integers(1, 4)), 3))
            parent.register_parameter(f"p{i}", p)
            tensors.append(p)
        elif action == "buffer":
            b = torch.randn(draw(st.integers(1, 4)), 3)
            parent.register_buffer(f"b{i}", b)
            tensors.append(b)
        elif action == "alias" and tensors:
            t = draw(st.sampled_from(tensors))
            if isinstance(t, nn.Parameter):
                parent.register_parameter(f"a{i}", t)
            else:
                parent.register_buffer(f"a{i}", t)
        elif action == "view" and tensors:
            t = draw(st.sampled_from(tensors)).detach()
            kind = draw(st.sampled_from(["t", "slice", "flat"]))
            v = t.t() if kind == "t" and t.dim() == 2 else t[..., :1] if kind == "slice" else t.reshape(-1)
            parent.register_buffer(f"v{i}", v)
        elif action == "none":
            parent.register_parameter(f"n{i}", None)
    return root


@settings(max_examples=200, deadline=None)
@given(random_models())
def test_find_ties_matches_brute_force_on_random_trees(model: nn.Module) -> None:
    plan = find_ties(model)
    assert {frozenset(g.names) for g in plan.groups} == brute_force_groups(model)
    assert plan.unique_count == len(list(model.parameters()))
    assert plan.total_count == len(list(model.named_parameters(remove_duplicate=False)))
    assert TiePlan.from_json(plan.to_json()) == plan
    for group in plan.groups:  # every view can be rebuilt from its source's memory
        source = model.get_parameter(group.source) if group.source in dict(model.named_parameters()) else None
        for member in group.members:
            if member.view is not None and source is not None:
                rebuilt = source.detach().as_strided(
                    member.view.size, member.view.stride, source.storage_offset() + member.view.offset
                )
                assert torch.equal(rebuilt, _get(model, member.name))


def _get(model: nn.Module, name: str) -> torch.Tensor:
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    t = module._parameters.get(attr)
    return t if t is not None else module._buffers[attr]  # type: ignore[return-value]
