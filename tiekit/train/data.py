"""Data loading for `tiekit.fit`: the right sampler on every replica, static batch shapes, resume.

Users pass a map-style dataset or a ``DataLoader``; `make_loader` rebuilds the loader around a
``DistributedSampler`` (``num_replicas`` = number of data-parallel replicas, ``rank`` = this
replica) when the order is a plain one (none given, a ``SequentialSampler``, a plain
``RandomSampler``). A ``DistributedSampler`` the user gave is kept as it is; any other sampler
of theirs (a subset, weights, their own class) is kept too and split between the replicas by a
`SplitSampler`. `ReplicaSampler` wraps either to (a) pad the epoch to whole batches on XLA, so
every step has one shape and compiles once, and (b) start an epoch part-way, which is how a
resumed run continues exactly.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import random
import sys
import threading
import warnings
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)
from torch.utils.data import Sampler as TorchSampler

from tiekit.errors import TiekitError
from tiekit.train.state import seed_generators

DEFAULT_BATCH_SIZE = 32


def derived_seed(seed: int, index: int) -> int:
    """A 63-bit seed for ``index`` (an epoch, a step) of a run seeded ``seed``: the same in every
    process and on a resume, different per index (and unrelated to ``seed + 1``'s, unlike a sum)."""
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class SplitSampler(TorchSampler[int]):
    """A sampler of the user's split between replicas: each epoch every replica draws the user's
    sampler's indices once, alike (the draw depends on ``seed`` and the epoch only), pads them to
    a multiple of ``num_replicas`` the way ``DistributedSampler`` pads, and takes every
    ``num_replicas``-th from ``rank`` on. The replicas' shares are disjoint and together are the
    draw, so a subset, weights or an order of the user's are what the run trains on.

    The user's sampler is never changed: each epoch draws from a shallow copy, with torch's,
    Python's and NumPy's global generators seeded with ``seed + epoch`` inside and restored
    after (a draw must not shift the dropout masks of the steps). A ``generator`` of the
    sampler's own is replaced in the copy by one seeded from its initial seed and the epoch: the
    user's seed still decides, and every epoch has a new draw, as with ``set_epoch``; a
    ``set_epoch`` of the sampler's own is called on the copy.
    """

    def __init__(self, sampler: TorchSampler[Any], num_replicas: int, rank: int, seed: int) -> None:
        self.sampler = sampler
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration draws (as ``DistributedSampler.set_epoch``)."""
        self.epoch = epoch

    def draw(self) -> list[int]:
        """Every index the user's sampler gives in this epoch, as every replica draws it."""
        drawn = copy.copy(self.sampler)
        own = getattr(drawn, "generator", None)
        if isinstance(own, torch.Generator):
            fresh = torch.Generator(device=own.device)
            fresh.manual_seed(derived_seed(own.initial_seed(), self.epoch))
            drawn.generator = fresh  # type: ignore[attr-defined]
        if callable(getattr(drawn, "set_epoch", None)):  # an epoch-aware sampler of the user's
            drawn.set_epoch(self.epoch)  # type: ignore[attr-defined]
        # One draw at a time in a process: XLA:CPU replicas are threads of one process, and the
        # global generators a draw seeds and restores are the process's.
        with _DRAWING, _global_generators_seeded(self.seed + self.epoch):
            return [int(i) for i in drawn]

    def __iter__(self) -> Iterator[int]:
        indices = self.draw()
        padding = -len(indices) % self.num_replicas
        if indices and padding:
            indices += (indices * (padding // len(indices) + 1))[:padding]
        return iter(indices[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return -(-len(cast(Sized, self.sampler)) // self.num_replicas)


_DRAWING = threading.Lock()


@contextlib.contextmanager
def _global_generators_seeded(seed: int) -> Iterator[None]:
    """Inside: torch's CPU, Python's and NumPy's global generators seeded with ``seed``; after:
    as they were (``torch.random.fork_rng`` covers torch's only)."""
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")  # torch imports it where it is installed
    numpy_state = numpy.random.get_state() if numpy is not None else None
    with torch.random.fork_rng(devices=[]):
        seed_generators(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            if numpy is not None:
                numpy.random.set_state(numpy_state)


class ReplicaSampler(TorchSampler[int]):
    """A replica's indices for one epoch: ``inner``'s, padded to whole batches, minus a prefix.

    ``pad_to`` (a batch size, or None) repeats the epoch's first indices at its end until the
    count is a multiple of it, the same way ``DistributedSampler`` pads replicas to equal
    lengths. `start` picks the epoch (``inner.set_epoch``) and how many batches to skip.
    """

    def __init__(self, inner: DistributedSampler[Any] | SplitSampler, pad_to: int | None) -> None:
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
    """The rebuilt ``DataLoader`` of one replica, the `ReplicaSampler` that drives it, and the
    loader's ``generator`` (its workers' base seed), seeded with ``seed`` and the epoch."""

    loader: DataLoader[Any]
    sampler: ReplicaSampler
    batch_size: int
    generator: torch.Generator
    seed: int
    drop_last: bool = True  # whether an epoch's short last batch is dropped (else trained, padded on XLA)
    # What orders an epoch, as a checkpoint records it: fit's seed (None: the order does not
    # depend on it) and whether it shuffles (None: a sampler of the user's decides).
    order_seed: int | None = None
    order_shuffle: bool | None = None

    def epoch(self, epoch: int, skip_batches: int = 0) -> DataLoader[Any]:
        """The loader for ``epoch``, without its first ``skip_batches`` batches."""
        self.sampler.start(epoch, skip_batches * self.batch_size)
        # The workers' seeds come from the generator when the epoch's iterator starts: seeded by
        # the epoch, a resumed run's workers draw what the uninterrupted run's drew in that epoch
        # (seeded once, a resumed process would give its first epoch epoch 0's seeds).
        self.generator.manual_seed(derived_seed(self.seed, epoch))
        return self.loader

    def epoch_share(self) -> tuple[int, int]:
        """(samples, batches) one epoch gives this replica."""
        batches = self.batches_per_epoch()  # from the start of the epoch
        return len(self.sampler), batches

    def samples_per_epoch(self) -> int:
        """The samples one epoch is drawn from, over every replica, before any padding: the
        dataset's length, or the length of the sampler of the user's that fit kept."""
        inner = self.sampler.inner
        if isinstance(inner, SplitSampler):
            return len(cast(Sized, inner.sampler))
        return len(cast(Sized, inner.dataset))

    def batches_per_epoch(self) -> int:
        """Batches one epoch yields on this replica (from the start of the epoch)."""
        self.sampler.start(0)
        count = len(self.sampler)
        return count // self.batch_size if self.drop_last else -(-count // self.batch_size)


def make_loader(
    data: Dataset[Any] | DataLoader[Any],
    *,
    batch_size: int | None,
    num_replicas: int,
    rank: int,
    shuffle: bool,
    seed: int,
    drop_last: bool | None,
    static_shapes: bool,
    what: str = "train_data",
) -> ReplicaLoader:
    """Rebuild ``data`` as this replica's loader (see the module docstring).

    ``batch_size`` is per replica (default: the DataLoader's, else 32); ``drop_last`` too
    (default: the DataLoader's, else True). ``static_shapes`` pads the last batch instead of
    leaving it short when the short last batch is kept (XLA).
    """
    dataset, given_sampler, options = _unpack(data, what)
    given_batch_size, given_drop_last = options.pop("batch_size", None), options.pop("drop_last", True)
    if batch_size is None:
        batch_size = given_batch_size or DEFAULT_BATCH_SIZE
    if drop_last is None:
        drop_last = given_drop_last
    if batch_size < 1:
        raise TiekitError(f"{what}: batch_size must be at least 1, not {batch_size}")
    inner: DistributedSampler[Any] | SplitSampler
    order_seed: int | None = seed
    order_shuffle: bool | None = None
    if isinstance(given_sampler, DistributedSampler):
        inner, order_seed = given_sampler, None
        if inner.num_replicas != num_replicas or inner.rank != rank:
            warnings.warn(
                f"{what}: keeping the DistributedSampler you gave (num_replicas={inner.num_replicas}, "
                f"rank={inner.rank}) although this run has {num_replicas} replica(s) and this is replica {rank}",
                UserWarning,
                stacklevel=3,
            )
    elif given_sampler is None or _plain_order(given_sampler, dataset) is not None:
        if given_sampler is not None:
            shuffle = bool(_plain_order(given_sampler, dataset))
        inner = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        order_seed, order_shuffle = (seed if shuffle else None), shuffle
    else:
        if not hasattr(type(given_sampler), "__len__"):
            raise TiekitError(
                f"{what}: the DataLoader's sampler {type(given_sampler).__name__} has no __len__; fit needs "
                "the number of samples it draws per epoch to count the epoch's batches"
            )
        inner = SplitSampler(given_sampler, num_replicas, rank, seed)
        if isinstance(getattr(given_sampler, "generator", None), torch.Generator):
            order_seed = None  # the sampler's own generator orders it (`SplitSampler.draw`), not fit's seed
    if len(inner) == 0:
        empty = "the dataset is empty" if isinstance(inner, DistributedSampler) else "the sampler draws none"
        raise TiekitError(f"{what}: replica {rank} of {num_replicas} gets no samples ({empty})")
    pad = batch_size if (static_shapes and not drop_last) else None
    sampler = ReplicaSampler(inner, pad)
    # Its own generator, so that building an iterator never draws from torch's global RNG
    # (that would shift dropout masks between a straight run and a resumed one).
    generator = torch.Generator().manual_seed(derived_seed(seed, 0))
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, generator=generator, **options
    )
    result = ReplicaLoader(loader, sampler, batch_size, generator, seed, drop_last, order_seed, order_shuffle)
    if drop_last and result.batches_per_epoch() == 0:
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
        batches = data.batch_sampler
        if type(batches) is not BatchSampler:
            raise TiekitError(f"{what}: a DataLoader with a custom batch_sampler is not supported; pass a sampler")
        # The loader's own BatchSampler (from batch_size=) or a plain one passed as batch_sampler=,
        # whose batch size, drop_last and sampler the DataLoader does not repeat (its batch_size
        # is None then, its sampler a default SequentialSampler).
        options: dict[str, Any] = {
            "batch_size": batches.batch_size,
            "drop_last": batches.drop_last,
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
        return dataset, batches.sampler, options
    if isinstance(data, IterableDataset):
        raise TiekitError(f"{what}: an IterableDataset cannot be split between replicas by a sampler; {_MAP}")
    if not (isinstance(data, Sized) and hasattr(data, "__getitem__")):
        raise TiekitError(f"{what}: expected a map-style Dataset or a DataLoader, got {type(data).__name__}")
    return cast(Dataset[Any], data), None, {}


_MAP = "pass a map-style dataset (with __len__ and __getitem__)"


def _plain_order(sampler: Any, dataset: Dataset[Any]) -> bool | None:
    """True: ``sampler`` is a plain shuffle of ``dataset`` (a ``RandomSampler`` without
    replacement over all of it, whatever its generator: fit's ``seed`` orders it); False: its
    plain order (a ``SequentialSampler`` over it); None: anything else, which fit keeps."""
    size = len(cast(Sized, dataset))
    if type(sampler) is SequentialSampler:
        return False if len(sampler) == size else None
    if type(sampler) is RandomSampler:
        return True if not sampler.replacement and sampler.num_samples == size else None
    return None
