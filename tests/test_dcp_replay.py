"""Background sharded saves of an unchanged layout are written as DCP planned the last one
(`tiekit.dcp.replay`): the same files DCP's own writer makes, without planning again; a changed
layout is planned by DCP again. Two ranks: tests/test_dcp.py (the ``deferred`` scenario)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

import tiekit
from tiekit.dcp.saving import save_sharded_staged
from tiekit.dcp.writer import records_without_checksums


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(500, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 500, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


def trained(seed: int = 0) -> tuple[Tied, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.arange(9)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def everything(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    found = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, state in enumerate(optimizer.state.values()):
        found |= {f"optim/{i}/{k}": v.detach().clone() for k, v in state.items()}
    return found


def loaded(folder: Path) -> dict[str, torch.Tensor]:
    model, optimizer = trained(seed=1)
    tiekit.load_sharded(model, folder, optimizer=optimizer)
    assert model.head.weight is model.embed.weight
    return everything(model, optimizer)


def items(folder: Path) -> list[tuple[str, int, int]]:
    """(key, offset, length) of every item the ``.metadata`` in ``folder`` names, sorted."""
    with (folder / ".metadata").open("rb") as f:
        storage = pickle.load(f).storage_data
    return sorted((index.fqn, s.offset, s.length) for index, s in storage.items())


def records(folder: Path) -> dict[str, bytes]:
    """Each item's bytes in ``folder``'s shard file (a torch.save record), by key."""
    raw = (folder / "__0_0.distcp").read_bytes()
    return {key: raw[offset : offset + length] for key, offset, length in items(folder)}


def save_folder(root: Path) -> Path:
    (found,) = root.glob("save-*")
    return found


def fit_like_saves(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer, count: int) -> list[dict[str, Any]]:
    """``count`` background saves as `tiekit.fit` makes them (each into its own folder, the host
    copies reused, the optimizer state moved into the shard image), a training step beside each
    write. For each: the values at its call, its folder and its recipe; beside it, the save
    DCP's own writer makes of the same host copies (before the next optimizer step)."""
    staging = None
    made = []
    for n in range(count):
        at_call = everything(model, optimizer)
        handle, staging, copies = save_sharded_staged(
            model, root / f"step-{n}", optimizer=optimizer, blocking=False, staging=staging, defer=True, adopt=True
        )
        model(torch.arange(n, n + 9)).sum().backward()
        assert copies is not None
        copies.settle()
        handle.wait(timeout=60)
        with records_without_checksums():
            dcp.save(dict(staging), storage_writer=FileSystemWriter(root / f"dcp-{n}", sync_files=True), no_dist=True)
        optimizer.step()
        optimizer.zero_grad()
        made.append({"at_call": at_call, "folder": save_folder(root / f"step-{n}"), "recipe": staging.recipe})
    return made


def test_saves_of_one_layout_write_what_dcp_planned_without_planning_again(tmp_path: Path) -> None:
    """The first background save is planned by DCP; each later one of the same layout is written
    from the first's plan (the same recipe): its items at the first's offsets, each record the
    bytes DCP's own writer makes of the same copies; every save holds the values of its call
    and loads with its ties."""
    model, optimizer = trained()
    saves = fit_like_saves(tmp_path, model, optimizer, 4)
    first = saves[0]["recipe"]
    assert first is not None and all(save["recipe"] is first for save in saves)
    for n, save in enumerate(saves):
        assert items(save["folder"]) == items(saves[0]["folder"]), n  # the first's plan: the same places
        assert records(save["folder"]) == records(tmp_path / f"dcp-{n}"), n  # DCP's bytes, record by record
        values = loaded(save["folder"].parent)
        assert values.keys() == save["at_call"].keys()
        assert all(torch.equal(values[k], v) for k, v in save["at_call"].items()), n
    # Each save holds its own call's values: a replay that wrote stale bytes would fail above.
    assert not torch.equal(saves[0]["at_call"]["model/embed.weight"], saves[3]["at_call"]["model/embed.weight"])


