"""tiekit.integrations.accelerate.prepare_tied with a real Accelerator: on the CPU, and on XLA:CPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from models import ViewBuffers, WeightSharingModule, gpt2

import tiekit

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState  # noqa: E402 - needs accelerate

from tiekit.integrations.accelerate import prepare_tied  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerator_state() -> Iterator[None]:
    # An Accelerator is a process-wide singleton; each test makes its own (as accelerate's own tests do).
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


@pytest.fixture
def cpu_accelerator(monkeypatch: pytest.MonkeyPatch) -> Iterator[accelerate.Accelerator]:
    # accelerate picks XLA whenever torch_xla is installed, even with cpu=True. USE_TORCH_XLA=false
    # turns that off, but it is read once, at import: set the flag it sets, and clear the cached answer.
    from accelerate.utils import imports

    monkeypatch.setattr(imports, "_torch_xla_available", False)
    imports.is_torch_xla_available.cache_clear()
    accelerator = accelerate.Accelerator(cpu=True)
    assert accelerator.device == torch.device("cpu") and accelerator.distributed_type.name == "NO"
    yield accelerator
    monkeypatch.undo()
    imports.is_torch_xla_available.cache_clear()


def step(accelerator: accelerate.Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    device = accelerator.device
    ids = torch.randint(0, 96, (2, 8), device=device)
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def test_prepare_tied_on_cpu_keeps_ties_and_views_and_trains(cpu_accelerator: accelerate.Accelerator) -> None:
    accelerator = cpu_accelerator
    model = prepare_tied(accelerator, gpt2())
    inner = accelerator.unwrap_model(model)
    assert inner.lm_head.weight is inner.transformer.wte.weight and len(list(inner.parameters())) == 28
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    before = inner.lm_head.weight.detach().clone()
    step(accelerator, model, optimizer)
    assert inner.lm_head.weight is inner.transformer.wte.weight
    assert not torch.equal(inner.lm_head.weight, before)

    views = prepare_tied(accelerator, ViewBuffers())
    assert views.wt.data_ptr() == views.w.data_ptr() and views.wt.stride() == (1, 6)


def test_a_checkpoint_records_the_optimizer_inside_accelerates_wrapper(
    cpu_accelerator: accelerate.Accelerator, tmp_path: Path
) -> None:
    """It recorded the wrapper's class (AcceleratedOptimizer): the file loaded into no plain AdamW,
    and AdamW's state loaded into a wrapped SGD without a word (probe)."""
    accelerator = cpu_accelerator
    built = gpt2()
    model, optimizer = prepare_tied(accelerator, built, torch.optim.AdamW(built.parameters(), lr=1e-2))
    inner = accelerator.unwrap_model(model)
    step(accelerator, model, optimizer)
    tiekit.save_checkpoint(tmp_path / "acc.safetensors", model=inner, optimizer=optimizer, step=1)
    tiekit.save_sharded(inner, tmp_path / "acc", optimizer=optimizer)
    plain = gpt2()
    adamw = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    tiekit.load_checkpoint(tmp_path / "acc.safetensors", model=plain, optimizer=adamw)
    tiekit.load_sharded(plain, tmp_path / "acc", optimizer=adamw)
    assert torch.equal(adamw.state[plain.lm_head.weight]["exp_avg"], optimizer.state[inner.lm_head.weight]["exp_avg"])
    tiekit.save_checkpoint(tmp_path / "plain.safetensors", model=plain, optimizer=adamw, step=1)
    tiekit.load_checkpoint(tmp_path / "plain.safetensors", model=inner, optimizer=optimizer)

    other = gpt2()
    sgd = accelerator.prepare(torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9))
    for path in (tmp_path / "acc.safetensors", tmp_path / "acc"):
        with pytest.raises(tiekit.CheckpointError, match="holds AdamW state, not SGD"):
            if path.is_dir():
                tiekit.load_sharded(other, path, optimizer=sgd)
            else:
                tiekit.load_checkpoint(path, model=other, optimizer=sgd)
        assert len(sgd.state) == 0 and "betas" not in sgd.param_groups[0]


def test_prepare_tied_returns_what_prepare_returns_and_rebinds_an_early_optimizer(
    cpu_accelerator: accelerate.Accelerator,
) -> None:
    accelerator = cpu_accelerator
    model = WeightSharingModule()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.randn(8, 32), batch_size=4)
    prepared_model, prepared_optimizer, prepared_loader = prepare_tied(accelerator, model, optimizer, loader)
    assert prepared_model.layer_1.weight is prepared_model.layer_3.weight
    params = [p for g in prepared_optimizer.optimizer.param_groups for p in g["params"]]
    assert params == list(prepared_model.parameters()) and len(params) == 2
    assert len(list(prepared_loader)) == 2


