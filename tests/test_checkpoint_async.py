"""save_checkpoint(blocking=False) and fit's background checkpoints (issue 12): the state is
copied when the call returns, the file appears whole once written, the previous one stays
loadable until then, and a failed background write is an error of fit's.

The background writer is held with an event (a job queued ahead of the save on its one thread),
so "training changed the model while the file was written" happens every run, not by chance."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from held_writers import writer_held
from models import WeightSharingModule, filled
from safetensors import safe_open
from torch import nn
from torch.utils.data import TensorDataset

import tiekit
from tiekit.checkpoint.saving import _background

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


def trained(make: Callable[[], Any] = WeightSharingModule) -> tuple[Any, torch.optim.Optimizer]:
    """A fresh model after one AdamW step (so the optimizer has state)."""
    torch.manual_seed(0)
    model = make()
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
    """fit's way (save_checkpoint_reusing): the second save copies into the first one's file
    image once that is written; without it every save takes new memory (the control)."""
    from tiekit.checkpoint.image import FileImage
    from tiekit.checkpoint.saving import save_checkpoint_reusing

    model, optimizer = trained()
    first_values = {k: v.clone() for k, v in model.state_dict().items()}
    handle, staged, _ = save_checkpoint_reusing(
        tmp_path / "a.safetensors", model=model, optimizer=optimizer, step=1, blocking=False
    )
    handle.wait(timeout=60)
    assert isinstance(staged, FileImage)
    own = {p.data_ptr() for p in model.parameters()}
    assert not own & {t.data_ptr() for t in staged.tensors.values()}  # copies, never the model's memory
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    second_values = {k: v.clone() for k, v in model.state_dict().items()}
    handle, again, _ = save_checkpoint_reusing(  # a longer step number: a longer header, same tensors
        tmp_path / "b.safetensors", model=model, optimizer=optimizer, step=2**40, blocking=False, staging=staged
    )
    handle.wait(timeout=60)
    assert again is staged  # the same memory, refilled
    handle, control, _ = save_checkpoint_reusing(tmp_path / "c.safetensors", model=model, step=3, blocking=False)
    handle.wait(timeout=60)
    assert isinstance(control, FileImage)
    assert not {t.data_ptr() for t in control.tensors.values()} & {t.data_ptr() for t in staged.tensors.values()}

    for path, values, step in (
        (tmp_path / "a.safetensors", first_values, 1),
        (tmp_path / "b.safetensors", second_values, 2**40),
    ):
        fresh = WeightSharingModule()
        assert tiekit.load_checkpoint(path, model=fresh)["step"] == step
        assert fresh.layer_3.weight is fresh.layer_1.weight
        for name, value in fresh.state_dict().items():
            assert torch.equal(value, values[name]), (path.name, name)


class Transposed(nn.Module):
    """Weights stored transposed (not contiguous): a save writes host copies of its own of them,
    as it does for weights moved from an accelerator."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 128).t())
        self.bias = nn.Parameter(torch.zeros(64))


def test_a_background_save_of_mostly_private_host_copies_writes_them_where_they_are(tmp_path: Path) -> None:
    """When the host copies a save made anyway (transfers from a device, here transposed weights
    made contiguous) are most of its bytes, they are written from where they are, without a
    file image holding the state a second time; training goes on changing the rest meanwhile."""
    from tiekit.checkpoint.saving import save_checkpoint_reusing

    model = Transposed()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with writer_held():
        handle, staged, _ = save_checkpoint_reusing(tmp_path / "t.safetensors", model=model, step=5, blocking=False)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    handle.wait(timeout=60)
    assert staged is None
    fresh = Transposed()
    assert tiekit.load_checkpoint(tmp_path / "t.safetensors", model=fresh)["step"] == 5
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[name]), name
    model.weight = nn.Parameter(model.weight.detach().contiguous())  # the control: now shared memory
    handle, staged, _ = save_checkpoint_reusing(tmp_path / "c.safetensors", model=model, step=6, blocking=False)
    handle.wait(timeout=60)
    assert staged is not None


def test_the_previous_checkpoint_stays_until_the_new_one_is_written(tmp_path: Path) -> None:
    model, _ = trained()
    path = tmp_path / "ckpt.safetensors"
    tiekit.save_checkpoint(path, model=model, step=1)
    with writer_held():
        handle = tiekit.save_checkpoint(path, model=model, step=2, blocking=False)
        assert tiekit.load_checkpoint(path, model=WeightSharingModule())["step"] == 1
    handle.wait(timeout=60)
    assert tiekit.load_checkpoint(path, model=WeightSharingModule())["step"] == 2


