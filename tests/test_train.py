"""tiekit.fit on the CPU, in this process: exact resume, samplers, precisions, logs, errors."""

from __future__ import annotations

import csv
import functools
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import gpt2
from safetensors import safe_open
from torch import nn
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    SubsetRandomSampler,
    TensorDataset,
)

import tiekit
from tiekit.train.data import make_loader
from tiekit.train.losses import LossWatch

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
CPU = {"devices": "cpu", "progress": False, "optimizer": ADAMW}


class DropoutNet(nn.Module):
    """Tied (``c.weight`` is ``a.weight``), with dropout: a resume must restore the RNG too."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.3)
        self.b = nn.Linear(16, 8)
        self.c = nn.Linear(8, 16)
        self.c.weight = self.a.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.a(x)) + 0.1 * self.c(x)
        return F.mse_loss(self.b(self.drop(hidden)), y)


class Recording(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A dataset that remembers which indices were read, in order."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(size, 8, generator=generator)
        self.y = torch.randn(size, 8, generator=generator)
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.read.append(i)
        return self.x[i], self.y[i]


def data(size: int = 40) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(size, 8, generator=generator), torch.randn(size, 8, generator=generator))


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_continues_bit_identically(tmp_path: Path) -> None:
    # 10 steps per epoch: stop mid-epoch at 7, resume to 23 (across two epoch boundaries).
    kw: dict[str, Any] = {**CPU, "batch_size": 4, "seed": 1}
    straight = tiekit.fit(DropoutNet, data(), max_steps=23, **kw)
    first = tiekit.fit(DropoutNet, data(), max_steps=7, checkpoint_dir=tmp_path, checkpoint_every=5, **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005.safetensors", "step-00000007.safetensors"]
    assert first.checkpoint == tmp_path / "step-00000007.safetensors"
    resumed = tiekit.fit(DropoutNet, data(), max_steps=23, checkpoint_dir=tmp_path, resume="last", **kw)

    assert (resumed.steps, resumed.epochs) == (23, 2)
    assert resumed.losses == straight.losses[7:]
    assert same(weights(resumed.model), weights(straight.model))
    assert resumed.model.c.weight is resumed.model.a.weight
    assert resumed.checkpoint == tmp_path / "step-00000023.safetensors"
    # Resumed by path, without a folder to write in: no checkpoint holds the model (fit named the
    # one it resumed from, 16 steps behind the model it returned).
    by_path = tiekit.fit(DropoutNet, data(), max_steps=23, resume=first.checkpoint, **kw)
    assert by_path.checkpoint is None and same(weights(by_path.model), weights(straight.model))

    # The control: weights and optimizer state alone, without the saved data position and RNG
    # states, do not continue the run.
    naive = DropoutNet()
    optimizer = ADAMW(naive.parameters())
    tiekit.load_checkpoint(tmp_path / "step-00000007.safetensors", model=naive, optimizer=optimizer)
    restarted = tiekit.fit(naive, data(), max_steps=16, **kw)
    assert not same(weights(restarted.model), weights(straight.model))


def test_a_resume_at_or_past_max_steps_trains_nothing_and_leaves_the_checkpoint_alone(tmp_path: Path) -> None:
    kw: dict[str, Any] = {**CPU, "batch_size": 4, "checkpoint_dir": tmp_path}
    first = tiekit.fit(DropoutNet, data(), max_steps=4, **kw)
    path = tmp_path / "step-00000004.safetensors"
    written = path.stat()
    with pytest.warns(UserWarning, match=r"checkpoint is at step 4, past max_steps=2: nothing to train"):
        past = tiekit.fit(DropoutNet, data(), max_steps=2, resume=path, **kw)
    at = tiekit.fit(DropoutNet, data(), max_steps=4, resume="last", **kw)  # a restart after the end: quiet
    for run in (past, at):
        assert (run.steps, run.losses) == (4, ()) and same(weights(run.model), weights(first.model))
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)  # rewritten before
    assert os.listdir(tmp_path) == [path.name]
    # The same when the epochs are done: 40 samples in batches of 10, one epoch is 4 steps.
    folder = tmp_path / "epochs"
    ekw: dict[str, Any] = {**CPU, "batch_size": 10, "checkpoint_dir": folder, "epochs": 1}
    tiekit.fit(DropoutNet, data(), **ekw)
    written = (folder / "step-00000004.safetensors").stat()
    done = tiekit.fit(DropoutNet, data(), resume="last", **ekw)
    after = (folder / "step-00000004.safetensors").stat()
    assert (done.steps, done.losses) == (4, ()) and after.st_mtime_ns == written.st_mtime_ns
    # Past the epochs asked for: said, as past max_steps is (it trained nothing without a word; probe).
    tiekit.fit(DropoutNet, data(), **{**ekw, "checkpoint_dir": tmp_path / "two", "epochs": 2})
    with pytest.warns(UserWarning, match=r"checkpoint is past epochs=1 \(2 epoch\(s\) done\): nothing to train"):
        past_epochs = tiekit.fit(DropoutNet, data(), resume="last", **{**ekw, "checkpoint_dir": tmp_path / "two"})
    assert (past_epochs.steps, past_epochs.losses) == (8, ())


def test_a_resume_with_another_batch_size_says_the_position_is_taken_in_the_new_batches(tmp_path: Path) -> None:
    kw: dict[str, Any] = {**CPU, "checkpoint_dir": tmp_path, "seed": 1}
    tiekit.fit(DropoutNet, data(), max_steps=3, batch_size=4, **kw)  # 3 of 10 batches of 4: sample 12 next
    with pytest.warns(
        UserWarning,
        match=r"saved by a run that took 4 samples per step \(1 loader\(s\) of 4\), with 8 .* taken in steps",
    ):
        resumed = tiekit.fit(DropoutNet, data(), max_steps=5, batch_size=8, resume="last", **kw)
    assert resumed.steps == 5
    with warnings.catch_warnings():  # the same batch size: nothing to say
        warnings.simplefilter("error")
        tiekit.fit(DropoutNet, data(), max_steps=7, batch_size=8, resume="last", **kw)


def test_a_resume_trains_with_the_options_the_optimizer_was_given(tmp_path: Path) -> None:
    """Found by a probe: loading the checkpoint put back the saving run's learning rate over the
    factory's, so fit's own advice after a divergence (resume from an earlier checkpoint with a
    lower learning rate) changed nothing: with lr=0.0 the weights still moved."""
    kw: dict[str, Any] = {**CPU, "batch_size": 4, "seed": 1}
    first = tiekit.fit(DropoutNet, data(), max_steps=3, checkpoint_dir=tmp_path / "a", **kw)  # lr 1e-2
    assert first.checkpoint is not None
    standing = functools.partial(torch.optim.AdamW, lr=0.0)
    with pytest.warns(
        UserWarning, match=r"with the options the optimizer was built with: lr=0\.0 \(the checkpoint's: 0\.01\)"
    ):
        still = tiekit.fit(DropoutNet, data(), max_steps=6, resume=first.checkpoint, **{**kw, "optimizer": standing})
    assert still.steps == 6 and len(still.losses) == 3
    assert same(weights(still.model), weights(first.model))  # lr 0: nothing moved
    assert still.model.c.weight is still.model.a.weight
    # The control: resumed with the saving run's own factory, the same three steps move the weights.
    on = tiekit.fit(DropoutNet, data(), max_steps=6, resume=first.checkpoint, **kw)
    assert not same(weights(on.model), weights(first.model))


def test_a_resume_with_another_drop_last_says_the_epochs_differ(tmp_path: Path) -> None:
    """fit(drop_last=None) takes a DataLoader's own drop_last since e614978: a run continued with
    a loader that keeps its short batch, from a checkpoint of a run that dropped it, trained the
    batch the original never did, without a word (adversarial probe). Checkpoints record it now."""
    kw: dict[str, Any] = {**CPU, "checkpoint_dir": tmp_path, "seed": 1}
    dataset = data(12)
    tiekit.fit(DropoutNet, dataset, max_steps=2, batch_size=5, drop_last=True, **kw)
    with pytest.warns(UserWarning, match=r"saved by a run with drop_last=True, with drop_last=False: an epoch has"):
        tiekit.fit(DropoutNet, DataLoader(dataset, batch_size=5), max_steps=3, resume="last", **kw)
    with warnings.catch_warnings():  # the same: nothing to say
        warnings.simplefilter("error")
        tiekit.fit(DropoutNet, DataLoader(dataset, batch_size=5), max_steps=4, resume="last", **kw)


def test_a_resume_with_a_dataset_of_another_length_says_the_epochs_differ(tmp_path: Path) -> None:
    """A checkpoint at batch 6 of an epoch of 10, resumed with a dataset of 4 batches, skipped the
    rest of that epoch without a word, and with one of 12 batches shifted the order (probe);
    checkpoints record how many samples an epoch is drawn from now."""
    kw: dict[str, Any] = {**CPU, "seed": 1, "batch_size": 4}
    saved = tiekit.fit(DropoutNet, data(40), max_steps=6, checkpoint_dir=tmp_path / "a", **kw)
    for size in (16, 48):
        with pytest.warns(
            UserWarning,
            match=rf"saved by a run whose epoch was drawn from 40 samples, with {size} \(train_data, or the sampler "
            r"of its DataLoader, has another length\): its position in the epoch \(6 batches\) .* \(all of it is "
            r"skipped when this epoch has 6 batches or fewer\); the epochs and the data order differ",
        ):
            tiekit.fit(DropoutNet, data(size), max_steps=8, resume=saved.checkpoint, **kw)
    with warnings.catch_warnings():  # the same length: nothing to say
        warnings.simplefilter("error")
        tiekit.fit(DropoutNet, data(40), max_steps=8, resume=saved.checkpoint, **kw)
    # A sampler of the user's that fit keeps: its length is what an epoch is drawn from.
    draws = {n: DataLoader(data(40), batch_size=4, sampler=SubsetRandomSampler(range(n))) for n in (24, 20)}
    subset = tiekit.fit(DropoutNet, draws[24], max_steps=3, checkpoint_dir=tmp_path / "b", **kw)
    with pytest.warns(UserWarning, match=r"whose epoch was drawn from 24 samples, with 20 \("):
        tiekit.fit(DropoutNet, draws[20], max_steps=4, resume=subset.checkpoint, **kw)
    # A checkpoint from before tiekit recorded it resumes as it did: quietly.
    assert saved.checkpoint is not None
    model = DropoutNet()
    optimizer = ADAMW(model.parameters())
    record = tiekit.load_checkpoint(saved.checkpoint, model=model, optimizer=optimizer)
    older = {k: v for k, v in record["extra"].items() if k != "samples_per_epoch"}
    tiekit.save_checkpoint(tmp_path / "older.safetensors", model=model, optimizer=optimizer, step=6, extra=older)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiekit.fit(DropoutNet, data(16), max_steps=8, resume=tmp_path / "older.safetensors", **kw)


def test_a_resume_with_another_seed_or_shuffle_says_the_position_is_taken_in_another_order(tmp_path: Path) -> None:
    kw: dict[str, Any] = {**CPU, "checkpoint_dir": tmp_path, "batch_size": 4}
    tiekit.fit(DropoutNet, data(), max_steps=3, seed=1, **kw)  # 3 of 10 batches of seed 1's permutation
    with pytest.warns(UserWarning, match=r"saved by a run with seed=1, with seed=2: its position in the epoch \(3 "):
        tiekit.fit(DropoutNet, data(), max_steps=4, seed=2, resume="last", **kw)
    with pytest.warns(UserWarning, match=r"saved by a run with shuffle=False, with shuffle=True: its position"):
        tiekit.fit(DropoutNet, data(), max_steps=5, seed=2, shuffle=False, **{**kw, "checkpoint_dir": tmp_path / "b"})
        tiekit.fit(DropoutNet, data(), max_steps=6, seed=2, resume="last", **{**kw, "checkpoint_dir": tmp_path / "b"})
    with warnings.catch_warnings():  # the same seed and shuffle: nothing to say
        warnings.simplefilter("error")
        tiekit.fit(DropoutNet, data(), max_steps=5, seed=2, resume="last", **kw)
    # A checkpoint from before tiekit recorded them: nothing to say either.
    model, path = DropoutNet(), tmp_path / "step-00000005.safetensors"
    optimizer = ADAMW(model.parameters())
    record = tiekit.load_checkpoint(path, model=model, optimizer=optimizer)
    older = {k: v for k, v in record["extra"].items() if k not in ("seed", "shuffle")}
    tiekit.save_checkpoint(path, model=model, optimizer=optimizer, step=5, extra=older)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiekit.fit(DropoutNet, data(), max_steps=6, seed=3, shuffle=False, resume="last", **kw)
    # A DataLoader's own sampler orders its epochs: fit's shuffle, which it ignores, says nothing.
    loader, own = DataLoader(data(), batch_size=4, shuffle=True), {**kw, "checkpoint_dir": tmp_path / "loader"}
    tiekit.fit(DropoutNet, loader, max_steps=3, seed=1, **own)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiekit.fit(DropoutNet, loader, max_steps=4, seed=1, shuffle=False, resume="last", **own)
    # Nor does fit's seed, for a sampler whose own generator orders it.
    subset = SubsetRandomSampler(range(24), generator=torch.Generator().manual_seed(5))
    loader, own = DataLoader(data(), batch_size=4, sampler=subset), {**kw, "checkpoint_dir": tmp_path / "own"}
    tiekit.fit(DropoutNet, loader, max_steps=3, seed=1, **own)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiekit.fit(DropoutNet, loader, max_steps=4, seed=2, resume="last", **own)


def test_checkpoints_are_tied_and_reload_into_a_fresh_model(tmp_path: Path) -> None:
    result = tiekit.fit(DropoutNet, data(), max_steps=3, batch_size=4, checkpoint_dir=tmp_path, **CPU)
    assert result.checkpoint == tmp_path / "step-00000003.safetensors"
    with safe_open(str(result.checkpoint), "pt") as f:
        keys = set(f.keys())
    assert "a.weight" in keys and "c.weight" not in keys  # one tensor per tie group
    fresh = DropoutNet()
    fresh.c.weight = nn.Parameter(fresh.a.weight.detach().clone())  # arrives untied
    record = tiekit.load_checkpoint(result.checkpoint, model=fresh)
    assert fresh.c.weight is fresh.a.weight
    assert same(weights(fresh), weights(result.model))
    assert record["step"] == 3 and record["extra"]["epoch"] == 0 and record["extra"]["batches"] == 3


@pytest.mark.parametrize("background", [True, False], ids=["async", "blocking"])
def test_checkpoint_keep_deletes_the_runs_older_checkpoints_once_a_newer_is_complete(
    tmp_path: Path, background: bool
) -> None:
    kw: dict[str, Any] = {"batch_size": 4, "checkpoint_dir": tmp_path, "checkpoint_async": background, **CPU}
    earlier = tiekit.fit(DropoutNet, data(), max_steps=1, **kw).checkpoint  # another run's: not this run's to delete
    assert earlier == tmp_path / "step-00000001.safetensors"
    result = tiekit.fit(DropoutNet, data(), max_steps=11, checkpoint_every=2, checkpoint_keep=2, resume=earlier, **kw)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-00000001.safetensors", "step-00000010.safetensors", "step-00000011.safetensors"]
    assert tiekit.load_checkpoint(result.checkpoint, model=DropoutNet())["step"] == 11
    # The control: resumed from the same checkpoint again, without checkpoint_keep, it keeps all.
    kept = tiekit.fit(DropoutNet, data(), max_steps=4, checkpoint_every=2, resume=earlier, **kw)
    assert kept.checkpoint == tmp_path / "step-00000004.safetensors"
    assert len(list(tmp_path.iterdir())) == 5


def with_nan_at(index: int, size: int = 40) -> TensorDataset:
    """`data` with sample ``index``'s inputs NaN: the loss of the batch holding it is NaN."""
    x, y = data(size).tensors
    x = x.clone()
    x[index] = float("nan")
    return TensorDataset(x, y)