def test_prepare_tied_refuses_arguments_of_the_wrong_kind(cpu_accelerator: accelerate.Accelerator) -> None:
    """They were AttributeErrors from deep inside ('Sequential' object has no attribute
    'unwrap_model') and dict()'s ValueError, naming no argument (probe)."""
    accelerator = cpu_accelerator
    model = WeightSharingModule()
    params = list(model.parameters())
    with pytest.raises(
        tiekit.TiekitError,
        match=r"prepare_tied: accelerator must be an accelerate\.Accelerator, not a WeightSharingModule",
    ):
        prepare_tied(model, accelerator)  # type: ignore[arg-type]
    with pytest.raises(tiekit.TiekitError, match=r"prepare_tied: model must be a torch\.nn\.Module, not a str"):
        prepare_tied(accelerator, "gpt2")  # type: ignore[arg-type]
    with pytest.raises(tiekit.TieError, match=r"prepare_tied: declared maps tied names .*not a list"):
        prepare_tied(accelerator, model, declared=["layer_3.weight"])  # type: ignore[arg-type]
    assert list(model.parameters()) == params and model.layer_1.weight is model.layer_3.weight


def test_prepare_tied_takes_an_object_standing_in_for_an_accelerator(cpu_accelerator: accelerate.Accelerator) -> None:
    """A proxy delegating to an Accelerator worked before the argument check, which wanted an
    Accelerator instance (adversarial probe)."""

    class Proxy:
        def __init__(self, inner: accelerate.Accelerator) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    model = prepare_tied(Proxy(cpu_accelerator), WeightSharingModule())
    assert model.layer_1.weight is model.layer_3.weight
    with pytest.raises(tiekit.TiekitError, match=r"accelerator must be an accelerate\.Accelerator, not a str$"):
        prepare_tied("accelerator", WeightSharingModule())  # type: ignore[arg-type]


def test_prepare_tied_applies_declared_ties_and_refuses_bad_ones(cpu_accelerator: accelerate.Accelerator) -> None:
    accelerator = cpu_accelerator
    model = gpt2(tie_word_embeddings=False)
    prepared = prepare_tied(accelerator, model, declared={"lm_head.weight": "transformer.wte.weight"})
    assert prepared.lm_head.weight is prepared.transformer.wte.weight

    with pytest.raises(tiekit.TieError, match=r"'lm_head\.missing'"):
        prepare_tied(accelerator, gpt2(), declared={"lm_head.missing": "transformer.wte.weight"})
    with pytest.raises(tiekit.TieError, match=r"prepare_tied: on_error must be 'raise' or 'warn', not 'skip'"):
        prepare_tied(accelerator, gpt2(), on_error="skip")  # type: ignore[arg-type]


def broken_gpt2() -> torch.nn.Module:
    """A GPT-2 whose declared tie (lm_head.weight -> transformer.wte.weight) a plain .to(xla) broke: equal copies."""
    model = gpt2()
    model.lm_head.weight = torch.nn.Parameter(model.transformer.wte.weight.detach().clone())
    return model


def test_prepare_tied_reties_a_declared_tie_a_plain_move_broke(cpu_accelerator: accelerate.Accelerator) -> None:
    """tiekit.move re-ties it (docs/integrations.md), prepare_tied planned with plain find_ties and
    left it two tensors, silently: 29 parameters, trained apart (probe). Through a wrapper too."""
    accelerator = cpu_accelerator
    plain = accelerator.prepare(broken_gpt2())  # the control: prepare keeps the two copies
    assert plain.lm_head.weight is not plain.transformer.wte.weight and len(list(plain.parameters())) == 29

    model = broken_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before, over both copies
    model, optimizer = prepare_tied(accelerator, model, optimizer)
    assert model.lm_head.weight is model.transformer.wte.weight and len(list(model.parameters())) == 28
    assert [len(g["params"]) for g in optimizer.optimizer.param_groups] == [28]
    step(accelerator, model, optimizer)
    assert model.lm_head.weight is model.transformer.wte.weight

    wrapper = torch.nn.Module()  # the model held by a module of the user's: its declaration read through it
    wrapper.model = broken_gpt2()
    wrapper = prepare_tied(accelerator, wrapper)
    assert wrapper.model.lm_head.weight is wrapper.model.transformer.wte.weight


class DeclaringLM(tiekit.TPUMixin, torch.nn.Module):
    """Declares its tie and is built without it (never called tie_weights): the two tensors differ."""

    tied_weights = {"head.weight": "embed.weight"}  # noqa: RUF012 - the mixin's class attribute

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)


