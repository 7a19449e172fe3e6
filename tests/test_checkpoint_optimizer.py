"""save_checkpoint / load_checkpoint: optimizer state once per tied parameter, exact resume, no pickle."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from models import gpt2
from safetensors import safe_open
from torch import nn

import tiekit
from tiekit import CheckpointError, load_checkpoint, load_model, save_checkpoint, save_model

IDS = torch.tensor([[1, 5, 9, 2, 7, 3, 4, 8]])


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def train(net: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        net(IDS, labels=IDS).loss.backward()
        optimizer.step()


def test_optimizer_state_is_stored_once_per_tied_parameter(tmp_path: Path) -> None:
    net = model(0)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=(0.8, 0.95))
    train(net, optimizer, 2)
    rng = torch.get_rng_state()
    save_checkpoint(
        tmp_path / "ckpt.safetensors", model=net, optimizer=optimizer, step=2, extra={"rng": rng, "epoch": 1}
    )

    keys = set(safetensors.torch.load_file(tmp_path / "ckpt.safetensors"))  # a plain safetensors file
    assert "optimizer/state/transformer.wte.weight/exp_avg" in keys
    assert not any("lm_head" in k for k in keys)  # the tied name: no weight, no state of its own
    assert sum(k.startswith("optimizer/state/") and k.endswith("/exp_avg") for k in keys) == len(optimizer.state)
    with safe_open(tmp_path / "ckpt.safetensors", "pt") as f:
        record = json.loads(f.metadata()["tiekit.checkpoint"])
    assert record["optimizer"]["param_groups"][0]["options"]["betas"] == {"__tuple__": [0.8, 0.95]}
    assert "lm_head.weight" not in record["optimizer"]["param_groups"][0]["params"]

    fresh = model(1)
    restored = load_checkpoint(tmp_path / "ckpt.safetensors", model=fresh)
    assert restored["step"] == 2 and restored["extra"]["epoch"] == 1
    assert torch.equal(restored["extra"]["rng"], rng)
    # the weights of a training checkpoint load like any tiekit file, optimizer keys aside
    assert load_model(model(2), tmp_path / "ckpt.safetensors").unexpected == ()


@pytest.mark.parametrize("broken", [False, True])
def test_resume_continues_exactly_like_uninterrupted_training(tmp_path: Path, broken: bool) -> None:
    reference = model(0)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train(reference, opt, 3)
    save_checkpoint(tmp_path / "ckpt.safetensors", model=reference, optimizer=opt, step=3)
    train(reference, opt, 2)

    resumed = model(5)
    if broken:  # the tie broken (as an XLA move does), and an optimizer holding both copies
        resumed.lm_head.weight = nn.Parameter(resumed.lm_head.weight.detach().clone())
        assert len(list(resumed.parameters())) == len(list(reference.parameters())) + 1
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    load_checkpoint(tmp_path / "ckpt.safetensors", model=resumed, optimizer=opt2)
    assert resumed.lm_head.weight is resumed.transformer.wte.weight
    held = opt2.param_groups[0]["params"]
    assert len(held) == len(list(resumed.parameters()))
    assert all(a is b for a, b in zip(held, resumed.parameters(), strict=True))
    assert opt2.state[resumed.transformer.wte.weight]["exp_avg"].shape == resumed.transformer.wte.weight.shape
    train(resumed, opt2, 2)
    for (name, a), b in zip(reference.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_without_tiekit_the_broken_tie_trains_apart(tmp_path: Path) -> None:
    """The contrast to the test above: a torch-only resume into a broken-tie model loads
    (state_dict has both names) but the two copies then train apart."""
    reference = model(0)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train(reference, opt, 1)
    resumed = model(5)
    resumed.lm_head.weight = nn.Parameter(resumed.lm_head.weight.detach().clone())
    resumed.load_state_dict(reference.state_dict())
    train(resumed, torch.optim.AdamW(resumed.parameters(), lr=1e-2), 1)
    assert not torch.equal(resumed.lm_head.weight, resumed.transformer.wte.weight)


def test_mismatched_optimizer_raises_before_anything_changes(tmp_path: Path) -> None:
    net = model(0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    train(net, opt, 1)
    save_checkpoint(tmp_path / "ckpt.safetensors", model=net, optimizer=opt)
    target = model(1)
    before = {n: p.detach().clone() for n, p in target.named_parameters()}
    cases = [
        (torch.optim.SGD(target.parameters(), lr=0.1), "holds AdamW state, not SGD"),
        (
            torch.optim.AdamW(
                [{"params": [target.lm_head.weight]}, {"params": list(target.transformer.h.parameters())}]
            ),
            "1 optimizer param group(s) saved, the optimizer has 2",
        ),
    ]
    partial = torch.optim.AdamW(list(target.transformer.h.parameters()))
    cases.append((partial, "optimizer param group 0: the checkpoint has state for"))
    # Built from another module's parameters (as an optimizer built before a wrapping that replaced them).
    stray = torch.optim.AdamW(model(2).parameters())
    said = (
        f"{tmp_path / 'ckpt.safetensors'}: optimizer param group 0 holds a tensor that is not a parameter of the model"
    )
    cases.append((stray, said))
    for optimizer, message in cases:
        with pytest.raises(CheckpointError, match=re.escape(message)):
            load_checkpoint(tmp_path / "ckpt.safetensors", model=target, optimizer=optimizer)
        for name, p in target.named_parameters():
            assert torch.equal(p, before[name]), name
    save_checkpoint(tmp_path / "weights.safetensors", model=net)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load_checkpoint(tmp_path / "weights.safetensors", model=target, optimizer=opt)


def test_unstorable_extra_is_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot store 'extra/value/fn': a builtin_function_or_method"):
        save_checkpoint(tmp_path / "c.safetensors", model=model(0), extra={"fn": print})
    assert list(tmp_path.iterdir()) == []
    nested = {"a": [1, 2.5, None, "x", (3, torch.ones(2))], "b": {"c": torch.zeros(1, dtype=torch.int64)}}
    save_checkpoint(tmp_path / "c.safetensors", model=model(0), extra=nested)
    extra = load_checkpoint(tmp_path / "c.safetensors", model=model(1))["extra"]
    assert extra["a"][:4] == [1, 2.5, None, "x"] and extra["a"][4][0] == 3
    assert torch.equal(extra["a"][4][1], torch.ones(2)) and torch.equal(
        extra["b"]["c"], torch.zeros(1, dtype=torch.int64)
    )


def test_extra_without_data_not_dense_or_holding_itself_is_refused_naming_its_key(tmp_path: Path) -> None:
    """A meta tensor failed as NotImplementedError, a sparse one as RuntimeError, a list holding
    itself as RecursionError, each from deep inside (probe)."""
    cycle: list[Any] = [1, {"a": []}]
    cycle[1]["a"].append(cycle)
    deep: list[Any] = []
    inner = deep
    for _ in range(10_000):
        inner.append([])
        inner = inner[0]
    for extra, said in [
        ({"t": torch.ones(2, device="meta")}, "cannot store 'extra/value/t': a tensor on the meta device"),
        ({"t": torch.eye(2).to_sparse()}, "cannot store 'extra/value/t': a torch.sparse_coo tensor"),
        (cycle, "cannot store 'extra/value/1/a/0': it is 'extra/value', which holds it (a cycle)"),
        (deep, "cannot store 'extra/value': its lists, tuples and dicts nest too deeply"),
    ]:
        with pytest.raises(CheckpointError, match=re.escape(said)):
            save_checkpoint(tmp_path / "c.safetensors", model=model(0), extra=extra)
        with pytest.raises(CheckpointError, match=re.escape(said)):
            tiekit.save_sharded(model(0), tmp_path / "ck", extra=extra)
        assert list(tmp_path.iterdir()) == []  # no file, and no folder for the sharded save
    shared = [1, 2]  # one list twice is no cycle
    save_checkpoint(tmp_path / "c.safetensors", model=model(0), extra={"a": [shared, shared]})
    assert load_checkpoint(tmp_path / "c.safetensors", model=model(1))["extra"] == {"a": [[1, 2], [1, 2]]}
    # Nesting as deep as before the cycle check (which cost a frame per level at first: refused from 350).
    nested: list[Any] = [torch.ones(1), 1]
    for _ in range(400):
        nested = [nested, 1]
    save_checkpoint(tmp_path / "c.safetensors", model=model(0), extra=nested)
    assert load_checkpoint(tmp_path / "c.safetensors", model=model(1))["extra"][1] == 1


def test_an_optimizer_or_path_of_the_wrong_type_is_named(tmp_path: Path) -> None:
    """A model given as the optimizer failed as AttributeError 'param_groups' (probe), and swapped
    arguments as pathlib's TypeError."""
    net = model(0)
    with pytest.raises(CheckpointError, match=re.escape("optimizer must be a torch.optim.Optimizer or None, not a")):
        save_checkpoint(tmp_path / "c.safetensors", model=net, optimizer=net)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=re.escape("tiekit.save_checkpoint(path, model=...): path must be a")):
        save_checkpoint(net, model=tmp_path / "c.safetensors")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
    save_checkpoint(tmp_path / "c.safetensors", model=net)
    target = model(1)
    before = {n: p.detach().clone() for n, p in target.named_parameters()}
    with pytest.raises(CheckpointError, match=re.escape("tiekit.load_checkpoint(path, model=..., optimizer=...)")):
        load_checkpoint(tmp_path / "c.safetensors", model=target, optimizer=target)  # type: ignore[arg-type]
    assert all(torch.equal(p, before[n]) for n, p in target.named_parameters())