@pytest.mark.parametrize("background", [True, False], ids=["async", "blocking"])
def test_a_diverged_run_stops_at_its_next_save_and_keeps_the_last_good_checkpoint(
    tmp_path: Path, background: bool
) -> None:
    # Sample 25 is in step 7's batch (batches of 4, in order): step 8's save finds it.
    kw: dict[str, Any] = {"batch_size": 4, "checkpoint_dir": tmp_path, "checkpoint_async": background, **CPU}
    kw |= {"checkpoint_every": 2, "checkpoint_keep": 1, "shuffle": False, "max_steps": 10}
    diverged = pytest.raises(tiekit.TiekitError, match=r"the loss of step 7 was nan\. fit stopped at step 8")
    with pytest.warns(UserWarning, match="the loss of step 7 is nan: training has diverged"), diverged as raised:
        tiekit.fit(DropoutNet, with_nan_at(25), **kw)
    kept = tmp_path / "step-00000006.safetensors"
    assert f"the last one written: {kept}" in str(raised.value)
    assert [p.name for p in tmp_path.iterdir()] == [kept.name]  # step 8's NaN weights not written over it
    model = DropoutNet()
    tiekit.load_checkpoint(kept, model=model)
    assert all(p.isfinite().all() for p in model.parameters()) and model.c.weight is model.a.weight
    # The run resumes from it on good data, and a loss NaN before any save names no checkpoint.
    assert tiekit.fit(DropoutNet, data(), **kw | {"resume": "last"}).steps == 10
    # Saved only at the end, its losses fetched every 2 steps: the first NaN is still the one named.
    end = pytest.raises(tiekit.TiekitError, match=r"the loss of step 4 was nan\. fit stopped at step 10 without")
    with pytest.warns(UserWarning, match="the loss of step 4 is nan"), end:
        kept_dir = {"checkpoint_dir": tmp_path / "end", "checkpoint_every": None, "log_every": 2}
        tiekit.fit(DropoutNet, with_nan_at(13), **kw | kept_dir)
    assert not (tmp_path / "end").exists() or list((tmp_path / "end").iterdir()) == []
    first = pytest.raises(tiekit.TiekitError, match=r"at step 2 without writing its checkpoint \(none was written")
    with pytest.warns(UserWarning, match="the loss of step 1 is nan"), first:
        tiekit.fit(DropoutNet, with_nan_at(0), **kw | {"checkpoint_dir": tmp_path / "fresh"})


