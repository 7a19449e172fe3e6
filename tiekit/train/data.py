"""Data loading for `tiekit.fit`: the right sampler on every replica, static batch shapes, resume.

Users pass a map-style dataset or a ``DataLoader``; `make_loader` rebuilds the loader around a
``DistributedSampler`` (``num_replicas`` = number of data-parallel replicas, ``rank`` = this
replica) unless the user already gave one, which is then kept as it is. `ReplicaSampler` wraps
that sampler to (a) pad the epoch to whole batches on XLA, so every step has one shape and
compiles once, and (b) start an epoch part-way, which is how a resumed run continues exactly.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler
from torch.utils.data import Sampler as TorchSampler

from tiekit.errors import TiekitError

DEFAULT_BATCH_SIZE = 32


class ReplicaSampler(TorchSampler[int]):
    """A replica's indices for one epoch: ``inner``'s, padded to whole batches, minus a prefix.

    ``pad_to`` (a batch size, or None) repeats the epoch's first indices at its end until the
    count is a multiple of it, the same way ``DistributedSampler`` pads replicas to equal
    lengths. `start` picks the epoch (``inner.set_epoch``) and how many batches to skip.
    """

    def __init__(self, inner: DistributedSampler[Any], pad_to: int | None) -> None:
        self.inner = inner
        self.pad_to = pad_to
        self.skip = 0

    def start(self, epoch: int, skip_samples: int = 0) -> None:
        """Prepare epoch ``epoch`` (the permutation depends on it) starting after ``skip_samples``."""
        self.inner.set_epoch(epoch)
        self.skip = skip_samples

    def _indices(self) -> list[int]:
        indices = list(self.inner)
        if self.pad_to and indices and len(indices) % self.pad_to:
            missing = self.pad_to - len(indices) % self.pad_to
            indices += (indices * (missing // len(indices) + 1))[:missing]
        return indices

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices()[self.skip :])

    def __len__(self) -> int:
        count = len(self.inner)
        if self.pad_to and count % self.pad_to:
            count += self.pad_to - count % self.pad_to
        return max(0, count - self.skip)


@dataclass(frozen=True)
class ReplicaLoader:
    """The rebuilt ``DataLoader`` of one replica and the `ReplicaSampler` that drives it."""

    loader: DataLoader[Any]
    sampler: ReplicaSampler
    batch_size: int

    def epoch(self, epoch: int, skip_batches: int = 0) -> DataLoader[Any]:
        """The loader for ``epoch``, without its first ``skip_batches`` batches."""
        self.sampler.start(epoch, skip_batches * self.batch_size)
        return self.loader

    def epoch_share(self, drop_last: bool) -> tuple[int, int]:
        """(samples, batches) one epoch gives this replica."""
        batches = self.batches_per_epoch(drop_last)  # from the start of the epoch
        return len(self.sampler), batches

    def batches_per_epoch(self, drop_last: bool) -> int:
        """Batches one epoch yields on this replica (from the start of the epoch)."""
        self.sampler.start(0)
        count = len(self.sampler)
        return count // self.batch_size if drop_last else -(-count // self.batch_size)


def make_loader(
    data: Dataset[Any] | DataLoader[Any],
    *,
    batch_size: int | None,
    num_replicas: int,
    rank: int,
    shuffle: bool,
    seed: int,
    drop_last: bool,
    static_shapes: bool,
    what: str = "train_data",
) -> ReplicaLoader:
    """Rebuild ``data`` as this replica's loader (see the module docstring).

    ``batch_size`` is per replica (default: the DataLoader's, else 32). ``static_shapes`` pads
    the last batch instead of leaving it short when ``drop_last`` is False (XLA).
    """
    dataset, given_sampler, options = _unpack(data, what)
    if batch_size is None:
        batch_size = options.pop("batch_size", None) or DEFAULT_BATCH_SIZE
    else:
        options.pop("batch_size", None)
    if batch_size < 1:
        raise TiekitError(f"{what}: batch_size must be at least 1, not {batch_size}")
    if isinstance(given_sampler, DistributedSampler):
        inner = given_sampler
        if inner.num_replicas != num_replicas or inner.rank != rank:
            warnings.warn(
                f"{what}: keeping the DistributedSampler you gave (num_replicas={inner.num_replicas}, "
                f"rank={inner.rank}) although this run has {num_replicas} replica(s) and this is replica {rank}",
                UserWarning,
                stacklevel=3,
            )
    else:
        if given_sampler is not None:
            shuffle = isinstance(given_sampler, RandomSampler)
        inner = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
    if len(inner) == 0:
        raise TiekitError(f"{what}: replica {rank} of {num_replicas} gets no samples (the dataset is empty)")
    pad = batch_size if (static_shapes and not drop_last) else None
    sampler = ReplicaSampler(inner, pad)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        # Its own generator, so that building an iterator never draws from torch's global RNG
        # (that would shift dropout masks between a straight run and a resumed one).
        generator=torch.Generator().manual_seed(seed),
        **options,
    )
    result = ReplicaLoader(loader, sampler, batch_size)
    if drop_last and result.batches_per_epoch(drop_last) == 0:
        raise TiekitError(
            f"{what}: replica {rank} gets {len(inner)} sample(s) per epoch, fewer than one batch of "
            f"{batch_size}; lower batch_size or pass drop_last=False"
        )
    return result


def _unpack(data: Any, what: str) -> tuple[Dataset[Any], Any, dict[str, Any]]:
    """(dataset, the sampler the user gave or None, DataLoader options to keep)."""
    if isinstance(data, DataLoader):
        dataset = data.dataset
        if isinstance(dataset, IterableDataset):
            raise TiekitError(f"{what}: an IterableDataset cannot be split between replicas by a sampler; {_MAP}")
        if data.batch_sampler is None:
            raise TiekitError(f"{what}: a DataLoader with batch_size=None (no batching) is not supported")
        if type(data.batch_sampler) is not BatchSampler:
            raise TiekitError(f"{what}: a DataLoader with a custom batch_sampler is not supported; pass a sampler")
        options: dict[str, Any] = {
            "batch_size": data.batch_size,
            "num_workers": data.num_workers,
            "collate_fn": data.collate_fn,
            "pin_memory": data.pin_memory,
            "worker_init_fn": data.worker_init_fn,
            "timeout": data.timeout,
        }
        if data.num_workers > 0:
            options["persistent_workers"] = data.persistent_workers
            options["prefetch_factor"] = data.prefetch_factor
            options["multiprocessing_context"] = data.multiprocessing_context
        return dataset, data.sampler, options
    if isinstance(data, IterableDataset):
        raise TiekitError(f"{what}: an IterableDataset cannot be split between replicas by a sampler; {_MAP}")
    if not (isinstance(data, Sized) and hasattr(data, "__getitem__")):
        raise TiekitError(f"{what}: expected a map-style Dataset or a DataLoader, got {type(data).__name__}")
    return cast(Dataset[Any], data), None, {}


_MAP = "pass a map-style dataset (with __len__ and __getitem__)"
