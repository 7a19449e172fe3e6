"""save_model / load_model on CPU and meta: the file format, re-tying in every model state,
plain safetensors files, and bad input that must leave the model untouched."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import pytest
import safetensors.torch
import torch
from models import ExtraStateLM, Scaled, ViewBuffers, WeightSharingModule, assert_unchanged, gpt2, snapshot
from safetensors import safe_open
from torch import nn

import tiekit
from tiekit import CheckpointError, find_ties, load_model, save_model
from tiekit.checkpoint import reads
from tiekit.inspection import inspect_file

IDS = torch.tensor([[1, 5, 9, 2, 7, 3]])


def untied_weight_sharing() -> WeightSharingModule:
    model = WeightSharingModule()
    model.layer_3.weight = nn.Parameter(model.layer_3.weight.detach().clone())
    return model


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def header_of(path: Path) -> tuple[dict[str, object], bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_file(path: Path, header: dict[str, object], data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


# -- the format -----------------------------------------------------------------------------


@pytest.mark.parametrize("build", [WeightSharingModule, ViewBuffers, gpt2])
def test_file_is_plain_safetensors_with_one_tensor_per_tie_group(
    tmp_path: Path, build: Callable[[], nn.Module]
) -> None:
    model = build()
    plan = find_ties(model)
    path = tmp_path / "model.safetensors"
    save_model(model, path)

    loaded = safetensors.torch.load_file(path)  # any reader opens it
    expected = [n for n in model.state_dict() if n not in plan.tied_names]
    assert sorted(loaded) == sorted(expected)
    for name in expected:
        assert torch.equal(loaded[name], model.state_dict()[name])
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt"
    assert tiekit.TiePlan.from_json(metadata["tiekit.plan"]) == plan
    header_length = struct.unpack("<Q", path.read_bytes()[:8])[0]
    unique_bytes = sum(t.numel() * t.element_size() for t in loaded.values())
    assert path.stat().st_size == 8 + header_length + unique_bytes
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no temporary file left


def test_folder_path_and_user_metadata(tmp_path: Path) -> None:
    model = WeightSharingModule()
    save_model(model, tmp_path, metadata={"run": "7"})
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert f.metadata()["run"] == "7"
    fresh = untied_weight_sharing()
    load_model(fresh, tmp_path)
    assert fresh.layer_3.weight is fresh.layer_1.weight
    for bad in ({"tiekit.plan": "x"}, {"format": "tf"}, {"n": 1}):
        with pytest.raises(CheckpointError, match="metadata"):
            save_model(model, tmp_path / "other.safetensors", metadata=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "other.safetensors").exists()


def test_saving_a_meta_model_is_refused(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = WeightSharingModule()
    with pytest.raises(CheckpointError, match=re.escape("'layer_1.weight' is on the meta device")):
        save_model(model, tmp_path / "m.safetensors")
    assert list(tmp_path.iterdir()) == []


# -- loading re-ties, in every case ---------------------------------------------------------


def test_load_into_fresh_tied_model_copies_in_place(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = gpt2().eval()
    save_model(source, tmp_path / "m.safetensors")
    torch.manual_seed(1)
    target = gpt2().eval()
    params = list(target.parameters())
    optimizer = torch.optim.SGD(target.parameters(), lr=0.1)
    result = load_model(target, tmp_path / "m.safetensors")
    assert result.plan_origin == "tiekit" and result.missing == result.unexpected == ()
    assert [g.names for g in result.retied] == [("transformer.wte.weight", "lm_head.weight")]
    assert list(target.parameters()) == params and all(a is b for a, b in zip(target.parameters(), params, strict=True))
    assert optimizer.param_groups[0]["params"][0] is target.transformer.wte.weight
    assert_same_state(source, target)
    assert torch.equal(source(IDS).logits, target(IDS).logits)


def test_load_into_untied_model_reties_it_where_safetensors_cannot(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    source = WeightSharingModule()
    save_model(source, path)

    plain = untied_weight_sharing()
    with pytest.raises(RuntimeError, match=re.escape('Missing key(s) in state_dict: "layer_3.weight"')):
        safetensors.torch.load_model(plain, path)
    assert plain.layer_3.weight is not plain.layer_1.weight  # without tiekit the tie stays broken

    model = untied_weight_sharing()
    assert len(list(model.parameters())) == 3
    load_model(model, path)
    assert model.layer_3.weight is model.layer_1.weight
    assert len(list(model.parameters())) == 2 == find_ties(source).unique_count
    assert_same_state(source, model)

    hf = gpt2(tie_word_embeddings=False)  # a config that does not tie: the file's plan ties it
    save_model(gpt2(), tmp_path / "g.safetensors")
    load_model(hf, tmp_path / "g.safetensors")
    assert hf.lm_head.weight is hf.transformer.wte.weight


def test_meta_model_gets_one_tensor_per_unique_weight(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = gpt2().eval()
    save_model(source, tmp_path / "m.safetensors")
    with torch.device("meta"):
        plain, target = gpt2().eval(), gpt2().eval()
    plain.load_state_dict(source.state_dict(), assign=True)  # without tiekit: two tensors, tie lost
    assert plain.lm_head.weight is not plain.transformer.wte.weight
    load_model(target, tmp_path / "m.safetensors")
    state = target.state_dict(keep_vars=True)
    assert not any(t.is_meta for t in state.values())
    assert target.lm_head.weight is target.transformer.wte.weight
    storages = {t.untyped_storage().data_ptr() for t in state.values()}
    assert len(storages) == len(safetensors.torch.load_file(tmp_path / "m.safetensors"))
    assert len(list(target.parameters())) == find_ties(source).unique_count
    assert all(p.requires_grad for p in target.parameters())
    assert torch.equal(source(IDS).logits, target(IDS).logits)


def test_meta_load_peak_memory_is_one_copy_of_the_tied_weight(tmp_path: Path) -> None:
    """A 128 MB embedding tied to a head, loaded into a meta model: the process grows by one
    copy (a second allocation of the tied weight would show as 256 MB)."""
    script = textwrap.dedent(
        """
        import sys, torch, tiekit
        from torch import nn

        class Tied(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(32768, 1024)
                self.head = nn.Linear(1024, 32768, bias=False)
                self.head.weight = self.embed.weight

        def rss(key):
            return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

        path = sys.argv[1]
        saved = Tied()
        tiekit.save_model(saved, path)
        del saved  # large blocks go back to the system: the baseline below is without a model
        with torch.device("meta"):
            model = Tied()
        before = rss("VmRSS:")
        open("/proc/self/clear_refs", "w").write("5")
        tiekit.load_model(model, path)
        assert model.head.weight is model.embed.weight
        print((rss("VmHWM:") - before) / (32768 * 1024 * 4))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "big.safetensors")], check=True, capture_output=True, text=True
    )
    growth = float(out.stdout.strip())
    assert 0.9 < growth < 1.2, growth