def test_the_losses_a_save_checks_are_fetched_every_few_steps_and_the_first_bad_one_kept() -> None:
    watch = LossWatch(every=3)
    for step, value in enumerate([1.0, 2.0, float("inf"), 3.0, float("nan"), 4.0, 5.0], start=1):
        watch.add(step, torch.tensor(value))
        assert len(watch.pending) < 3  # held on the device: never more than `every`
    assert watch.fetch() == (3, float("inf")) and watch.pending == []
    watch.clear()
    watch.add(8, torch.tensor(1.0))
    assert watch.fetch() is None


def test_the_master_fetches_each_loss_once_for_its_log_and_the_saves_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log and the save's loss check each fetched the master's losses: two transfers per
    ``log_every`` steps on XLA. A NaN is still named, at whichever step the save falls."""
    fetched: list[int] = []
    real = tiekit.devices.to_host

    def counting(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if sys._getframe(1).f_globals["__name__"] in ("tiekit.train.log", "tiekit.train.coordinate"):
            fetched.extend(map(id, tensors))  # losses (a save's own fetches come from elsewhere)
        return real(tensors)

    monkeypatch.setattr(tiekit.devices, "to_host", counting)
    monkeypatch.setattr(tiekit.train.log, "to_host", counting)
    kw: dict[str, Any] = {
        "batch_size": 4,
        "max_steps": 7,
        "log_every": 2,
        "checkpoint_every": 3,
        "shuffle": False,
        **CPU,
    }
    tiekit.fit(DropoutNet, data(), checkpoint_dir=tmp_path / "run", **kw)
    assert len(fetched) == 7  # each step's loss once: 14 when the save's check fetched them again
    for nan_at, step in [(4, 2), (8, 3), (20, 6)]:  # fetched by the log before the save, or by its flush
        with (
            pytest.warns(UserWarning, match=f"the loss of step {step} is nan"),
            pytest.raises(
                tiekit.TiekitError, match=rf"the loss of step {step} was nan\. fit stopped at step {3 * -(-step // 3)} "
            ),
        ):
            tiekit.fit(DropoutNet, with_nan_at(nan_at), checkpoint_dir=tmp_path / f"nan{nan_at}", **kw)


def test_checkpoint_keep_with_resume_last_keeps_n_in_the_folder_over_every_launch(tmp_path: Path) -> None:
    # A job restarted or resubmitted with resume="last": each launch continues the folder.
    kw: dict[str, Any] = {"batch_size": 4, "checkpoint_dir": tmp_path, "checkpoint_every": 2, **CPU}
    tiekit.fit(DropoutNet, data(), max_steps=5, **kw)  # 2, 4, 5: no keep, all stay
    for launch, steps in enumerate([9, 13]):
        tiekit.fit(DropoutNet, data(), max_steps=steps, checkpoint_keep=2, resume="last", **kw)
        expected = [["step-00000008", "step-00000009"], ["step-00000012", "step-00000013"]][launch]
        assert sorted(p.stem for p in tmp_path.iterdir()) == expected
    # resume=<path> branches off: the folder's checkpoints, the one resumed from included, stay.
    tiekit.fit(DropoutNet, data(), max_steps=15, checkpoint_keep=1, resume=tmp_path / "step-00000012.safetensors", **kw)
    assert sorted(p.stem for p in tmp_path.iterdir()) == ["step-00000012", "step-00000013", "step-00000015"]


@pytest.mark.parametrize("keep", [0, -1, 1.5, True])
def test_checkpoint_keep_must_be_a_positive_integer(tmp_path: Path, keep: Any) -> None:
    with pytest.raises(tiekit.TiekitError, match="checkpoint_keep"):
        tiekit.fit(DropoutNet(), data(), max_steps=1, checkpoint_dir=tmp_path, checkpoint_keep=keep, **CPU)
    with pytest.raises(tiekit.TiekitError, match="checkpoint_keep needs checkpoint_dir"):
        tiekit.fit(DropoutNet(), data(), max_steps=1, checkpoint_keep=2, **CPU)
    assert list(tmp_path.iterdir()) == []


BAD_OPTIONS: list[tuple[dict[str, Any], str]] = [
    ({"seed": "a"}, "seed must be a non-negative integer, not 'a'"),
    ({"seed": None}, "seed must be a non-negative integer, not None"),
    ({"seed": 1.5}, "seed must be a non-negative integer"),
    ({"seed": -1}, "seed must be a non-negative integer"),
    ({"drop_last": "no"}, r"drop_last must be True, False or None \(the DataLoader's\), not 'no'"),
    ({"shuffle": None}, "shuffle must be True or False"),
    ({"checkpoint_async": "x"}, "checkpoint_async must be True or False"),
    ({"progress": 1}, "progress must be True or False"),
    ({"log_every": True}, "log_every must be a positive integer, not True"),
    ({"resume": 123}, "resume must be a path"),
    ({"checkpoint_dir": 5}, "checkpoint_dir must be a path"),
    ({"checkpoint_dir": "FILE"}, "checkpoint_dir='.*' is a file, not a folder"),
    ({"log_dir": "FILE"}, "log_dir='.*' is a file, not a folder"),
    ({"checkpoint_dir": "FILE/ck"}, "checkpoint_dir='.*ck' cannot be made: '.*a-file' is a file, not a folder"),
    ({"log_dir": "FILE/a/logs"}, "log_dir='.*logs' cannot be made: '.*a-file' is a file, not a folder"),
    (
        {"checkpoint_dir": "DANGLING/ck"},
        "checkpoint_dir='.*ck' cannot be made: '.*dangling' is a symbolic link to nothing",
    ),
    ({"optimizer": lambda params: None}, "the optimizer factory .* returned None, not a torch.optim.Optimizer"),
]


@pytest.mark.parametrize(("options", "told"), BAD_OPTIONS, ids=[str(o) for o, _ in BAD_OPTIONS])
def test_bad_option_values_are_refused_before_anything_trains(
    tmp_path: Path, options: dict[str, Any], told: str
) -> None:
    """Each was a raw TypeError or ValueError from deep inside (NumPy's seed, the DataLoader's
    drop_last, Path(123), the optimizer's first use), accepted silently (shuffle=None,
    checkpoint_async="x", log_every=True), or, for a checkpoint_dir that is a file or below one, a
    CheckpointError at the first save after training (probe)."""
    afile = tmp_path / "a-file"
    afile.write_text("not a folder")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    options = {
        k: v.replace("FILE", str(afile)).replace("DANGLING", str(tmp_path / "dangling")) if isinstance(v, str) else v
        for k, v in options.items()
    }
    model = DropoutNet()
    before = weights(model)
    with pytest.raises(tiekit.TiekitError, match=told):
        tiekit.fit(model, data(), max_steps=2, batch_size=4, **{**CPU, **options})
    assert sorted(os.listdir(tmp_path)) == ["a-file", "dangling"] and afile.read_text() == "not a folder"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_without_cuda_is_refused_by_name() -> None:
    with pytest.raises(tiekit.TiekitError, match="devices='cuda', but torch finds no CUDA device here"):
        tiekit.fit(DropoutNet(), data(), max_steps=1, **{**CPU, "devices": "cuda"})


def test_a_checkpoint_that_cannot_be_deleted_is_a_warning_and_stays_whole(tmp_path: Path) -> None:
    from tiekit.train import state

    folder = tmp_path / "step-00000004"
    tiekit.save_sharded(DropoutNet(), folder)
    in_the_way = tmp_path / ".step-00000004.deleting"
    in_the_way.write_text("a file fit did not make: the folder cannot be renamed onto it")
    with pytest.warns(UserWarning, match="could not delete the old checkpoint .*step-00000004"):
        state.remove_checkpoint(folder)
    assert in_the_way.read_text().startswith("a file fit did not make")
    assert state.last_checkpoint(tmp_path) == folder
    tiekit.load_sharded(DropoutNet(), folder)


def test_a_deletion_cut_short_is_finished_by_the_next_run_that_keeps_n(tmp_path: Path) -> None:
    """A launch killed between renaming an old sharded checkpoint to ``.step-N.deleting`` and
    removing it left a whole checkpoint there for good, and the same step's deletion later failed
    on the leftover (probe)."""
    kw: dict[str, Any] = {"batch_size": 4, "checkpoint_dir": tmp_path, "checkpoint_every": 2, **CPU}
    tiekit.fit(DropoutNet, data(), max_steps=4, **kw)
    tiekit.save_sharded(DropoutNet(), tmp_path / ".step-00000004.deleting")  # as a kill leaves it
    tiekit.save_sharded(DropoutNet(), tmp_path / ".step-00000002.deleting")
    # A sharded save killed before its marker, at a step this run does not reach again (probe: it
    # stayed for good), and one in a step folder that holds a file of the user's too.
    for step in (5, 7):
        uncommitted = tmp_path / f"step-0000000{step}"
        tiekit.save_sharded(DropoutNet(), uncommitted)
        (uncommitted / tiekit.dcp.MARKER_NAME).unlink()
        (uncommitted / f".{tiekit.dcp.MARKER_NAME}.tiekit-tmp-host-1-0123abcd").mkdir()
    (tmp_path / "step-00000007" / "notes.txt").write_text("the user's")
    tiekit.fit(DropoutNet, data(), max_steps=6, checkpoint_keep=2, resume="last", **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000004.safetensors",
        "step-00000006.safetensors",
        "step-00000007",
    ]
    assert (tmp_path / "step-00000007" / "notes.txt").read_text() == "the user's"

    from tiekit.train import state

    folder = tmp_path / "step-00000008"
    tiekit.save_sharded(DropoutNet(), folder)
    tiekit.save_sharded(DropoutNet(), tmp_path / ".step-00000008.deleting")
    state.remove_checkpoint(folder)  # the leftover of its own name no longer stops it
    assert not folder.exists() and not (tmp_path / ".step-00000008.deleting").exists()


@pytest.mark.parametrize("sharded", [True, False])
def test_a_checkpoint_removed_after_the_run_chose_it_is_named_removed(tmp_path: Path, sharded: bool) -> None:
    """A sharded run whose chosen step folder was removed before the load (another run's
    checkpoint_keep) was told it 'resumes from a sharded checkpoint folder, not from a single file'
    (probe)."""
    from tiekit.train import state

    model = DropoutNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = state.TrainingRun("run", 1, 4, 0, True)
    gone = tmp_path / ("step-00000010" if sharded else "step-00000010.safetensors")
    with pytest.raises(
        tiekit.CheckpointError, match=r"step-00000010(\.safetensors)?: no such checkpoint \(it was there"
    ):
        state.resume(gone, model, optimizer, run, torch.device("cpu"), tiekit.find_ties(model), sharded=sharded)


def test_every_replica_gets_its_own_shard_and_a_new_order_each_epoch() -> None:
    ds = data(40)
    shards = [
        make_loader(ds, batch_size=4, num_replicas=2, rank=r, shuffle=True, seed=5, drop_last=True, static_shapes=False)
        for r in (0, 1)
    ]
    epoch_0 = [[int(i) for i in s.epoch(0).sampler] for s in shards]
    assert sorted(epoch_0[0] + epoch_0[1]) == list(range(40))
    reference = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=5)
    assert epoch_0[1] == list(reference)
    epoch_1 = [int(i) for i in shards[1].epoch(1).sampler]
    reference.set_epoch(1)
    assert epoch_1 == list(reference) and epoch_1 != epoch_0[1]
    # Resuming mid-epoch skips exactly the batches already seen.
    assert [int(i) for i in shards[1].epoch(1, skip_batches=2).sampler] == epoch_1[8:]


def test_fit_inserts_the_sampler_and_calls_set_epoch_every_epoch() -> None:
    ds = Recording(12)
    tiekit.fit(DropoutNet(), ds, epochs=3, batch_size=4, seed=7, **CPU)
    expected = []
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=7)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        expected += list(sampler)
    assert ds.read == expected
    assert ds.read[:12] != ds.read[12:24]  # reshuffled


def test_a_distributed_sampler_you_give_is_kept() -> None:
    ds = Recording(12)
    loader = DataLoader(ds, batch_size=3, sampler=DistributedSampler(ds, num_replicas=2, rank=1, shuffle=False))
    with pytest.warns(UserWarning, match="keeping the DistributedSampler you gave"):
        result = tiekit.fit(DropoutNet(), loader, epochs=1, **CPU)
    assert ds.read == [1, 3, 5, 7, 9, 11]  # rank 1 of 2, unshuffled, as given
    assert result.steps == 2  # the loader's batch size


def test_xla_static_shapes_pad_the_last_batch_instead_of_shortening_it() -> None:
    ds = data(10)
    kw: dict[str, Any] = {"batch_size": 4, "num_replicas": 1, "rank": 0, "shuffle": False, "seed": 0}
    padded = make_loader(ds, drop_last=False, static_shapes=True, **kw)
    plain = make_loader(ds, drop_last=False, static_shapes=False, **kw)
    assert [len(x) for x, _ in padded.epoch(0)] == [4, 4, 4]
    assert [len(x) for x, _ in plain.epoch(0)] == [4, 4, 2]
    assert [int(i) for i in padded.epoch(0).sampler] == [*range(10), 0, 1]


class DtypeProbe(nn.Module):
    """Tied; records the weight dtype and the autocast state its forward ran with."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_1 = nn.Linear(8, 8)
        self.layer_2 = nn.Linear(8, 8)
        self.layer_2.weight = self.layer_1.weight
        self.seen: list[tuple[torch.dtype, bool]] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.layer_1.weight.dtype, torch.is_autocast_enabled("cpu")))
        out = self.layer_2(torch.relu(self.layer_1(x)))
        return F.mse_loss(out.float(), y.float())