def test_blocking_saves_from_two_threads_both_wait_for_the_background_save_before_them(tmp_path: Path) -> None:
    """Thread A's blocking save took the pending background save X out of the record while it
    waited for it, so thread B's blocking save, made meanwhile, found nothing to wait for: B wrote
    at once and X (older) then landed on top of it (probe: steps 3, then 1, on disk)."""
    model, _ = trained()
    path = tmp_path / "ckpt.safetensors"
    written_at_return: dict[str, bool] = {}  # thread name: was X written when its blocking save returned
    with writer_held():
        x = tiekit.save_checkpoint(path, model=model, step=1, blocking=False)

        def blocking(step: int) -> None:
            tiekit.save_checkpoint(path, model=model, step=step)
            written_at_return[threading.current_thread().name] = x.done()

        a = threading.Thread(target=blocking, args=(2,), name="a")
        a.start()
        time.sleep(0.3)  # A is waiting for X
        b = threading.Thread(target=blocking, args=(3,), name="b")
        b.start()
        time.sleep(0.3)
        assert written_at_return == {}  # both wait: the writer is held, so X is not written yet
    a.join(60)
    b.join(60)
    assert written_at_return == {"a": True, "b": True}
    assert tiekit.load_checkpoint(path, model=WeightSharingModule())["step"] in (2, 3)


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


def test_collective_saves_name_a_path_of_the_wrong_type(tmp_path: Path) -> None:
    """Swapped arguments failed as os.fspath's TypeError (probe); now refused before any write."""
    model, _ = trained()
    with pytest.raises(tiekit.CheckpointError, match=re.escape("tiekit.collective_save_model(model, path): path")):
        tiekit.collective_save_model(tmp_path / "m.safetensors", model)  # type: ignore[arg-type]
    said = "tiekit.collective_save_checkpoint(path, model=...): path must be a str or os.PathLike, not a model"
    with pytest.raises(tiekit.CheckpointError, match=re.escape(said)):
        tiekit.collective_save_checkpoint(model, model=model)  # type: ignore[arg-type]
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
    folder = tmp_path / "ckpt"
    calls = 0

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 2 and folder.is_dir():  # the folder fit checked at the start becomes a file
            shutil.rmtree(folder)
            folder.write_text("not a folder")
        return F.mse_loss(out, target)

    with pytest.raises(tiekit.CheckpointError, match="ckpt"):
        tiekit.fit(WeightSharingModule, data(), max_steps=2, checkpoint_dir=folder, **{**FIT, "loss_fn": loss_fn})


def test_resume_from_a_folder_without_a_committed_checkpoint_names_it(tmp_path: Path) -> None:
    killed = tmp_path / "step-00000004"
    (killed / "save-0123").mkdir(parents=True)  # what a save killed before its marker leaves
    with pytest.raises(tiekit.TiekitError, match="step-00000004"):
        tiekit.fit(WeightSharingModule, data(), max_steps=2, resume=killed, **FIT)
    assert tiekit.dcp.is_sharded_checkpoint(killed) is False


class NormNet(nn.Module):
    """A tied model whose forward pass writes buffers (BatchNorm's running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_1 = nn.Linear(32, 10, bias=False)
        self.norm = nn.BatchNorm1d(10)
        self.layer_2 = nn.Linear(10, 32, bias=False)
        self.layer_3 = nn.Linear(32, 10, bias=False)
        self.layer_3.weight = self.layer_1.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_3(self.layer_2(self.norm(self.layer_1(x))))


def saved_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    moments = {f"{n}/{k}": v.clone() for n, p in model.named_parameters() for k, v in optimizer.state[p].items()}
    return {**{k: v.clone() for k, v in model.state_dict().items()}, **moments}


KINDS = ["file", "sharded"]


def deferred_save(kind: str, where: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Any:
    """fit's background save (``defer=True``) into a file or a sharded folder: (handle, copies)."""
    from tiekit.checkpoint.saving import save_checkpoint_reusing
    from tiekit.dcp.saving import save_sharded_staged

    if kind == "file":
        handle, _, copies = save_checkpoint_reusing(
            where, model=model, optimizer=optimizer, step=step, blocking=False, defer=True
        )
    else:
        extra = {"step": step}
        handle, _, copies = save_sharded_staged(
            model, where, optimizer=optimizer, extra=extra, blocking=False, defer=True
        )
    assert copies is not None
    return handle, copies