def test_device_argument_materialises_on_cpu(tmp_path: Path) -> None:
    save_model(WeightSharingModule(), tmp_path / "m.safetensors")
    with torch.device("meta"):
        model = WeightSharingModule()
    load_model(model, tmp_path / "m.safetensors", device="cpu")
    assert model.layer_1.weight.device.type == "cpu" and model.layer_3.weight is model.layer_1.weight


# -- extra state (get_extra_state) ---------------------------------------------------------------


def saved_extra_state_model() -> ExtraStateLM:
    torch.manual_seed(0)
    model = ExtraStateLM()
    model.mid.amax = torch.tensor([1.0, 2.5, -3.0, 4.0], dtype=torch.float64)
    return model


@pytest.mark.parametrize("meta", [False, True], ids=["real", "meta"])
@pytest.mark.parametrize("training", [False, True], ids=["save_model", "save_checkpoint"])
def test_tensor_extra_state_round_trips_to_set_extra_state(tmp_path: Path, meta: bool, training: bool) -> None:
    """save_model stored 'mid._extra_state' and load_model of that same file refused it as
    unexpected (save_checkpoint/load_checkpoint too). Now set_extra_state gets what torch's
    load_state_dict of the saved state dict gives it: the stored tensor, its dtype, on the CPU."""
    model = saved_extra_state_model()
    plan = find_ties(model)
    tiekit.move(model, "cpu")
    tiekit.verify(model, plan)  # extra state is no tie slot: nothing to trip on
    if training:
        tiekit.save_checkpoint(tmp_path / "ck", model=model, step=3)
    else:
        save_model(model, tmp_path / "m.safetensors")
    if meta:
        with torch.device("meta"):
            fresh = ExtraStateLM()
    else:
        fresh = ExtraStateLM()
    if training:
        result = tiekit.load_checkpoint(tmp_path / "ck", model=fresh)["load_result"]
    else:
        result = load_model(fresh, tmp_path / "m.safetensors")
    assert result.missing == () and result.unexpected == ()
    control = ExtraStateLM()
    control.load_state_dict(model.state_dict())
    (given,) = fresh.mid.given
    assert isinstance(given, torch.Tensor) and torch.equal(given, model.mid.amax)
    assert (given.dtype, given.device) == (control.mid.given[0].dtype, control.mid.given[0].device)  # type: ignore[union-attr]
    assert fresh.head.weight is fresh.embed.weight and not fresh.embed.weight.is_meta
    assert_same_state(model, fresh)


def test_extra_state_follows_the_device_asked_for(tmp_path: Path) -> None:
    save_model(saved_extra_state_model(), tmp_path / "m.safetensors")
    with torch.device("meta"):
        fresh = ExtraStateLM()
    load_model(fresh, tmp_path / "m.safetensors", device="cpu")
    assert fresh.mid.amax.device.type == "cpu" and fresh.mid.amax.dtype == torch.float64


def test_strict_loads_refuse_extra_state_missing_or_without_a_taker(tmp_path: Path) -> None:
    """As torch's load_state_dict: a module with set_extra_state needs its key, and a key for a
    module without it is unexpected. strict=False loads the rest and says which."""
    save_model(saved_extra_state_model(), tmp_path / "with.safetensors")
    plain = ExtraStateLM()
    plain.mid = nn.Module()
    plain.mid.linear = nn.Linear(8, 8)
    save_model(plain, tmp_path / "without.safetensors")

    model = ExtraStateLM()
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=r"does not match ExtraStateLM: missing 'mid\._extra_state'"):
        load_model(model, tmp_path / "without.safetensors")
    assert_unchanged(model, before)
    assert model.mid.given == []
    assert load_model(model, tmp_path / "without.safetensors", strict=False).missing == ("mid._extra_state",)

    other = ExtraStateLM()
    other.mid = nn.Module()
    other.mid.linear = nn.Linear(8, 8)
    before = snapshot(other)
    with pytest.raises(CheckpointError, match=r"does not match ExtraStateLM: unexpected 'mid\._extra_state'"):
        load_model(other, tmp_path / "with.safetensors")
    assert_unchanged(other, before)
    assert load_model(other, tmp_path / "with.safetensors", strict=False).unexpected == ("mid._extra_state",)