class DeclaresItsTie(tiekit.TPUMixin, nn.Module):
    """A mixin model built without its declared tie (never called tie_weights()): the mixin ties it
    at its first conversion."""

    tied_weights = {"head.weight": "embed.weight"}  # noqa: RUF012 - the mixin's class attribute

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.head = nn.Linear(4, 11, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_fit_ties_a_mixin_model_built_without_its_declared_tie_as_tiekit_move_does() -> None:
    """fit planned with find_ties, which reads no tied_weights: the move refused the plan ("the plan
    given does not tie 'head.weight' to 'embed.weight'"; before that, "Before: 2 After: 1"), where
    tiekit.move of the same model ties it (probe today52)."""
    model = DeclaresItsTie()
    assert model.head.weight is not model.embed.weight  # built untied
    data = TensorDataset(torch.randint(0, 11, (16,)), torch.randn(16, 11))
    result = tiekit.fit(model, data, loss_fn=F.mse_loss, max_steps=2, batch_size=4, **CPU)
    assert result.ties_kept and result.model.head.weight is result.model.embed.weight
    assert len(list(result.model.parameters())) == 1


@pytest.mark.parametrize(
    ("precision", "seen"),
    [
        ("32-true", (torch.float32, False)),
        ("bf16-true", (torch.bfloat16, False)),
        ("bf16-mixed", (torch.float32, True)),
    ],
)
def test_precisions_cast_or_autocast_and_keep_the_tie(precision: str, seen: tuple[torch.dtype, bool]) -> None:
    model = DtypeProbe()
    result = tiekit.fit(model, data(), max_steps=3, batch_size=8, precision=precision, **CPU)
    assert set(model.seen) == {seen}
    assert result.ties_kept and result.model is model
    assert model.layer_2.weight is model.layer_1.weight
    assert model.layer_1.weight.dtype == torch.float32  # handed back in its own dtype
    assert all(torch.isfinite(torch.tensor(result.losses)))


class WithConjugateBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.register_buffer("phase", torch.polar(torch.ones(4), torch.arange(4.0)).conj())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def test_a_model_with_a_conjugate_view_buffer_trains_to_its_digest() -> None:
    # The digest of the trained model took a dtype view of every tensor: torch refuses one of a
    # conjugate view, and fit failed after training with a raw RuntimeError.
    result = tiekit.fit(WithConjugateBuffer, data(8), loss_fn=F.mse_loss, max_steps=2, batch_size=4, **CPU)
    assert result.steps == 2 and result.model.phase.is_conj() and len(result.replica_digests[0]) == 64


def test_a_hugging_face_model_that_returns_its_loss_trains_and_stays_tied() -> None:
    torch.manual_seed(0)
    ids = (torch.randint(0, 96, (48, 1)) + torch.arange(16)) % 96  # next token = this one + 1
    rows = [{"input_ids": row, "labels": row} for row in ids]  # dict batches: model(**batch).loss
    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    result = tiekit.fit(model, rows, epochs=4, batch_size=8, **{**CPU, "optimizer": ADAMW})
    assert result.steps == 24
    assert sum(result.losses[-3:]) / 3 < 0.7 * result.losses[0]
    assert model.lm_head.weight is model.transformer.wte.weight


def test_validation_loss_is_the_mean_over_every_validation_sample() -> None:
    val = data(22)  # batches of 8, 8 and 6: a plain mean of batch losses would be off
    model = nn.Linear(8, 8)
    result = tiekit.fit(model, data(), val_data=val, loss_fn=F.mse_loss, epochs=2, batch_size=8, **CPU)
    assert len(result.val_losses) == 2
    with torch.no_grad():
        expected = F.mse_loss(model(val.tensors[0]), val.tensors[1]).item()
    assert result.val_losses[-1] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    ("epochs", "max_steps", "expected"),
    [(1, None, (5, 1)), (1, 5, (5, 1)), (2, 5, (5, 1)), (None, 10, (10, 2)), (None, 7, (7, 1)), (3, 12, (12, 2))],
)
def test_an_epoch_that_max_steps_ends_with_its_last_batch_is_validated_and_counted(
    epochs: int | None, max_steps: int | None, expected: tuple[int, int]
) -> None:
    """40 samples in batches of 8: 5 steps per epoch. max_steps=5 trains the same epoch as
    epochs=1; it used to skip its validation and count 0 epochs."""
    result = tiekit.fit(
        nn.Linear(8, 8), data(), val_data=data(16), loss_fn=F.mse_loss, epochs=epochs, max_steps=max_steps,
        batch_size=8, **CPU,
    )  # fmt: skip
    steps, validated = expected
    assert (result.steps, result.epochs, len(result.val_losses)) == (steps, validated, validated)