def checkpoint_in(folder: Path, kind: str) -> Path:
    """Where a test's checkpoint of ``kind`` goes: a file, or a sharded save's folder."""
    return folder / ("ckpt.safetensors" if kind == "file" else "ckpt")


def blocking_save(kind: str, where: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    if kind == "file":
        tiekit.save_checkpoint(where, model=model, optimizer=optimizer, step=step)
    else:
        tiekit.save_sharded(model, where, optimizer=optimizer, extra={"step": step})


def committed(kind: str, where: Path) -> bool:
    return where.exists() if kind == "file" else (where / tiekit.dcp.MARKER_NAME).exists()


def saved_step(kind: str, where: Path) -> int:
    if kind == "file":
        return int(tiekit.load_checkpoint(where, model=NormNet())["step"])
    return int(tiekit.load_sharded(NormNet(), where).extra["step"])


def stored_state(kind: str, where: Path) -> dict[str, torch.Tensor]:
    """Everything the checkpoint at ``where`` holds, loaded into a fresh NormNet and AdamW."""
    fresh = NormNet()
    fresh_optimizer = ADAMW(fresh.parameters())
    if kind == "file":
        tiekit.load_checkpoint(where, model=fresh, optimizer=fresh_optimizer)
    else:
        tiekit.load_sharded(fresh, where, optimizer=fresh_optimizer)
    assert fresh.layer_3.weight is fresh.layer_1.weight
    return saved_state(fresh, fresh_optimizer)


@pytest.mark.parametrize("kind", KINDS)
def test_deferred_copies_are_made_by_the_writer_and_committed_only_once_settled(tmp_path: Path, kind: str) -> None:
    """fit's background saves (``defer=True``): buffers are copied in the call (the next forward
    pass writes them), parameters and optimizer state by the writer, before the next optimizer
    step; the checkpoint appears only once the training thread has settled the copies (a sharded
    save waits for that in DCP's planning step)."""
    model, optimizer = trained(NormNet)
    expected = saved_state(model, optimizer)
    where = checkpoint_in(tmp_path, kind)
    with writer_held(kind):
        handle, copies = deferred_save(kind, where, model, optimizer, step=1)
        model(torch.randn(4, 32)).sum().backward()  # the next step's forward pass: running statistics change
    assert not torch.equal(model.norm.running_mean, expected["norm.running_mean"])
    with pytest.raises(tiekit.CheckpointError, match="not finished"):
        handle.wait(timeout=1.0)  # nobody settled the copies yet
    assert not committed(kind, where)
    copies.settle()
    optimizer.step()  # parameters and moments change: the copies were made before
    handle.wait(timeout=60)
    got = stored_state(kind, where)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("kind", KINDS)
def test_a_parameter_written_before_the_copies_settle_fails_the_save_and_keeps_the_previous_one(
    tmp_path: Path, kind: str
) -> None:
    model, optimizer = trained(NormNet)
    where = checkpoint_in(tmp_path, kind)
    blocking_save(kind, where, model, optimizer, step=0)
    with writer_held(kind):
        handle, copies = deferred_save(kind, where, model, optimizer, step=1)
        with torch.no_grad():
            model.layer_2.weight.mul_(2.0)  # a forward pass that writes its own parameter
    copies.settle()
    with pytest.raises(tiekit.CheckpointError, match=r"'layer_2\.weight'.*checkpoint_async=False"):
        handle.wait(timeout=60)
    assert saved_step(kind, where) == 0

    # The control: nothing written in between (and a sharded save after a failed one is not refused).
    handle, copies = deferred_save(kind, where, model, optimizer, step=2)
    copies.settle()
    handle.wait(timeout=60)
    assert saved_step(kind, where) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_a_save_whose_thread_ends_without_settling_is_not_written(tmp_path: Path, kind: str) -> None:
    model, optimizer = trained(NormNet)
    where = checkpoint_in(tmp_path, kind)
    made: list[Any] = []
    thread = threading.Thread(target=lambda: made.append(deferred_save(kind, where, model, optimizer, step=1)))
    thread.start()
    thread.join()
    handle, _ = made[0]
    with pytest.raises(tiekit.CheckpointError, match="ended before its copy could be checked"):
        handle.wait(timeout=60)
    assert not committed(kind, where)


def norm_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(48, 32, generator=generator), torch.randn(48, 10, generator=generator))