def test_non_tensor_extra_state_is_refused_naming_its_module(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"'mid\._extra_state' is a dict, not a tensor: Scaled\.get_extra_state returned it"
    ):
        save_model(ExtraStateLM("dict"), tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


def test_set_extra_state_refusing_the_value_names_the_key(tmp_path: Path) -> None:
    class Refusing(Scaled):
        def set_extra_state(self, state: object) -> None:
            raise ValueError("amax history of another recipe")

    save_model(saved_extra_state_model(), tmp_path / "m.safetensors")
    model = ExtraStateLM()
    model.mid = Refusing()
    with pytest.raises(
        CheckpointError, match=r"Refusing\.set_extra_state refused 'mid\._extra_state' \(ValueError: amax history"
    ):
        load_model(model, tmp_path / "m.safetensors")


def test_view_buffers_are_rebuilt_as_views(tmp_path: Path) -> None:
    source = ViewBuffers()
    save_model(source, tmp_path / "v.safetensors")
    assert list(safetensors.torch.load_file(tmp_path / "v.safetensors")) == ["w"]
    for target in (ViewBuffers(), torch.device("meta")):
        if isinstance(target, torch.device):
            with target:
                target = ViewBuffers()
        load_model(target, tmp_path / "v.safetensors")
        assert find_ties(target) == find_ties(source)
        assert target.wt.data_ptr() == target.w.data_ptr()
        assert_same_state(source, target)
        with torch.no_grad():
            target.w[0, 0] = 42.0
        assert target.wt[0, 0] == 42.0 and target.wv[0] == 42.0  # views of the parameter, not copies


class TransposedBuffer(nn.Module):
    """A weight and one buffer viewing it transposed (a decoder reading an encoder's weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 6, bias=False)
        self.register_buffer("wt", self.enc.weight.detach().t())


def test_a_view_buffer_a_move_made_a_copy_of_loads_back_as_a_view_when_equal(tmp_path: Path) -> None:
    """A model whose view became a copy (moved to XLA without a plan made on the CPU, which the
    save warns about) is saved with both stored; its own class refused that file, even with
    strict=False ("stores 'wt' and 'enc.weight' as separate tensors, but the model ties"), where
    a parameter tie stored apart with equal values loads (probe)."""
    source = TransposedBuffer()
    source.enc.weight.data = source.enc.weight.data.clone()  # what such a move leaves: a copy
    assert source.wt.data_ptr() != source.enc.weight.data_ptr()  # the control: the view is broken
    save_model(source, tmp_path / "v.safetensors")
    assert sorted(safetensors.torch.load_file(tmp_path / "v.safetensors")) == ["enc.weight", "wt"]
    for strict in (True, False):
        target = TransposedBuffer()
        load_model(target, tmp_path / "v.safetensors", strict=strict)
        assert target.wt.data_ptr() == target.enc.weight.data_ptr()  # a view again
        assert torch.equal(target.enc.weight, source.enc.weight) and torch.equal(target.wt, source.wt)
    # A copy that differs from the view of its source: one would be dropped, so refused.
    with torch.no_grad():
        source.wt[0, 0] += 1.0
    save_model(source, tmp_path / "d.safetensors")
    other = TransposedBuffer()
    before = snapshot(other)
    with pytest.raises(CheckpointError, match=r"stores 'wt' and 'enc.weight' with different values, but the model"):
        load_model(other, tmp_path / "d.safetensors")
    assert_unchanged(other, before)
    # Equal bytes holding NaN are equal copies (torch.equal says NaN != NaN).
    with torch.no_grad():
        source.enc.weight[0, 0] = float("nan")
        source.wt.copy_(source.enc.weight.t())
    save_model(source, tmp_path / "n.safetensors")
    load_model(TransposedBuffer(), tmp_path / "n.safetensors")


class ConjugateBuffer(nn.Module):
    """A complex weight and a buffer viewing its conjugate (lazily: the view's bytes are the weight's)."""

    def __init__(self, *, plain: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6, dtype=torch.complex64))
        self.register_buffer("b", self.w.detach().clone() if plain else self.w.detach().conj())


def test_a_conjugate_view_stored_apart_is_refused_not_loaded_with_other_values(tmp_path: Path) -> None:
    """A conjugate view's geometry leaves its lazy bit out, so its stored copy cannot be compared
    with the view rebuilt from its source: a file storing b equal to w (not its conjugate) was
    accepted by the comparison and b silently took conj(w) (second adversarial probe)."""
    save_model(ConjugateBuffer(plain=True), tmp_path / "a.safetensors")
    target = ConjugateBuffer()
    before = snapshot(target)
    with pytest.raises(CheckpointError, match=r"stores 'b' and 'w' as separate tensors, but the model ties 'b'"):
        load_model(target, tmp_path / "a.safetensors")
    assert_unchanged(target, before)


class SharedMask(nn.Module):
    """A tied weight, and one non-persistent buffer every layer registers (a causal mask or a
    rotary inv_freq built once): not in the state dict, so no file stores it."""

    def __init__(self) -> None:
        super().__init__()
        mask = torch.tril(torch.ones(4, 4))
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        for layer in self.layers:
            layer.register_buffer("mask", mask, persistent=False)
        self.layers[1].weight = self.layers[0].weight


def test_a_shared_non_persistent_buffer_is_left_out_of_the_saved_plan(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = SharedMask()
    save_model(source, tmp_path / "m.safetensors")
    tiekit.save_checkpoint(tmp_path / "ckpt", model=source, step=1)
    tiekit.save_sharded(source, tmp_path / "sharded")
    tiekit.convert(tmp_path / "sharded", tmp_path / "converted.safetensors", plan=SharedMask())
    for path in ("m.safetensors", "ckpt", "sharded", "converted.safetensors"):
        torch.manual_seed(1)
        target = SharedMask()
        if path == "sharded":
            tiekit.load_sharded(target, tmp_path / path)
        else:
            load_model(target, tmp_path / path)  # refused before: the plan named the unstored mask
        assert_same_state(source, target)
        assert target.layers[1].weight is target.layers[0].weight, path
        assert target.layers[1].mask is target.layers[0].mask, path  # the model's own, untouched
    plan = inspect_file(tmp_path / "m.safetensors").plan
    assert plan is not None and [g.names for g in plan.groups] == [("layers.0.weight", "layers.1.weight")]


class Declared(tiekit.TPUMixin, nn.Module):
    tied_weights: ClassVar[dict[str, str]] = {"head.weight": "embed.weight"}

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 4)
        self.head = nn.Linear(4, 12, bias=False)


def test_declared_ties_tie_a_meta_model_and_plain_files(tmp_path: Path) -> None:
    source = Declared()
    source.tie_weights()
    # A plain safetensors file without any tie metadata: the model's declared ties fill in.
    safetensors.torch.save_file({"embed.weight": source.embed.weight.detach()}, tmp_path / "plain.safetensors")
    with torch.device("meta"):
        model = Declared()
    assert model.head.weight is not model.embed.weight
    result = load_model(model, tmp_path / "plain.safetensors")
    assert result.plan_origin == "model"
    assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, source.embed.weight)


# -- files written without tiekit ---------------------------------------------------------


def test_safetensors_save_model_metadata_is_used(tmp_path: Path) -> None:
    source = gpt2().eval()
    path = tmp_path / "st.safetensors"
    safetensors.torch.save_model(source, str(path))  # keeps lm_head.weight, drops the embedding
    model = gpt2(tie_word_embeddings=False)
    with pytest.raises(RuntimeError, match="Missing key"):
        safetensors.torch.load_model(gpt2(tie_word_embeddings=False), path)
    result = load_model(model, path)
    assert result.plan_origin == "safetensors"
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(source(IDS).logits, model.eval()(IDS).logits)


def test_hf_style_file_without_metadata_uses_the_model_plan(tmp_path: Path) -> None:
    source = gpt2().eval()
    state = {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}
    safetensors.torch.save_file(state, tmp_path / "hf.safetensors")
    model = gpt2().eval()
    result = load_model(model, tmp_path / "hf.safetensors")
    assert result.plan_origin == "model" and not result.missing
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(source(IDS).logits, model(IDS).logits)


def test_file_with_duplicated_tied_tensor(tmp_path: Path) -> None:
    source = gpt2()
    state = {k: v.clone() for k, v in source.state_dict().items()}  # both names stored
    safetensors.torch.save_file(state, tmp_path / "dup.safetensors")
    with pytest.raises(RuntimeError, match="Unexpected key"):
        safetensors.torch.load_model(gpt2(), tmp_path / "dup.safetensors")
    model = gpt2()
    assert load_model(model, tmp_path / "dup.safetensors").unexpected == ()
    assert_same_state(source, model)

    state["lm_head.weight"] = state["lm_head.weight"] + 1  # now they disagree: one would be lost
    safetensors.torch.save_file(state, tmp_path / "diff.safetensors")
    model = gpt2()
    before = snapshot(model)
    with pytest.raises(
        CheckpointError, match=re.escape("'lm_head.weight' and 'transformer.wte.weight' with different values")
    ):
        load_model(model, tmp_path / "diff.safetensors")
    assert_unchanged(model, before)


def test_strict_false_reports_missing_and_unexpected(tmp_path: Path) -> None:
    source = WeightSharingModule()
    state = {"layer_1.weight": source.layer_1.weight.detach(), "stray": torch.zeros(2)}
    safetensors.torch.save_file(state, tmp_path / "partial.safetensors")
    model = WeightSharingModule()
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=re.escape("missing 'layer_2.weight'; unexpected 'stray'")):
        load_model(model, tmp_path / "partial.safetensors")
    assert_unchanged(model, before)
    result = load_model(model, tmp_path / "partial.safetensors", strict=False)
    assert (result.missing, result.unexpected) == (("layer_2.weight",), ("stray",))
    assert torch.equal(model.layer_3.weight, source.layer_1.weight)
    assert torch.equal(model.layer_2.weight, before["layer_2.weight"][1])


class Headless(nn.Module):
    """WeightSharingModule without layer_3, the name its plan ties to layer_1."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_1 = nn.Linear(32, 10, bias=False)
        self.layer_2 = nn.Linear(10, 32, bias=False)


def test_a_tied_name_the_model_lacks_is_unexpected(tmp_path: Path) -> None:
    """The file stores layer_3.weight once, under layer_1.weight, and its plan names it: a model
    without layer_3 loaded it strictly with nothing unexpected (probe), where torch's
    load_state_dict and the same file saved untied refuse it. So is a plan naming a key that is
    not in the model (a hand-edited 'layer_3.wieght')."""
    path = tmp_path / "tied.safetensors"
    save_model(WeightSharingModule(), path)
    model = Headless()
    before = snapshot(model)
    with pytest.raises(
        CheckpointError, match=re.escape(f"{path}: does not match Headless: unexpected 'layer_3.weight'")
    ):
        load_model(model, path)
    assert_unchanged(model, before)
    result = load_model(model, path, strict=False)
    assert (result.missing, result.unexpected, result.retied) == ((), ("layer_3.weight",), ())

    header, data = header_of(path)
    metadata = header["__metadata__"]
    assert isinstance(metadata, dict)
    metadata["tiekit.plan"] = metadata["tiekit.plan"].replace('"layer_3.weight"', '"layer_3.wieght"')
    write_file(tmp_path / "typo.safetensors", header, data)
    model = WeightSharingModule()
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=re.escape("unexpected 'layer_3.wieght'")):
        load_model(model, tmp_path / "typo.safetensors")
    assert_unchanged(model, before)