def test_metrics_csv_and_a_progress_bar(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    result = tiekit.fit(
        DropoutNet(), data(), max_steps=7, batch_size=4, log_dir=tmp_path, log_every=3, **{**CPU, "progress": True}
    )
    with (tmp_path / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 8))
    assert [float(r["loss"]) for r in rows] == pytest.approx(result.losses, rel=1e-5)
    err = capfd.readouterr().err
    assert "7/7" in err and "loss=" in err


def test_metrics_csv_rows_are_in_step_order_with_validation_after_its_epoch(tmp_path: Path) -> None:
    """The validation row was written at once and the losses still waiting for log_every after it:
    steps 1-3, 5 (val), 4, 5, ... (probe)."""
    result = tiekit.fit(
        DropoutNet(), data(20), val_data=data(8), epochs=2, batch_size=4, log_dir=tmp_path, log_every=3, **CPU
    )
    with (tmp_path / "metrics.csv").open() as f:
        rows = [(int(r["step"]), "val" if r["val_loss"] else "loss") for r in csv.DictReader(f)]
    expected = [(s, "loss") for s in range(1, 6)] + [(5, "val")] + [(s, "loss") for s in range(6, 11)] + [(10, "val")]
    assert rows == expected and result.steps == 10


def test_tensorboard_events_hold_the_losses_of_the_csv(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    val = data(12)
    result = tiekit.fit(
        DropoutNet(), data(), val_data=val, epochs=2, batch_size=8, log_dir=tmp_path, log_every=3, **CPU
    )
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {"loss", "val_loss", "samples_per_second"} <= set(events.Tags()["scalars"])
    losses = events.Scalars("loss")
    assert [e.step for e in losses] == list(range(1, result.steps + 1))
    assert [e.value for e in losses] == pytest.approx(result.losses, rel=1e-5)
    assert [e.value for e in events.Scalars("val_loss")] == pytest.approx(result.val_losses, rel=1e-5)


class NotALoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))  # logits, not a loss


class Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Any:
        return iter([torch.zeros(8)])


def test_a_ddp_wrapped_model_not_returning_a_loss_is_named_by_its_own_class() -> None:
    from torch.nn.parallel import DistributedDataParallel

    from tiekit.train.loop import compute_loss

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(NotALoss())
        with pytest.raises(tiekit.TiekitError, match=r"^NotALoss.forward returned a tensor of shape \(2, 8\)"):
            compute_loss(wrapped, (torch.randn(2, 8), torch.randn(2, 8)), None)
    finally:
        torch.distributed.destroy_process_group()


def test_a_loss_fn_returning_a_non_scalar_is_named() -> None:
    with pytest.raises(tiekit.TiekitError, match=r"loss_fn MSELoss returned a tensor of shape \(4, 8\), not a scalar"):
        tiekit.fit(nn.Linear(8, 8), data(), loss_fn=nn.MSELoss(reduction="none"), batch_size=4, **CPU)


def test_resume_naming_a_folder_that_is_no_checkpoint_says_what_it_is(tmp_path: Path) -> None:
    """A folder without a checkpoint's marker was "no checkpoint at <folder> (FileNotFoundError:
    No such file or directory)", for a folder that exists."""
    kw: dict[str, Any] = {"batch_size": 4, "progress": False, **CPU}
    tiekit.fit(nn.Linear(8, 8), data(), loss_fn=nn.MSELoss(), max_steps=1, checkpoint_dir=tmp_path / "run", **kw)
    (tmp_path / "empty").mkdir()
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "save-0123").mkdir()
    cases = {
        "run": "a checkpoint_dir holding 1 checkpoint(s), the newest step-00000001.safetensors; pass resume= one of",
        "empty": "the folder is empty",
        "half": "no tiekit-dcp.json in it, so no save into it was committed",
    }
    for name, said in cases.items():
        model = nn.Linear(8, 8)
        before = weights(model)
        with pytest.raises(tiekit.TiekitError) as raised:
            tiekit.fit(model, data(), loss_fn=nn.MSELoss(), max_steps=2, resume=tmp_path / name, **kw)
        assert f"resume: {tmp_path / name} is a folder, not a checkpoint: {said}" in str(raised.value)
        assert same(weights(model), before)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "tpu-magic"}, "unknown strategy 'tpu-magic'"),
        ({"devices": "gpu0"}, "devices='gpu0' is neither 'auto' nor a device"),
        ({"precision": "fp8"}, "unknown precision 'fp8'"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"checkpoint_every": 5}, "checkpoint_every needs checkpoint_dir"),
        ({"resume": "/nonexistent/step-00000001.safetensors"}, "resume: no checkpoint at /nonexistent"),
        ({"optimizer": torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)}, "optimizer must be a factory"),
        ({}, "NotALoss.forward returned a tensor of shape (4, 8), not a scalar loss"),
        ({"train_data": Stream()}, "train_data: an IterableDataset cannot be split"),
        ({"train_data": [1, 2, 3], "batch_size": 4}, "fewer than one batch of 4"),
    ],
)
def test_bad_input_is_a_clear_tiekit_error_and_the_model_is_untouched(kwargs: dict[str, Any], message: str) -> None:
    model = NotALoss()
    before = weights(model)
    train_data = kwargs.pop("train_data", data())
    with pytest.raises(tiekit.TiekitError) as info:
        tiekit.fit(model, train_data, batch_size=kwargs.pop("batch_size", 4), **{**CPU, **kwargs})
    assert message in str(info.value)
    assert same(weights(model), before)
    assert model.b.weight is model.a.weight


