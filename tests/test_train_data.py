"""tiekit.fit's data loading on the CPU: a DataLoader's own sampler, worker seeds on a resume."""

from __future__ import annotations

import functools
import random
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import tiekit
from tiekit.train.data import SplitSampler, make_loader

CPU: dict[str, Any] = {
    "devices": "cpu",
    "progress": False,
    "loss_fn": F.mse_loss,
    "optimizer": functools.partial(torch.optim.SGD, lr=0.05),
}
SPLIT: dict[str, Any] = {"shuffle": True, "seed": 5, "drop_last": False, "static_shapes": False}


class Recording(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample ``i`` is ``(i, i, i, i)``; remembers which indices were read, in order."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.read: list[int] = []

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.read.append(int(i))
        return torch.full((4,), float(i)), torch.zeros(2)


def linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def shares(loader: DataLoader[Any], replicas: int, epoch: int, **kw: Any) -> list[list[int]]:
    """Each replica's indices of ``epoch`` with ``loader`` (loaders built in this process)."""
    built = [
        make_loader(loader, batch_size=None, num_replicas=replicas, rank=r, **{**SPLIT, **kw}) for r in range(replicas)
    ]
    return [[int(i) for i in b.epoch(epoch).sampler] for b in built]


def test_a_subset_sampler_restricts_training_to_its_subset() -> None:
    ds = Recording(40)
    loader = DataLoader(ds, batch_size=2, sampler=SubsetRandomSampler(list(range(10))))
    result = tiekit.fit(linear, loader, epochs=2, **CPU)
    assert result.steps == 10  # 10 samples per epoch, in batches of 2
    assert sorted(ds.read[:10]) == sorted(ds.read[10:]) == list(range(10))  # every epoch: the subset, once
    assert ds.read[:10] != ds.read[10:]  # a new draw each epoch


def test_a_weighted_sampler_never_yields_what_weighs_nothing() -> None:
    ds = Recording(40)
    sampler = WeightedRandomSampler([1.0] * 5 + [0.0] * 35, num_samples=40)
    tiekit.fit(linear, DataLoader(ds, batch_size=4, sampler=sampler), epochs=1, **CPU)
    assert len(ds.read) == 40 and set(ds.read) <= set(range(5))


def test_two_replicas_split_the_samplers_draw_without_overlap() -> None:
    ds = Recording(40)
    subset = DataLoader(ds, batch_size=2, sampler=SubsetRandomSampler(list(range(0, 40, 4))))
    for epoch in (0, 1):
        zero, one = shares(subset, 2, epoch)
        assert len(zero) == len(one) == 5 and not set(zero) & set(one)
        assert sorted(zero + one) == list(range(0, 40, 4))
    assert shares(subset, 1, 0)[0] != shares(subset, 1, 1)[0]
    # With replacement: the shares interleaved are the sampler's draw under torch.manual_seed(seed + epoch).
    weighted = WeightedRandomSampler([1.0] * 5 + [0.0] * 35, num_samples=40)
    zero, one = shares(DataLoader(ds, batch_size=2, sampler=weighted), 2, epoch=3)
    torch.manual_seed(SPLIT["seed"] + 3)
    draw = [int(i) for i in weighted]
    assert [i for pair in zip(zero, one, strict=True) for i in pair] == draw and set(draw) <= set(range(5))
    # An odd draw is padded as DistributedSampler pads: both replicas get as many, one repeated.
    zero, one = shares(DataLoader(ds, batch_size=2, sampler=SubsetRandomSampler(list(range(7)))), 2, epoch=0)
    assert len(zero) == len(one) == 4 and set(zero + one) == set(range(7))


def test_the_users_sampler_and_global_generators_are_left_as_they_were() -> None:
    ds = Recording(40)
    generator = torch.Generator().manual_seed(3)
    own = SubsetRandomSampler(list(range(20)), generator=generator)
    generator_state, global_state = generator.get_state(), torch.get_rng_state()
    seeded = shares(DataLoader(ds, batch_size=2, sampler=own), 2, epoch=0)
    assert own.generator is generator and torch.equal(generator.get_state(), generator_state)
    assert torch.equal(torch.get_rng_state(), global_state)
    # The user's seed decides, fit's does not; every epoch draws anew.
    assert shares(DataLoader(ds, batch_size=2, sampler=own), 2, epoch=0, seed=9) == seeded
    other = SubsetRandomSampler(list(range(20)), generator=torch.Generator().manual_seed(4))
    assert shares(DataLoader(ds, batch_size=2, sampler=other), 2, epoch=0) != seeded
    assert shares(DataLoader(ds, batch_size=2, sampler=own), 2, epoch=1) != seeded


def test_only_plain_orders_become_a_distributed_sampler() -> None:
    ds = Recording(12)

    def inner(sampler: Any) -> Any:
        built = make_loader(DataLoader(ds, sampler=sampler), batch_size=2, num_replicas=1, rank=0, **SPLIT)
        return built.sampler.inner

    assert isinstance(inner(SequentialSampler(ds)), DistributedSampler) and not inner(SequentialSampler(ds)).shuffle
    for plain in (RandomSampler(ds), RandomSampler(ds, generator=torch.Generator()), RandomSampler(ds, num_samples=12)):
        assert isinstance(inner(plain), DistributedSampler) and inner(plain).shuffle
    for kept in (RandomSampler(ds, replacement=True), RandomSampler(ds, num_samples=5), SequentialSampler(range(5))):
        assert isinstance(inner(kept), SplitSampler) and inner(kept).sampler is kept


def rows_per_step(data: Any, **kw: Any) -> list[int]:
    """The batch sizes ``fit`` trains ``data`` in, step by step (one epoch on the CPU)."""
    rows: list[int] = []

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        rows.append(out.shape[0])
        return F.mse_loss(out, target)

    tiekit.fit(linear, data, **{**CPU, "loss_fn": loss, **kw})
    return rows


def test_a_batch_sampler_passed_to_the_loader_keeps_its_batch_size_drop_last_and_sampler() -> None:
    """DataLoader(batch_sampler=BatchSampler(...)) has batch_size None and a default sampler of
    its own: fit trained it in batches of 32 (or refused a small dataset as "fewer than one
    batch of 32"), over the whole dataset."""
    ds = Recording(10)
    keep_short = DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), batch_size=4, drop_last=False))
    assert rows_per_step(keep_short) == [4, 4, 2] and sorted(ds.read) == list(range(10))
    drop_short = DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), batch_size=4, drop_last=True))
    assert rows_per_step(drop_short) == [4, 4]
    assert rows_per_step(keep_short, batch_size=3, drop_last=True) == [3, 3, 3]  # fit's options win
    ds.read.clear()
    subset = DataLoader(ds, batch_sampler=BatchSampler(SubsetRandomSampler([1, 3, 5, 7, 9]), 2, drop_last=False))
    assert rows_per_step(subset) == [2, 2, 1] and sorted(ds.read) == [1, 3, 5, 7, 9]  # its sampler decides
    zero, one = shares(subset, 2, epoch=0)  # split between replicas like a loader's own sampler
    assert len(zero) == len(one) == 3 and set(zero + one) == {1, 3, 5, 7, 9}