# -- bad input: CheckpointError naming the file and key, the model untouched ----------------


def corrupt_truncate(path: Path) -> str:
    path.write_bytes(path.read_bytes()[:-10])
    return "truncated: key"


def corrupt_header_bytes(path: Path) -> str:
    raw = bytearray(path.read_bytes())
    raw[8:20] = b"#" * 12
    path.write_bytes(bytes(raw))
    return "corrupted header"


def corrupt_oversized(path: Path) -> str:
    raw = bytearray(path.read_bytes())
    raw[:8] = struct.pack("<Q", 2**40)
    path.write_bytes(bytes(raw))
    return "oversized header"


def corrupt_offsets(path: Path) -> str:
    header, data = header_of(path)
    entry = header["layer_2.weight"]
    assert isinstance(entry, dict)
    entry["data_offsets"] = [entry["data_offsets"][0] + 4, entry["data_offsets"][1] + 4]
    write_file(path, header, data)
    return "offsets lie at key 'layer_2.weight'"


def corrupt_drop_source(path: Path) -> str:
    header, data = header_of(path)
    header.pop("layer_1.weight")  # the plan still names it as the tie source
    entry = header["layer_2.weight"]
    assert isinstance(entry, dict)
    start, end = entry["data_offsets"]
    entry["data_offsets"] = [0, end - start]
    write_file(path, header, data[start:end])
    return "the tie metadata names key 'layer_1.weight'"


