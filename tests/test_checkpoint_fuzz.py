"""Bad input that used to escape tiekit's errors, then hypothesis on index files and optimizer
records: every load either succeeds or raises tiekit's own error, and a failed load leaves the
model (values and ties) and the optimizer exactly as they were."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import ViewBuffers, WeightSharingModule, assert_unchanged, broken_tie, gpt2, snapshot
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import tiekit
from tiekit import CheckpointError, TieError, TiekitError

LIMIT = 40_000  # bytes: the small GPT-2 takes several shards


# -- the reported cases -------------------------------------------------------------------------


@pytest.mark.parametrize("plan", [[1, 2], 5, None, True])
def test_an_index_plan_that_is_no_object(tmp_path: Path, plan: Any) -> None:
    tiekit.save_model(gpt2(), tmp_path, max_shard_size=LIMIT)
    index = tmp_path / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["metadata"]["tiekit.plan"] = plan
    index.write_text(json.dumps(raw))
    model = gpt2()
    before = snapshot(model)
    if plan is None:  # no plan at all: the model's own ties
        assert tiekit.load_model(model, tmp_path).plan_origin == "model"
        return
    with pytest.raises(CheckpointError, match=r"index\.json: invalid tie plan in 'tiekit.plan': a \w+, not a JSON"):
        tiekit.load_model(model, tmp_path)
    assert_unchanged(model, before)


def test_a_plan_with_a_negative_view_stride_is_refused_before_the_model_changes(tmp_path: Path) -> None:
    # Used to raise torch's "as_strided: Negative strides are not supported" after the load
    # had overwritten every tensor of the model.
    path = tmp_path / "m.safetensors"
    tiekit.save_model(ViewBuffers(), path)
    metadata = safe_open(path, "pt").metadata()
    plan = json.loads(metadata["tiekit.plan"])
    next(m for m in plan["groups"][0]["members"] if m["name"] == "wt")["view"]["stride"] = [-1, 6]
    save_file(load_file(path), path, metadata={**metadata, "tiekit.plan": json.dumps(plan)})
    model = ViewBuffers()
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=r"m\.safetensors: invalid tie plan .*'wt': field 'stride' is -1"):
        tiekit.load_model(model, path)
    assert_unchanged(model, before)


def test_max_shard_size_that_is_no_size(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="max_shard_size '12 parsecs' is not a size"):
        tiekit.save_model(WeightSharingModule(), tmp_path, max_shard_size="12 parsecs")
    assert list(tmp_path.iterdir()) == []


class Declares(tiekit.TPUMixin, nn.Module):
    tied_weights = {"head.weight": "embed.weight"}  # noqa: RUF012 - the mixin's declared ties

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(3, 2)  # no head: the declared tie names a missing module


@pytest.mark.parametrize("declared", [{"missing.weight": "layer_1.weight"}, {1: "layer_1.weight"}, {"a": None}])
def test_declared_ties_naming_nothing(declared: dict[Any, Any]) -> None:
    with pytest.raises(TieError):
        tiekit.find_ties(WeightSharingModule(), declared=declared)


def test_tied_weights_naming_a_missing_module(tmp_path: Path) -> None:
    with pytest.raises(TieError, match=r"declared tie target 'head\.weight': no module at 'head'"):
        Declares().to("cpu")
    with pytest.raises(CheckpointError, match="no module at 'head'"):
        tiekit.save_model(Declares(), tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


# -- optimizer records -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def training_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], dict[str, Any]]:
    folder = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    model = WeightSharingModule()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    tiekit.save_checkpoint(folder / "c.safetensors", model=model, optimizer=optimizer, step=1)
    metadata = safe_open(folder / "c.safetensors", "pt").metadata()
    return folder / "c.safetensors", metadata, json.loads(metadata["tiekit.checkpoint"])


def rewrite(path: Path, metadata: dict[str, str], record: Any, target: Path, tensors: Any = None) -> None:
    tensors = load_file(path) if tensors is None else tensors
    save_file(tensors, target, metadata={**metadata, "tiekit.checkpoint": json.dumps(record)})


def with_options(optimizer_record: dict[str, Any], **options: Any) -> dict[str, Any]:
    group = optimizer_record["param_groups"][0]
    return {**optimizer_record, "param_groups": [{**group, "options": {**group["options"], **options}}]}


def with_state(optimizer_record: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    state = optimizer_record["state"]
    return {**optimizer_record, "state": {**state, "layer_1.weight": {**state["layer_1.weight"], key: value}}}


def load_into_fresh(target: Path) -> tuple[nn.Module, torch.optim.Optimizer, Any, Exception | None]:
    model = broken_tie()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = snapshot(model)
    try:
        tiekit.load_checkpoint(target, model=model, optimizer=optimizer)
    except TiekitError as exc:
        return model, optimizer, before, exc
    return model, optimizer, before, None


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda o: {**o, "param_groups": [5]}, "corrupted optimizer param group 0"),
        (lambda o: {**o, "param_groups": [{**o["param_groups"][0], "params": 3}]}, "corrupted optimizer param group"),
        (lambda o: {**o, "state": [1]}, "corrupted optimizer state"),
        (lambda o: {**o, "state": {**o["state"], "zzz": {}}}, "optimizer state for 'zzz', which no param group"),
        (lambda o: {**o, "state": {k: "x" for k in o["state"]}}, "corrupted optimizer state of"),
        (lambda o: with_options(o, betas=[None, None]), "option 'betas' is [None, None] in the checkpoint"),
        # Found by the fuzzer: torch takes these and fails at the first step (float(None), None.lerp_).
        (lambda o: with_state(o, "step", None), "optimizer state 'step' of 'layer_1.weight' is None"),
        (lambda o: with_state(o, "exp_avg", 0.5), "optimizer state 'exp_avg' of 'layer_1.weight' is 0.5"),
        # Found by a probe: AdamW's bias correction divided by zero at the first step.
        (lambda o: with_state(o, "step", -1), "optimizer state 'step' of 'layer_1.weight' is -1, not a count"),
        (lambda o: with_options(o, amsgrad=True), "built with amsgrad=True, this one with amsgrad=False"),
        # Found by the fuzzer: torch checks options when an optimizer is built, not when they are loaded,
        # and the first step failed ("result type ComplexFloat can't be cast to ... Float").
        (lambda o: with_options(o, betas=[0, 2]), "AdamW refuses the saved options: Invalid beta parameter"),
        (lambda o: with_options(o, lr=-1.0), "AdamW refuses the saved options: Invalid learning rate"),
    ],
)
def test_malformed_optimizer_entries(
    tmp_path: Path, training_checkpoint: tuple[Path, dict[str, str], dict[str, Any]], edit: Any, message: str
) -> None:
    path, metadata, record = training_checkpoint
    rewrite(path, metadata, {**record, "optimizer": edit(record["optimizer"])}, tmp_path / "bad.safetensors")
    model, optimizer, before, error = load_into_fresh(tmp_path / "bad.safetensors")
    assert isinstance(error, CheckpointError) and message in str(error) and "bad.safetensors" in str(error)
    assert_unchanged(model, before)
    assert not optimizer.state


@pytest.mark.parametrize("stored", [(3, 3), ()], ids=["3x3", "0-dim"])  # a 0-dim one was taken for a scalar
def test_optimizer_state_of_the_wrong_shape_is_refused_at_load(
    tmp_path: Path, training_checkpoint: tuple[Path, dict[str, str], dict[str, Any]], stored: tuple[int, ...]
) -> None:
    path, metadata, record = training_checkpoint
    tensors = load_file(path)
    key = next(k for k in tensors if k.endswith("layer_1.weight/exp_avg"))
    tensors[key] = torch.zeros(stored)
    rewrite(path, metadata, record, tmp_path / "bad.safetensors", tensors)
    model, optimizer, before, error = load_into_fresh(tmp_path / "bad.safetensors")
    assert isinstance(error, CheckpointError) and not optimizer.state
    assert f"optimizer state 'exp_avg' of 'layer_1.weight' has shape {stored}, the parameter (10, 32)" in str(error)
    assert_unchanged(model, before)
    # Without the check this loaded and the first step failed: torch itself does not look.
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    packed = plain.state_dict()
    packed["state"] = {0: {"step": torch.tensor(1.0), "exp_avg": tensors[key], "exp_avg_sq": tensors[key]}}
    plain.load_state_dict(packed)
    model(torch.randn(2, 32)).sum().backward()
    with pytest.raises(RuntimeError):
        plain.step()


# -- hypothesis ----------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.sampled_from(["", "x", "a.b"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["params", "state", "x"]), inner, max_size=3)
    ),
    max_leaves=8,
)


def mutate(value: Any, data: st.DataObject, depth: int = 0) -> Any:
    """``value`` with one node somewhere replaced by random JSON."""
    if depth > 5 or data.draw(st.integers(0, 3)) == 0:
        return data.draw(JSON)
    if isinstance(value, dict) and value:
        key = data.draw(st.sampled_from(sorted(value)))
        return {**value, key: mutate(value[key], data, depth + 1)}
    if isinstance(value, list) and value:
        i = data.draw(st.integers(0, len(value) - 1))
        return [*value[:i], mutate(value[i], data, depth + 1), *value[i + 1 :]]
    return data.draw(JSON)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_optimizer_records_load_or_raise_tiekit_errors(
    tmp_path: Path, training_checkpoint: tuple[Path, dict[str, str], dict[str, Any]], data: st.DataObject
) -> None:
    path, metadata, record = training_checkpoint
    fuzzed = mutate(record, data)
    rewrite(path, metadata, fuzzed, tmp_path / "f.safetensors")
    model, optimizer, before, error = load_into_fresh(tmp_path / "f.safetensors")
    if error is not None:
        assert_unchanged(model, before)
        assert not optimizer.state
        return
    assert model.layer_3.weight is model.layer_1.weight
    if optimizer.state:  # what loaded must also step
        model(torch.randn(2, 32)).sum().backward()
        optimizer.step()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sharded")
    torch.manual_seed(0)
    tiekit.save_model(gpt2(), folder, max_shard_size=LIMIT)
    return folder


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_index_files_load_or_raise_tiekit_errors(tmp_path: Path, sharded: Path, data: st.DataObject) -> None:
    folder = tmp_path / data.draw(st.text("abc", min_size=1, max_size=8))
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(sharded, folder)
    index = folder / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["metadata"]["tiekit.plan"] = json.dumps(raw["metadata"]["tiekit.plan"])  # as a string too, sometimes
    if data.draw(st.booleans()):
        raw["metadata"]["tiekit.plan"] = json.loads(raw["metadata"]["tiekit.plan"])
    index.write_text(json.dumps(mutate(raw, data)))
    model = gpt2()
    model.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach() * 2)  # broken, different
    before = snapshot(model)
    try:
        tiekit.load_model(model, folder, strict=data.draw(st.booleans()))
    except TiekitError:
        assert_unchanged(model, before)