@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp"], ids=["one-process", "ddp-2-gloo", "fsdp-2-gloo"])
def test_fit_background_checkpoints_hold_what_blocking_ones_hold(tmp_path: Path, strategy: str) -> None:
    """Every checkpoint of a run saving in the background (parameters and moments copied beside
    the next step) equals the blocking run's, tensor for tensor, running statistics included; in
    one process, from the master of two DDP processes, and as two FSDP2 ranks' sharded folders."""
    runs = {}
    where: dict[str, Any] = {"devices": "cpu"} if strategy == "single" else {"strategy": strategy, "devices": 2}
    for background in (True, False):
        folder = tmp_path / ("async" if background else "blocking")
        kw: dict[str, Any] = {"checkpoint_dir": folder, "checkpoint_every": 2, "checkpoint_async": background}
        tiekit.fit(NormNet, norm_data(), max_steps=7, **kw, **{**FIT, **where})
        runs[background] = folder
    names = sorted(p.name for p in runs[False].iterdir())
    assert names == sorted(p.name for p in runs[True].iterdir()) and len(names) == 4
    for name in names:
        if strategy == "fsdp":  # sharded folders: the weights, buffers and moments they load
            background, blocking = (
                stored_state("sharded", runs[True] / name),
                stored_state("sharded", runs[False] / name),
            )
            assert background.keys() == blocking.keys()
            for key, value in blocking.items():
                assert torch.equal(background[key], value), (name, key)
            continue
        with safe_open(str(runs[True] / name), "pt") as a, safe_open(str(runs[False] / name), "pt") as b:
            assert set(a.keys()) == set(b.keys())
            for key in a.keys():  # noqa: SIM118 - safe_open is not a mapping
                assert torch.equal(a.get_tensor(key), b.get_tensor(key)), (name, key)