def corrupt_plan(path: Path) -> str:
    header, data = header_of(path)
    metadata = header["__metadata__"]
    assert isinstance(metadata, dict)
    metadata["tiekit.plan"] = metadata["tiekit.plan"].replace('"version":1', '"version":99')
    write_file(path, header, data)
    return "invalid tie plan in 'tiekit.plan'"


@pytest.mark.parametrize(
    "corrupt",
    [corrupt_truncate, corrupt_header_bytes, corrupt_oversized, corrupt_offsets, corrupt_drop_source, corrupt_plan],
)
def test_damaged_files_raise_and_leave_the_model_unchanged(tmp_path: Path, corrupt: Callable[[Path], str]) -> None:
    path = tmp_path / "m.safetensors"
    save_model(WeightSharingModule(), path)
    message = corrupt(path)
    for model in (WeightSharingModule(), untied_weight_sharing()):
        before = snapshot(model)
        with pytest.raises(CheckpointError) as info:
            load_model(model, path)
        assert str(path) in str(info.value) and message in str(info.value)
        assert_unchanged(model, before)


def test_a_plan_tying_a_stored_key_of_another_shape_is_named_damaged(tmp_path: Path) -> None:
    """A hand-edited plan tying layer_2.weight (32x10, stored) to layer_1.weight (10x32) was
    reported as the two keys' "different values, but the model ties them" (the model does not),
    and inspect_file accepted the file (probe)."""
    path = tmp_path / "m.safetensors"
    save_model(WeightSharingModule(), path)
    header, data = header_of(path)
    metadata = header["__metadata__"]
    assert isinstance(metadata, dict)
    metadata["tiekit.plan"] = metadata["tiekit.plan"].replace('"layer_3.weight"', '"layer_2.weight"')
    write_file(path, header, data)
    said = (
        f"{path}: the tie metadata ties 'layer_2.weight' to 'layer_1.weight' ((10, 32) float32), but the "
        "checkpoint stores 'layer_2.weight' as (32, 10) float32: a tensor cannot be both; the plan is damaged"
    )
    model = WeightSharingModule()
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=re.escape(said)):
        load_model(model, path)
    assert_unchanged(model, before)
    with pytest.raises(CheckpointError, match=re.escape(said)):
        inspect_file(path)