def test_a_loaders_drop_last_is_kept_unless_fit_is_given_one() -> None:
    """fit's drop_last (True by default) replaced the DataLoader's: a loader of 12 samples in
    batches of 5 with drop_last=False trained on 10 of them."""
    ds = Recording(12)
    keeps = DataLoader(ds, batch_size=5, drop_last=False)
    assert rows_per_step(keeps) == [5, 5, 2]
    assert rows_per_step(keeps, drop_last=True) == [5, 5]
    drops = DataLoader(ds, batch_size=5, drop_last=True)
    assert rows_per_step(drops) == [5, 5]
    assert rows_per_step(drops, drop_last=False) == [5, 5, 2]
    assert rows_per_step(ds, batch_size=5) == [5, 5]  # a dataset: True, as before


def test_a_resume_mid_epoch_sees_the_indices_the_uninterrupted_run_saw(tmp_path: Path) -> None:
    def loader(ds: Recording) -> DataLoader[Any]:  # 10 batches of 2 per epoch
        return DataLoader(ds, batch_size=2, sampler=SubsetRandomSampler(list(range(5, 25))))

    straight, first, resumed = Recording(40), Recording(40), Recording(40)
    kw = {**CPU, "optimizer": functools.partial(torch.optim.SGD, lr=1e-3)}  # inputs up to 24: 0.05 diverges
    tiekit.fit(linear, loader(straight), max_steps=15, **kw)
    tiekit.fit(linear, loader(first), max_steps=7, checkpoint_dir=tmp_path, **kw)
    tiekit.fit(linear, loader(resumed), max_steps=15, checkpoint_dir=tmp_path, resume="last", **kw)
    assert first.read + resumed.read == straight.read and set(straight.read) == set(range(5, 25))


class Noisy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random augmentation: every read adds noise from torch's generator (a worker's, seeded by
    the loader's generator)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((4,), float(i)) + torch.randn(4), torch.zeros(2)


def test_a_resume_with_workers_draws_the_augmentations_of_the_uninterrupted_run(tmp_path: Path) -> None:
    data = DataLoader(Noisy(), batch_size=4, num_workers=2)
    straight = tiekit.fit(linear, data, epochs=2, **CPU)
    tiekit.fit(linear, data, epochs=1, checkpoint_dir=tmp_path, **CPU)  # stops at the end of epoch 0
    resumed = tiekit.fit(linear, data, epochs=2, checkpoint_dir=tmp_path, resume="last", **CPU)
    assert resumed.losses == straight.losses[2:]
    expected, got = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


class PythonShuffle(Sampler[int]):
    """A sampler of the user's that shuffles with Python's global generator."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.size))
        random.shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return self.size


def test_replicas_drawing_in_threads_of_one_process_draw_alike() -> None:
    """XLA:CPU replicas are launch threads of one process, sharing the global generators each
    draw seeds and restores: drawn at once, the draws interleaved and the shares overlapped."""
    sampler = PythonShuffle(20_000)
    splits = [SplitSampler(sampler, 2, rank, seed=0) for rank in range(2)]
    expected = [list(split) for split in splits]
    shares: list[list[int]] = [[], []]

    def draw(rank: int) -> None:
        shares[rank] = list(splits[rank])

    switching = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns often, as busy launch threads do
    try:
        for _ in range(3):
            threads = [threading.Thread(target=draw, args=(rank,)) for rank in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            assert shares == expected
    finally:
        sys.setswitchinterval(switching)