def extra_round_trip(folder: Path, extra: Any, sharded: bool) -> Any:
    """``extra`` saved with a model and loaded back, by `save_sharded` or `save_checkpoint`."""
    if sharded:
        tiekit.save_sharded(model(0), folder / "ck", extra=extra)
        return tiekit.load_sharded(model(1), folder / "ck").extra
    save_checkpoint(folder / "c.safetensors", model=model(0), extra=extra)
    return load_checkpoint(folder / "c.safetensors", model=model(1))["extra"]


@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded"])
def test_lists_and_tuples_of_plain_values_come_back_as_saved(tmp_path: Path, sharded: bool) -> None:
    """Lists and tuples of numbers, strings, booleans and None are stored whole (an RNG state is
    thousands of ints); a tuple must still come back a tuple, and nesting as it was."""
    extra = {
        "ints": list(range(5000)),
        "mixed": [1, 2.5, None, "x", True, 2**62],
        "tuple": (1, "a", None, False),
        "nested": [(1, 2), [3, (4.5,)], []],
        "empty": ((), []),
    }
    loaded = extra_round_trip(tmp_path, extra, sharded)
    assert loaded == extra
    assert type(loaded["nested"][0]) is tuple and type(loaded["mixed"][4]) is bool


@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded"])
def test_extra_keys_that_derive_the_same_tensor_key_keep_both_tensors(tmp_path: Path, sharded: bool) -> None:
    """``{"a/b": x, "a": {"b": y}}`` derives the key ``extra/value/a/b`` twice; y used to replace x
    in the file, and both loaded as y, silently."""
    extra = {"a/b": torch.ones(2), "a": {"b": torch.zeros(2)}, "a/b#2": torch.full((2,), 2.0)}
    loaded = extra_round_trip(tmp_path, extra, sharded)
    assert torch.equal(loaded["a/b"], torch.ones(2)) and torch.equal(loaded["a"]["b"], torch.zeros(2))
    assert torch.equal(loaded["a/b#2"], torch.full((2,), 2.0))