def test_different_copies_tied_by_the_files_plan_blame_the_plan_not_the_model(tmp_path: Path) -> None:
    """A file storing layer_1.weight and layer_3.weight apart (saved untied, trained apart), its
    plan edited to tie them: load_model and load_checkpoint said "different values, but the model
    ties them; load into a model built without this tie" into a model without the tie (probe).
    Now the message names the file's tie plan as the side that ties them, and says whether the
    model does too. A model's own tie (the file's plan tying nothing) is still named as before."""
    untied = untied_weight_sharing()
    with torch.no_grad():
        untied.layer_3.weight.add_(1.0)
    path = tmp_path / "m.safetensors"
    save_model(untied, path)
    model_tie = "stores 'layer_3.weight' and 'layer_1.weight' with different values, but the model ties them: "
    model = WeightSharingModule()
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: {model_tie}the file was saved from a model")):
        load_model(model, path)
    header, data = header_of(path)
    metadata = header["__metadata__"]
    assert isinstance(metadata, dict)
    plan = json.loads(metadata["tiekit.plan"])
    assert plan["groups"] == []
    member = {"name": "layer_1.weight", "kind": "parameter"}
    plan["groups"] = [
        {
            "source": "layer_1.weight",
            "kind": "parameter",
            "shape": [10, 32],
            "dtype": "float32",
            "members": [member, {**member, "name": "layer_3.weight"}],
        }
    ]
    plan["unique_count"] -= 1
    metadata["tiekit.plan"] = json.dumps(plan)
    write_file(path, header, data)
    said = (
        f"{path}: stores 'layer_3.weight' and 'layer_1.weight' with different values, but the checkpoint's tie "
        f"plan ({path}, metadata key 'tiekit.plan') ties them, {{}}: the plan does not describe what was saved "
        "(edited or damaged). Restore the plan as the save wrote it, or save the checkpoint again"
    )
    for model, side in (
        (untied_weight_sharing(), "and the model does not"),
        (WeightSharingModule(), "as the model does"),
    ):
        before = snapshot(model)
        for load in (load_model, lambda m, p: tiekit.load_checkpoint(p, model=m)):
            with pytest.raises(CheckpointError) as raised:
                load(model, path)
            assert str(raised.value) == said.format(side)
            assert_unchanged(model, before)


class Wider(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32, out: int = 32) -> None:
        super().__init__()
        self.layer_1 = nn.Linear(32, 10, bias=False, dtype=dtype)
        self.layer_2 = nn.Linear(10, out, bias=False, dtype=dtype)
        self.layer_3 = nn.Linear(32, 10, bias=False, dtype=dtype)
        self.layer_3.weight = self.layer_1.weight


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (Wider(out=33), "shape mismatch for 'layer_2.weight': the file has (32, 10), the model (33, 10)"),
    ],
)
def test_shape_and_dtype_mismatch(tmp_path: Path, model: nn.Module, message: str) -> None:
    save_model(WeightSharingModule(), tmp_path / "m.safetensors")
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_model(model, tmp_path / "m.safetensors")
    assert_unchanged(model, before)


def test_a_file_saved_untied_loads_into_the_tied_model_when_its_copies_are_equal(tmp_path: Path) -> None:
    """A file whose plan stores the tied names apart (saved while the tie did not hold, or through
    a copy of each tensor, as Lightning's AsyncCheckpointIO makes) was refused even with equal
    copies, which docs/checkpoints.md said load (probe); copies that differ are still refused."""
    untied = Declared()  # saved while its declared tie does not hold: two tensors in the file
    save_model(untied, tmp_path / "u.safetensors")
    assert tiekit.TiePlan.from_json(safe_open(tmp_path / "u.safetensors", "pt").metadata()["tiekit.plan"]).groups == ()
    model = Declared()
    model.tie_weights()
    before = snapshot(model)
    with pytest.raises(
        CheckpointError, match=re.escape("stores 'head.weight' and 'embed.weight' with different values, but the model")
    ):
        load_model(model, tmp_path / "u.safetensors")
    assert_unchanged(model, before)

    with torch.no_grad():
        untied.head.weight.copy_(untied.embed.weight)  # two tensors, equal values
    save_model(untied, tmp_path / "equal.safetensors")
    result = load_model(model, tmp_path / "equal.safetensors")
    assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, untied.embed.weight)
    assert result.unexpected == () and result.missing == ()


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (
            lambda m, p: save_model(p, m),  # type: ignore[arg-type]
            "tiekit.save_model(model, path): path must be a str or os.PathLike, not a model (WeightSharingModule): "
            "are the arguments in this order?",
        ),
        (
            lambda m, p: load_model(m, None),  # type: ignore[arg-type]
            "tiekit.load_model(model, path): path must be a str or os.PathLike, not None",
        ),
        (
            lambda m, p: load_model(str(p), m),  # type: ignore[arg-type]
            "tiekit.load_model(model, path): path must be a str or os.PathLike, not a model (WeightSharingModule)",
        ),
        (
            lambda m, p: save_model(m, p / "m.safetensors", metadata=["a"]),  # type: ignore[arg-type]
            "tiekit.save_model(model, path, metadata=...): metadata must map strings to strings (a dict), not a list",
        ),
        (
            lambda m, p: inspect_file(m),  # type: ignore[arg-type]
            "tiekit.inspection.inspect_file(path): path must be a str or os.PathLike, not a model",
        ),
    ],
)
def test_arguments_of_the_wrong_type_are_named(
    tmp_path: Path, call: Callable[[nn.Module, Path], object], said: str
) -> None:
    """Swapped or None paths failed as pathlib's TypeError naming neither function nor argument,
    a list of metadata as dict()'s ValueError (probe)."""
    model = WeightSharingModule()
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=re.escape(said)):
        call(model, tmp_path)
    assert_unchanged(model, before)
    assert list(tmp_path.iterdir()) == []


