"""save_checkpoint(blocking=False) and fit's background checkpoints (issue 12): the state is
copied when the call returns, the file appears whole once written, the previous one stays
loadable until then, and a failed background write is an error of fit's.

The background writer is held with an event (a job queued ahead of the save on its one thread),
so "training changed the model while the file was written" happens every run, not by chance."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import WeightSharingModule
from torch.utils.data import TensorDataset

import tiekit
from tiekit.checkpoint.saving import _background

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


@contextmanager
def writer_held() -> Iterator[None]:
    """The background writer busy until the block ends."""
    release = threading.Event()
    _background().submit(release.wait, 60)
    try:
        yield
    finally:
        release.set()


def trained() -> tuple[WeightSharingModule, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = WeightSharingModule()
    optimizer = ADAMW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_background_save_holds_the_state_of_its_call_not_of_its_write(tmp_path: Path) -> None:
    model, optimizer = trained()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    moment = optimizer.state[model.layer_1.weight]["exp_avg"].clone()
    path = tmp_path / "ckpt.safetensors"
    with writer_held():
        handle = tiekit.save_checkpoint(path, model=model, optimizer=optimizer, step=1, blocking=False)
        assert not handle.done() and not path.exists()
        with torch.no_grad():  # training goes on while the file waits to be written
            for p in model.parameters():
                p.add_(1.0)
        optimizer.state[model.layer_1.weight]["exp_avg"].zero_()
    handle.wait(timeout=60)
    assert handle.done()

    fresh = WeightSharingModule()
    fresh_optimizer = ADAMW(fresh.parameters())
    record = tiekit.load_checkpoint(path, model=fresh, optimizer=fresh_optimizer)
    assert record["step"] == 1 and fresh.layer_3.weight is fresh.layer_1.weight
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert torch.equal(fresh_optimizer.state[fresh.layer_1.weight]["exp_avg"], moment)


def test_a_loop_saving_in_the_background_stages_every_checkpoint_into_the_same_memory(tmp_path: Path) -> None:
    """fit's way (save_checkpoint_reusing): the second save copies into the first one's host
    tensors once that is written; without them every save takes new memory (the control)."""
    from tiekit.checkpoint.saving import save_checkpoint_reusing

    model, optimizer = trained()
    first_values = {k: v.clone() for k, v in model.state_dict().items()}
    handle, staged = save_checkpoint_reusing(
        tmp_path / "a.safetensors", model=model, optimizer=optimizer, step=1, blocking=False
    )
    handle.wait(timeout=60)
    own = {p.data_ptr() for p in model.parameters()}
    assert not own & {t.data_ptr() for t in staged.values()}  # copies, never the model's memory
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    second_values = {k: v.clone() for k, v in model.state_dict().items()}
    handle, again = save_checkpoint_reusing(
        tmp_path / "b.safetensors", model=model, optimizer=optimizer, step=2, blocking=False, staging=staged
    )
    handle.wait(timeout=60)
    assert again.keys() == staged.keys()
    assert all(again[k].data_ptr() == staged[k].data_ptr() for k in again)  # the same buffers, refilled
    handle, control = save_checkpoint_reusing(tmp_path / "c.safetensors", model=model, step=3, blocking=False)
    handle.wait(timeout=60)
    assert not {t.data_ptr() for t in control.values()} & {t.data_ptr() for t in staged.values()}

    for path, values, step in (
        (tmp_path / "a.safetensors", first_values, 1),
        (tmp_path / "b.safetensors", second_values, 2),
    ):
        fresh = WeightSharingModule()
        assert tiekit.load_checkpoint(path, model=fresh)["step"] == step
        assert fresh.layer_3.weight is fresh.layer_1.weight
        for name, value in fresh.state_dict().items():
            assert torch.equal(value, values[name]), (path.name, name)


def test_the_previous_checkpoint_stays_until_the_new_one_is_written(tmp_path: Path) -> None:
    model, _ = trained()
    path = tmp_path / "ckpt.safetensors"
    tiekit.save_checkpoint(path, model=model, step=1)
    with writer_held():
        handle = tiekit.save_checkpoint(path, model=model, step=2, blocking=False)
        assert tiekit.load_checkpoint(path, model=WeightSharingModule())["step"] == 1
    handle.wait(timeout=60)
    assert tiekit.load_checkpoint(path, model=WeightSharingModule())["step"] == 2


def test_a_failed_background_write_is_raised_by_wait(tmp_path: Path) -> None:
    model, _ = trained()
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    handle = tiekit.save_checkpoint(blocker / "ckpt.safetensors", model=model, blocking=False)
    with pytest.raises(tiekit.CheckpointError, match="file"):
        handle.wait(timeout=60)


def test_collective_save_checkpoint_refuses_to_run_in_the_background(tmp_path: Path) -> None:
    model, _ = trained()
    with pytest.raises(tiekit.TiekitError, match="blocking=False"):
        tiekit.collective_save_checkpoint(tmp_path / "c.safetensors", model=model, blocking=False)
    assert not list(tmp_path.iterdir())


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 32, generator=generator), torch.randn(32, 10, generator=generator))


FIT: dict[str, Any] = {"loss_fn": F.mse_loss, "devices": "cpu", "batch_size": 4, "optimizer": ADAMW, "progress": False}


@pytest.mark.parametrize("background", [True, False], ids=["async", "blocking"])
def test_fit_returns_with_its_checkpoints_complete(tmp_path: Path, background: bool) -> None:
    result = tiekit.fit(
        WeightSharingModule,
        data(),
        max_steps=6,
        checkpoint_dir=tmp_path,
        checkpoint_every=2,
        checkpoint_async=background,
        **FIT,
    )
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-00000002.safetensors", "step-00000004.safetensors", "step-00000006.safetensors"]
    fresh = WeightSharingModule()
    assert tiekit.load_checkpoint(tmp_path / names[-1], model=fresh)["step"] == 6
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, result.model.state_dict()[name]), name


def test_fit_raises_a_failed_background_save(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(tiekit.CheckpointError, match="file"):
        tiekit.fit(WeightSharingModule, data(), max_steps=2, checkpoint_dir=blocker / "ckpt", **FIT)


def test_resume_from_a_folder_without_a_committed_checkpoint_names_it(tmp_path: Path) -> None:
    killed = tmp_path / "step-00000004"
    (killed / "save-0123").mkdir(parents=True)  # what a save killed before its marker leaves
    with pytest.raises(tiekit.TiekitError, match="step-00000004"):
        tiekit.fit(WeightSharingModule, data(), max_steps=2, resume=killed, **FIT)
    assert tiekit.dcp.is_sharded_checkpoint(killed) is False