def test_no_pickle_in_the_checkpoint_modules() -> None:
    """No pickle import, no torch.load / torch.save call anywhere in the checkpoint code."""
    import ast
    import importlib
    import inspect
    import pkgutil

    import tiekit.checkpoint
    import tiekit.header

    package = [
        importlib.import_module(f"tiekit.checkpoint.{m.name}") for m in pkgutil.iter_modules(tiekit.checkpoint.__path__)
    ]
    assert len(package) >= 8  # every module of the package, not only its __init__
    for module in (tiekit.checkpoint, *package, tiekit.header):
        tree = ast.parse(inspect.getsource(module))
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any("pickle" in name for name in imported), module.__name__
        calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        assert not calls & {"torch.load", "torch.save", "pickle.load", "pickle.loads"}, module.__name__


def test_folder_paths_pick_the_training_checkpoint(tmp_path: Path) -> None:
    net = model(0)
    opt = torch.optim.AdamW(net.parameters())
    train(net, opt, 1)
    save_checkpoint(tmp_path, model=net, optimizer=opt, step=7)  # a folder: checkpoint.safetensors
    weights = model(1)
    save_model(weights, tmp_path)  # model.safetensors next to it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.safetensors", "model.safetensors"]
    target = model(2)
    assert load_checkpoint(tmp_path, model=target, optimizer=torch.optim.AdamW(target.parameters()))["step"] == 7
    assert torch.equal(target.transformer.wte.weight, net.transformer.wte.weight)
    load_model(target, tmp_path)  # load_model prefers the weights file
    assert torch.equal(target.transformer.wte.weight, weights.transformer.wte.weight)