class WritesItsWeightInForward(NormNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.layer_2.weight.clamp_(-0.5, 0.5)  # a constraint applied in place, outside the optimizer
        return super().forward(x)


def test_fit_refuses_a_background_checkpoint_of_a_weight_its_forward_writes(tmp_path: Path) -> None:
    with pytest.raises(tiekit.CheckpointError, match=r"'layer_2\.weight'.*checkpoint_async=False"):
        tiekit.fit(
            WritesItsWeightInForward, norm_data(), max_steps=4, checkpoint_dir=tmp_path, checkpoint_every=2, **FIT
        )
    result = tiekit.fit(  # the control: copied in the step, the checkpoint holds the step's weights
        WritesItsWeightInForward,
        norm_data(),
        max_steps=4,
        checkpoint_dir=tmp_path / "blocking",
        checkpoint_every=2,
        checkpoint_async=False,
        **FIT,
    )
    fresh = WritesItsWeightInForward()
    assert tiekit.load_checkpoint(tmp_path / "blocking" / "step-00000004.safetensors", model=fresh)["step"] == 4
    assert torch.equal(fresh.layer_2.weight, result.model.layer_2.weight)


def test_sharded_background_saves_refill_the_host_copies_of_the_last_one(tmp_path: Path) -> None:
    """fit's sharded background saves: the second save copies into the host tensors the first one
    made (``staging``), and each checkpoint holds the values of its own call."""
    from tiekit.dcp.saving import save_sharded_staged

    model, optimizer = trained(NormNet)
    first = saved_state(model, optimizer)
    handle, staging, _ = save_sharded_staged(model, tmp_path / "a", optimizer=optimizer, blocking=False)
    handle.wait(timeout=60)
    assert staging
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    second = saved_state(model, optimizer)
    handle, again, _ = save_sharded_staged(model, tmp_path / "b", optimizer=optimizer, blocking=False, staging=staging)
    with torch.no_grad():  # training goes on: the save holds the values of its call
        for p in model.parameters():
            p.add_(1.0)
    handle.wait(timeout=60)
    assert again.keys() == staging.keys()
    assert all(again[k].data_ptr() == staging[k].data_ptr() for k in staging)  # refilled, not new memory
    for folder, expected in ((tmp_path / "a", first), (tmp_path / "b", second)):
        got = stored_state("sharded", folder)
        assert got.keys() == expected.keys()
        for name, value in got.items():
            assert torch.equal(value, expected[name]), (folder.name, name)


def test_adopted_state_lives_in_the_file_image_and_later_saves_write_it_without_a_copy(tmp_path: Path) -> None:
    """fit's way (``adopt=True``): the first save's ``settle`` moves the parameters and moments
    into its file image, values unchanged; the next save into that image has nothing to copy
    and, its writer held past the optimizer step, still writes the values of its call:
    ``settle`` took the image back, copying aside what was not yet written. A third save that
    needs a new image (a longer header) moves them again, into it."""
    from tiekit.checkpoint.saving import save_checkpoint_reusing

    model, optimizer = trained(NormNet)
    staging = None
    for step in (1, 2, 3):
        expected = saved_state(model, optimizer)
        where = tmp_path / f"step{step}.safetensors"
        with writer_held() if step == 2 else contextlib.nullcontext():
            handle, staged, copies = save_checkpoint_reusing(
                where,
                model=model,
                optimizer=optimizer,
                step=step,
                extra="x" * 5000 if step == 3 else None,
                blocking=False,
                defer=True,
                adopt=True,
                staging=staging,
            )
            assert staged is not None and copies is not None and copies.lent is not None
            assert (staged is staging) == (step == 2)
            block = staged.memory.untyped_storage().data_ptr()
            inside = [t.untyped_storage().data_ptr() == block for t in (model.layer_1.weight, model.norm.weight)]
            assert inside == [step == 2] * 2  # the first save copies, the second finds them in the image
            copies.settle()  # step 2: returns at once (nothing to copy), the writer still held
            if step == 2:  # nothing written yet: all of the image went aside for the writer
                assert copies.lent.copied == staged.memory.numel()
            moments = [v for p in model.parameters() for v in optimizer.state[p].values()]
            assert all(t.untyped_storage().data_ptr() == block for t in [*model.parameters(), *moments])
            assert all(torch.equal(v, expected[k]) for k, v in saved_state(model, optimizer).items())
            model(torch.randn(4, 32)).sum().backward()
            optimizer.step()  # changes the image itself from now on
        handle.wait(timeout=60)
        got = stored_state("file", where)
        for name, value in expected.items():
            assert torch.equal(got[name], value), (step, name)
        staging = staged
    assert model.layer_3.weight is model.layer_1.weight


class RecordsWhereItsWeightLives(NormNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.layer_1.weight
        storages.append(weight.untyped_storage().nbytes() // (weight.numel() * weight.element_size()))
        return super().forward(x)


storages: list[int] = []


def test_fit_trains_in_the_file_image_and_returns_a_model_with_memory_of_its_own(tmp_path: Path) -> None:
    """In a run saving in the background the weights live in the checkpoints' file image from the
    first save's next step on (its storage many times their size: moments, other tensors); the
    trained model fit returns owns memory of its size again. A blocking run never moves them."""
    for background in (True, False):
        storages.clear()
        result = tiekit.fit(
            RecordsWhereItsWeightLives,
            norm_data(),
            max_steps=6,
            checkpoint_dir=tmp_path / str(background),
            checkpoint_every=2,
            checkpoint_async=background,
            **FIT,
        )
        assert (storages[:2], max(storages) > 1) == ([1, 1], background), storages
        for p in result.model.parameters():
            assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
        assert result.model.layer_3.weight is result.model.layer_1.weight


# The last save of a file wins. Before, a blocking save of a file a background save was still to
# write returned at once, and the older background write then landed on top of it.


def hold_writer_until_written(path: Path, at_most: float = 0.5) -> None:
    """Queue a job on the single-file writer that holds it until ``path`` exists, at most
    ``at_most`` seconds: a background save queued behind it is written after a blocking save of
    ``path`` that does not wait for it (the bug, every run), else once the hold runs out."""

    def hold() -> None:
        deadline = time.monotonic() + at_most
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    _background().submit(hold)


def saved_weights(path: Path) -> set[float]:
    """The distinct values of the weights stored in ``path``."""
    fresh = WeightSharingModule()
    tiekit.load_model(fresh, path, strict=False)
    assert fresh.layer_3.weight is fresh.layer_1.weight
    return {float(v) for p in fresh.parameters() for v in p.detach().flatten()}


def later_blocking_save(how: str, path: Path, model: nn.Module) -> None:
    """A blocking save of ``model`` as step 2, the ``how`` way, to ``path`` (or the same file)."""
    from tiekit.checkpoint.saving import write_training_checkpoint

    if how == "save_model":
        tiekit.save_model(model, path)
    elif how == "lightning":
        write_training_checkpoint(path, model=model, optimizer=None, step=2, extra=None, durable=True)
    elif how == "relative path":
        tiekit.save_checkpoint(os.path.relpath(path), model=model, step=2)
    elif how == "symbolic link":
        link = path.with_name("link.safetensors")
        link.symlink_to(path.name)
        tiekit.save_checkpoint(link, model=model, step=2)
    else:
        tiekit.save_checkpoint(path, model=model, step=2)


@pytest.mark.parametrize("how", ["save_checkpoint", "save_model", "lightning", "relative path", "symbolic link"])
def test_a_blocking_save_after_a_background_save_of_the_same_file_is_the_one_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Before, the blocking save returned while the background one was queued, which then wrote
    the older weights and step over it (save_model and Lightning's writer alike; a relative path or
    a link to the file is the same file)."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "ckpt.safetensors"
    hold_writer_until_written(path)
    older = tiekit.save_checkpoint(path, model=filled(1.0), step=1, blocking=False)
    later_blocking_save(how, path, filled(2.0))
    written_first = older.done()  # the blocking save waited for it: the file is the later one's for good
    older.wait(timeout=60)
    assert saved_weights(path) == {2.0}
    if how != "save_model":
        assert tiekit.load_checkpoint(path, model=WeightSharingModule())["step"] == 2
    assert written_first


def test_background_saves_of_the_same_file_are_written_in_call_order(tmp_path: Path) -> None:
    """The one writer thread writes them as they were made: the later one is left (also through a
    link to the file). Held things in the queue, this passed before as well."""
    path = tmp_path / "ckpt.safetensors"
    link = tmp_path / "link.safetensors"
    link.symlink_to(path.name)
    with writer_held():
        first = tiekit.save_checkpoint(path, model=filled(1.0), step=1, blocking=False)
        second = tiekit.save_checkpoint(link, model=filled(2.0), step=2, blocking=False)
    second.wait(timeout=60)
    assert first.done()
    first.wait(timeout=0)
    assert saved_weights(path) == {2.0} and tiekit.load_checkpoint(path, model=WeightSharingModule())["step"] == 2
    # A blocking save after them waits for both.
    with writer_held():
        tiekit.save_checkpoint(path, model=filled(3.0), step=3, blocking=False)
        tiekit.save_checkpoint(path, model=filled(4.0), step=4, blocking=False)
    tiekit.save_checkpoint(path, model=filled(5.0), step=5)
    assert saved_weights(path) == {5.0}


def failing_background_save(path: Path) -> Any:
    """A background save of ``path`` that fails when written (fit's kind, a weight written before
    its copies settled: nothing is written), queued to be written only after ``path`` exists (at
    most 0.5 s). Its handle."""
    model, optimizer = trained()
    hold_writer_until_written(path)
    handle, copies = deferred_save("file", path, model, optimizer, step=1)
    with torch.no_grad():
        model.layer_2.weight.mul_(2.0)
    copies.settle()
    return handle


@pytest.mark.parametrize("later", ["blocking", "background"])
def test_a_failed_background_save_nothing_waited_for_warns_at_the_next_save_of_its_file(
    tmp_path: Path, later: str
) -> None:
    """As a sharded save into the same folder: the later save is made (a blocking one waits for the
    failed one first) and warns of the failure; the failed save's handle still raises it. Before,
    the later save said nothing (the failure surfaced only on stderr at exit)."""
    path = tmp_path / "ckpt.safetensors"
    failed = failing_background_save(path)
    unseen = r"ckpt\.safetensors: 'layer_2\.weight' was written in place.*nothing waited for this save"
    with pytest.warns(RuntimeWarning, match=unseen):
        if later == "blocking":
            tiekit.save_checkpoint(path, model=filled(2.0), step=2)
        else:
            failed.join()  # a background save reports a failure that is over, and writes after it
            tiekit.save_checkpoint(path, model=filled(2.0), step=2, blocking=False).wait(timeout=60)
    assert saved_weights(path) == {2.0}
    with pytest.raises(tiekit.CheckpointError, match="was written in place"):
        failed.wait(timeout=0)
    # A failure that was waited for is not reported again.
    seen = failing_background_save(path)
    with pytest.raises(tiekit.CheckpointError):
        seen.wait(timeout=60)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        tiekit.save_checkpoint(path, model=filled(3.0), step=3)
    assert saved_weights(path) == {3.0}