def test_resuming_a_model_without_the_checkpoints_tie_is_refused_before_training(tmp_path: Path) -> None:
    """The load tied the model as the file does, after fit had planned and built the optimizer on
    two tensors: it trained, wrote a checkpoint, then failed at its end with 'tied weights are no
    longer shared ... Before: 2 After: 1' and never returned the model (probe)."""
    kw: dict[str, Any] = {"batch_size": 4, "checkpoint_dir": tmp_path, **CPU}
    tiekit.fit(DropoutNet, data(), max_steps=4, **kw)
    untied = DropoutNet()
    untied.c.weight = nn.Parameter(untied.a.weight.detach().clone())  # the same model, its tie undone
    before = weights(untied)
    with pytest.raises(
        tiekit.CheckpointError, match=r"the checkpoint ties 'a\.weight', 'c\.weight' .* separate tensors"
    ):
        tiekit.fit(untied, data(), max_steps=8, resume="last", **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004.safetensors"]  # nothing trained or written
    assert untied.c.weight is not untied.a.weight
    assert all(torch.equal(v, before[k]) for k, v in untied.state_dict().items())
    tied = DropoutNet()  # the control: the model with the checkpoint's tie resumes
    assert tiekit.fit(tied, data(), max_steps=8, resume="last", **kw).steps == 8


class MixedDtypes(nn.Module):
    """Tied, float32, with a float64 scale registered first (the first dtype fit saw)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones((), dtype=torch.float64))
        self.a = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.c.weight = self.a.weight
        self.register_buffer("a_t", self.a.weight.detach().t())  # a view of the tied weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.c(torch.relu(self.a(x))) + x @ self.a_t
        return F.mse_loss(out * self.scale.to(out.dtype), y)


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_a_model_of_mixed_dtypes_comes_back_in_its_own_dtypes(precision: str) -> None:
    """Cast back to the first floating dtype fit saw: the float32 weights came back float64 (probe)."""
    model = MixedDtypes()
    sgd = functools.partial(torch.optim.SGD, lr=1e-2)  # AdamW's eps underflows in float16
    result = tiekit.fit(model, data(), max_steps=2, batch_size=4, precision=precision, **{**CPU, "optimizer": sgd})
    assert all(torch.isfinite(torch.tensor(result.losses)))
    got = {name: t.dtype for name, t in [*result.model.named_parameters(), *result.model.named_buffers()]}
    assert got == {"scale": torch.float64, "a.weight": torch.float32, "a.bias": torch.float32,
                   "c.bias": torch.float32, "a_t": torch.float32}  # fmt: skip
    assert result.model.c.weight is result.model.a.weight and result.ties_kept
    assert result.model.a_t.data_ptr() == result.model.a.weight.data_ptr()  # still a view of it