def test_a_changed_layout_is_planned_by_dcp_again(tmp_path: Path) -> None:
    """A save whose names or shapes differ from the last one's (here the optimizer state grows a
    new parameter's moments) gets a new image and DCP's own plan, then is replayed in turn."""
    model, optimizer = trained()
    before = fit_like_saves(tmp_path / "a", model, optimizer, 2)
    extra = nn.Parameter(torch.randn(7))
    model.register_parameter("scale", extra)
    optimizer.add_param_group({"params": [extra]})
    model(torch.arange(9)).sum().add(extra.sum()).backward()
    optimizer.step()
    optimizer.zero_grad()
    staging = None
    recipes = []
    for n in range(3):
        at_call = everything(model, optimizer)
        handle, staging, copies = save_sharded_staged(
            model, tmp_path / "b" / f"step-{n}", optimizer=optimizer, blocking=False, staging=staging, defer=True
        )
        assert copies is not None
        copies.settle()
        handle.wait(timeout=60)
        recipes.append(staging.recipe)
        fresh, fresh_optimizer = trained(seed=1)
        fresh.register_parameter("scale", nn.Parameter(torch.zeros(7)))
        fresh_optimizer.add_param_group({"params": [fresh.scale]})
        tiekit.load_sharded(fresh, tmp_path / "b" / f"step-{n}", optimizer=fresh_optimizer)
        values = everything(fresh, fresh_optimizer)
        assert all(torch.equal(values[k], v) for k, v in at_call.items()), n
        model(torch.arange(9)).sum().add(extra.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert before[0]["recipe"] is not None and recipes[0] is not None
    assert recipes[0] is not before[0]["recipe"] and recipes[0].names != before[0]["recipe"].names
    assert recipes[1] is recipes[0] and recipes[2] is recipes[0]


def test_a_replayed_save_that_fails_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """A replayed save whose copy is torn (a parameter written before its copies settled) fails as
    a planned one does, its folder removed, the previous checkpoint the one loaded."""
    model, optimizer = trained()
    root = tmp_path / "ck"
    handle, staging, copies = save_sharded_staged(model, root, optimizer=optimizer, blocking=False, defer=True)
    assert copies is not None
    copies.settle()
    handle.wait(timeout=60)
    committed = everything(model, optimizer)
    assert staging.recipe is not None
    handle, again, copies = save_sharded_staged(
        model, root, optimizer=optimizer, blocking=False, staging=staging, defer=True
    )
    assert copies is not None
    with torch.no_grad():
        model.norm.weight.mul_(3.0)  # written before the copies settle
    copies.settle()
    with pytest.raises(tiekit.CheckpointError, match=r"'norm\.weight' was written in place"):
        handle.wait(timeout=60)
    assert again.recipe is None  # nothing recorded: the next save is planned again
    assert [p.name for p in root.glob("save-*")] == [save_folder(root).name]
    values = loaded(root)
    assert all(torch.equal(values[k], v) for k, v in committed.items())


@pytest.mark.parametrize(
    "values",
    [
        (torch.arange(5.0), torch.zeros(0)),  # leaves the image, which is kept for the others
        (torch.zeros(0), torch.zeros(0, 3, dtype=torch.int64)),  # never in the image
        (torch.arange(3.0), torch.arange(4.0)),  # grows: a new image
    ],
    ids=["emptied", "empty-reshaped", "grown"],
)
def test_a_tensor_whose_shape_or_dtype_changes_outside_the_image_is_planned_again(
    tmp_path: Path, values: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """An ``extra`` tensor changing shape or dtype between two saves into one folder: the second
    save is planned by DCP (a replay would write the first save's metadata for it, and its commit
    would remove the folder's only loadable checkpoint), and it loads with the new value."""
    model, optimizer = trained()
    staging = None
    for value in values:
        handle, staging, copies = save_sharded_staged(
            model, tmp_path, optimizer=optimizer, extra={"t": value}, blocking=False, staging=staging, defer=True
        )
        assert copies is not None
        copies.settle()
        handle.wait(timeout=60)
        fresh, fresh_optimizer = trained(seed=1)
        found = tiekit.load_sharded(fresh, tmp_path, optimizer=fresh_optimizer).extra["t"]
        assert found.dtype == value.dtype and torch.equal(found, value)
    assert staging is not None and staging.recipe is not None  # the second save recorded its own plan