def test_missing_file_and_ambiguous_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        load_model(WeightSharingModule(), tmp_path / "nope.safetensors")
    with pytest.raises(CheckpointError, match="no safetensors file or index"):
        load_model(WeightSharingModule(), tmp_path)
    save_model(WeightSharingModule(), tmp_path / "a.safetensors")
    save_model(WeightSharingModule(), tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match="several checkpoints in this folder"):
        load_model(WeightSharingModule(), tmp_path)


def test_a_folder_holding_a_file_and_an_index_is_ambiguous_but_an_index_with_its_shards_is_not(tmp_path: Path) -> None:
    """A single file beside a sharded save's index was never counted: the folder silently loaded the
    index's checkpoint, where two files or two indexes are refused (probe). The index's own shards,
    named as shards or named otherwise by its weight_map, are not checkpoints beside it."""
    model = WeightSharingModule()
    save_model(model, tmp_path / "a.safetensors")
    save_model(model, tmp_path / "b.safetensors", max_shard_size=1)
    said = f"{tmp_path}: several checkpoints in this folder (a.safetensors, b.safetensors.index.json); name one"
    with pytest.raises(CheckpointError, match=re.escape(said)):
        load_model(WeightSharingModule(), tmp_path)
    (tmp_path / "a.safetensors").unlink()
    index = json.loads((tmp_path / "b.safetensors.index.json").read_text())
    for number, shard in enumerate(sorted(set(index["weight_map"].values()))):  # Hugging Face allows any names
        (tmp_path / shard).rename(tmp_path / f"part{number}.safetensors")
        index["weight_map"] = {
            k: f"part{number}.safetensors" if v == shard else v for k, v in index["weight_map"].items()
        }
    (tmp_path / "b.safetensors.index.json").write_text(json.dumps(index))
    loaded = WeightSharingModule()
    load_model(loaded, tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_stale_temporary_files_of_dead_savers_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".model.safetensors.tiekit-tmp-{dead.stdout.strip()}-0123abcd"
    stale.mkdir()
    (stale / ".tmpAbC123").write_bytes(b"half a file")  # as a killed safetensors writer leaves it
    alive = tmp_path / f".model.safetensors.tiekit-tmp-{os.getppid()}-0123abcd"  # a running saver's
    alive.mkdir()
    save_model(WeightSharingModule(), tmp_path / "model.safetensors")
    assert sorted(os.listdir(tmp_path)) == [alive.name, "model.safetensors"]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names fsynced files through /proc (Linux)")
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_durable_saves_fsync_before_publishing_and_fast_saves_do_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sharded: bool
) -> None:
    # A spy around the real os.fsync: it records which file was synced, and whether the
    # checkpoint was already published at that moment, then syncs for real.
    target = tmp_path / "ckpt"
    published = target / ("model.safetensors.index.json" if sharded else "model.safetensors")
    synced: list[tuple[str, bool]] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), published.exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    model = WeightSharingModule()
    shard = {"max_shard_size": 1500} if sharded else {}
    save_model(model, target, durable=False, **shard)  # type: ignore[arg-type]
    assert synced == []
    load_model(WeightSharingModule(), target)  # complete without them
    save_model(model, target, **shard)  # type: ignore[arg-type]
    data = [(path, seen) for path, seen in synced if path.endswith(".safetensors") or path.endswith(".json")]
    assert data, synced
    assert all(".tiekit-tmp-" in path for path, _ in data), data  # synced while still aside
    # The new index (or file) was synced aside, then renamed, then the folder synced.
    paths = [path for path, _ in synced]
    last_data = max(i for i, path in enumerate(paths) if path.endswith(published.name))
    assert str(target) in paths[last_data + 1 :], synced


class SavedOverDuringLoad(WeightSharingModule):
    """Replaces the checkpoint with a real save at one exact moment of a load: after the
    headers were validated (tiekit asks the model for its declared ties while staging), before
    any byte is read. That is where a trainer saving while an evaluator loads lands."""

    def __init__(self, replace: Callable[[], None]) -> None:
        super().__init__()
        self.replace: Callable[[], None] | None = replace

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict[str, str]:
        if self.replace is not None:
            replace, self.replace = self.replace, None
            replace()
        return {}


def plain_safetensors_save(model: nn.Module, folder: Path) -> None:
    folder.mkdir(exist_ok=True)
    safetensors.torch.save_model(model, os.fspath(folder / "model.safetensors"))