@pytest.mark.newest_torch_only  # tiekit's plan, the same on both stacks: run once
@pytest.mark.parametrize("device_placement", [True, False])
def test_prepare_tied_applies_a_mixins_declared_tie_with_or_without_the_move(
    cpu_accelerator: accelerate.Accelerator, device_placement: bool
) -> None:
    """Moving, prepare_tied tied the model through the mixin's own conversion, then raised "tied
    weights are no longer shared ... Before: 2 After: 1" (its plan kept only declared ties equal in
    value); not moving, it prepared the model untied without a word (probe). Both tie it now."""
    accelerator = cpu_accelerator
    accelerator.device_placement = device_placement
    plain = accelerator.prepare(DeclaringLM())
    # The control: prepare alone leaves it two tensors when it does not move it (a move is the mixin's .to, which ties).
    assert (plain.head.weight is plain.embed.weight) == device_placement
    model = DeclaringLM()
    source = model.embed.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built before, over both tensors
    model, optimizer = prepare_tied(accelerator, model, optimizer)
    assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, source)
    assert [len(g["params"]) for g in optimizer.optimizer.param_groups] == [1]


def test_prepare_tied_of_a_model_compiled_before_prepare(cpu_accelerator: accelerate.Accelerator) -> None:
    """The plan was made on the compile wrapper ("_orig_mod." names) and applied to the model
    prepare unwrapped: a TieError naming '_orig_mod.transformer', after prepare had run (probe)."""
    accelerator = cpu_accelerator
    compiled = torch.compile(gpt2(tie_word_embeddings=False), backend="eager")
    declared = {"_orig_mod.lm_head.weight": "_orig_mod.transformer.wte.weight"}  # as the wrapper names them
    model = prepare_tied(accelerator, compiled, declared=declared)
    inner = accelerator.unwrap_model(model, keep_torch_compile=False)
    assert inner.lm_head.weight is inner.transformer.wte.weight
    model = prepare_tied(accelerator, torch.compile(gpt2(), backend="eager"))
    inner = accelerator.unwrap_model(model, keep_torch_compile=False)
    assert inner.lm_head.weight is inner.transformer.wte.weight and len(list(inner.parameters())) == 28


@pytest.mark.xla
def test_accelerate_prepare_on_xla_breaks_ties_and_prepare_tied_keeps_them() -> None:
    accelerator = accelerate.Accelerator()
    assert accelerator.distributed_type.name == "XLA" and accelerator.device.type == "xla"

    plain = accelerator.prepare(WeightSharingModule())
    assert plain.layer_1.weight is not plain.layer_3.weight and len(list(plain.parameters())) == 3

    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before the move, as people do
    model, optimizer = prepare_tied(accelerator, model, optimizer)
    assert model.transformer.wte.weight.device.type == "xla"
    assert model.lm_head.weight is model.transformer.wte.weight and len(list(model.parameters())) == 28
    before = model.lm_head.weight.detach().cpu()
    step(accelerator, model, optimizer)
    tiekit.devices.sync()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not torch.equal(model.lm_head.weight.detach().cpu(), before)  # the optimizer stepped the tied weight
    stepped = {id(p) for g in optimizer.optimizer.param_groups for p in g["params"]}
    assert stepped == {id(p) for p in model.parameters()}


@pytest.mark.xla
def test_tiekit_checkpoints_of_an_accelerate_model_on_xla_resume_tied(tmp_path: Path) -> None:
    """accelerate's own `load_state` fails on XLA inside safetensors (docs/integrations.md): the
    docs send users to `save_checkpoint`/`load_checkpoint` of the unwrapped model, shown here with
    accelerate's wrapped optimizer."""
    accelerator = accelerate.Accelerator()
    model = gpt2()
    model, optimizer = prepare_tied(accelerator, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    step(accelerator, model, optimizer)
    inner = accelerator.unwrap_model(model)
    tiekit.save_checkpoint(tmp_path / "ckpt.safetensors", model=inner, optimizer=optimizer, step=1)
    saved = {k: v.cpu() for k, v in inner.state_dict().items()}
    saved_state = {k: v.cpu().clone() for k, v in optimizer.state_dict()["state"][0].items()}  # "step" is a CPU tensor
    step(accelerator, model, optimizer)

    restored = tiekit.load_checkpoint(tmp_path / "ckpt.safetensors", model=inner, optimizer=optimizer)
    assert restored["step"] == 1
    assert inner.lm_head.weight is inner.transformer.wte.weight and len(list(inner.parameters())) == 28
    assert all(torch.equal(saved[k], v.cpu()) for k, v in inner.state_dict().items())
    assert all(torch.equal(saved_state[k], v.cpu()) for k, v in optimizer.state_dict()["state"][0].items())
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in inner.parameters()}
    step(accelerator, model, optimizer)
    assert inner.lm_head.weight is inner.transformer.wte.weight

    # The control: torch's assign-load of the same state (both names, as a state dict holds them) unties.
    torch.nn.Module.load_state_dict(inner, saved, assign=True)
    assert inner.lm_head.weight is not inner.transformer.wte.weight