@pytest.mark.parametrize(
    "writer",
    [
        pytest.param(lambda m, p: save_model(m, p), id="tiekit-single"),
        pytest.param(lambda m, p: save_model(m, p, max_shard_size=1500), id="tiekit-sharded"),
        pytest.param(plain_safetensors_save, id="safetensors"),
    ],
)
def test_checkpoint_replaced_during_a_load_is_loaded_again_from_the_new_save(
    tmp_path: Path, writer: Callable[[nn.Module, Path], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "ckpt"
    writer(WeightSharingModule(), folder)
    newer = WeightSharingModule()
    with torch.no_grad():
        for p in newer.parameters():
            p.fill_(7.0)
    model = SavedOverDuringLoad(lambda: writer(newer, folder))
    load_model(model, folder)  # validated the old save, found it replaced, read the newer one whole
    assert torch.equal(model.layer_1.weight, torch.full((10, 32), 7.0))
    assert all(torch.equal(p, torch.full_like(p, 7.0)) for p in model.parameters())
    assert model.layer_3.weight is model.layer_1.weight
    # The control, one attempt (as before): refused before anything is read.
    monkeypatch.setattr(reads, "READ_ATTEMPTS", 1)
    writer(WeightSharingModule(), folder)
    model = SavedOverDuringLoad(lambda: writer(newer, folder))
    before = snapshot(model)
    with pytest.raises(CheckpointError, match="changed on disk after its header was checked"):
        load_model(model, folder)
    assert_unchanged(model, before)


def test_a_save_onto_a_symbolic_link_replaces_the_file_it_names(tmp_path: Path) -> None:
    # The rename that publishes a save replaced the link itself with a file: a "latest" link
    # stopped pointing at its checkpoint, which kept the old weights.
    real, link = tmp_path / "step-2.safetensors", tmp_path / "latest.safetensors"
    save_model(WeightSharingModule(), real)
    link.symlink_to(real.name)
    newer = WeightSharingModule()
    save_model(newer, link)
    assert link.is_symlink() and os.readlink(link) == real.name
    loaded = WeightSharingModule()
    load_model(loaded, real)
    assert torch.equal(loaded.layer_1.weight, newer.layer_1.weight)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


LIMITED_WRITE = """
import resource, signal, sys
import torch
import tiekit
sys.path.insert(0, sys.argv[2])
from models import WeightSharingModule

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
try:
    tiekit.save_checkpoint(sys.argv[1], model=WeightSharingModule(), step=3)
except tiekit.CheckpointError as exc:
    print("CheckpointError:", exc)
"""


def test_a_save_failing_to_write_leaves_no_folder_it_created(tmp_path: Path) -> None:
    target = tmp_path / "run" / "checkpoints" / "step-3.safetensors"
    script = tmp_path / "limited.py"
    script.write_text(LIMITED_WRITE)
    tests = str(Path(__file__).parent)
    done = subprocess.run([sys.executable, script, target, tests], capture_output=True, text=True, timeout=120)
    assert "CheckpointError:" in done.stdout and "cannot write" in done.stdout, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["limited.py"]  # run/checkpoints/ removed again


@pytest.mark.parametrize("step", ["3", 3.0, True, [3]])
def test_a_step_that_is_not_an_integer_is_refused(tmp_path: Path, step: object) -> None:
    with pytest.raises(CheckpointError, match=r"step must be an integer or None, not "):
        tiekit.save_checkpoint(tmp_path / "c.safetensors", model=WeightSharingModule(), step=step)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
    tiekit.save_checkpoint(tmp_path / "c.safetensors", model=WeightSharingModule(), step=torch.tensor(4))  # type: ignore[arg-type]
    assert tiekit.load_checkpoint(tmp_path / "c.safetensors", model=WeightSharingModule())["step"] == 4


@pytest.mark.parametrize("wrap", [nn.DataParallel, torch.compile], ids=["DataParallel", "compile"])
def test_a_wrapped_model_saves_and_loads_under_its_modules_names(
    tmp_path: Path, wrap: Callable[..., nn.Module]
) -> None:
    """A DDP/DataParallel or torch.compile wrapper's names ('module.', '_orig_mod.') prefixed every
    key of save_model and save_checkpoint, so the file loaded into no plain model (save_sharded
    already took the module inside; probe: accelerate's unwrap_model keeps the compile wrapper)."""
    torch.manual_seed(0)
    model = WeightSharingModule()
    wrapped = wrap(model)
    assert all(k.startswith(("module.", "_orig_mod.")) for k in wrapped.state_dict())  # what was written
    save_model(wrapped, tmp_path / "w.safetensors")
    saved_weight = model.layer_1.weight.detach().clone()
    with safe_open(tmp_path / "w.safetensors", "pt") as f:
        assert sorted(f.keys()) == ["layer_1.weight", "layer_2.weight"]
    plain = WeightSharingModule()
    load_model(plain, tmp_path / "w.safetensors")
    assert plain.layer_3.weight is plain.layer_1.weight
    assert torch.equal(plain.layer_1.weight, model.layer_1.weight)

    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    model(torch.randn(2, 32)).sum().backward()  # the module itself: no compilation here
    optimizer.step()
    tiekit.save_checkpoint(tmp_path / "c.safetensors", model=wrapped, optimizer=optimizer, step=1)
    fresh = WeightSharingModule()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert tiekit.load_checkpoint(tmp_path / "c.safetensors", model=fresh, optimizer=fresh_optimizer)["step"] == 1
    again = wrap(WeightSharingModule())  # and into a wrapped model, by its module's names
    load_model(again, tmp_path / "w.safetensors")
    inner = again.module if isinstance(again, nn.DataParallel) else again._orig_mod
    assert inner.layer_3.weight is inner.layer_1.weight and torch.equal(inner.layer_1.weight, saved_weight)
    assert torch.equal(fresh.layer_1.weight, model.layer_1.weight) and fresh.layer_3.weight is fresh.layer_1.weight
    saved = optimizer.state[model.layer_1.weight]["exp_avg"]
    assert torch.equal(fresh_optimizer.state[fresh.layer_1.weight]["exp_avg"], saved)
