"""Background saves of an unchanged state written as DCP planned the last one.

A loop that saves every N steps saves the same names, shapes and shardings each time: DCP plans
each save anew all the same (every rank's local plan, their gather to rank 0, its global plan and
metadata, their scatter back), a few milliseconds of Python in the writing thread that training
waits for whenever it wants the GIL back (docs/benchmarks.md, "what the 9-12 ms per save are
made of"). When the last background save's shard file on every rank was its `ShardImage` whole
(then, at most, whole replicated tensors DCP gave the rank, such as optimizer step counts), its
plan says nothing the next save of the same image would not repeat: which bytes of the image
each item is, which tensors follow it, and rank 0's global metadata. So the next save writes
the image and those tensors to the same file name, and DCP's own second phase
(`_DistWrapper.all_reduce`: every rank's write results, or its failure, to rank 0, which writes
``.metadata`` with the writer's ``finish``; the outcome to every rank) completes it: the same
files DCP would write, in the same format, without planning again.
DCP's ``DefaultSavePlanner(enable_plan_caching=True)`` skips re-planning in the same spirit, but
still runs both phases' collectives and its local planning, and a coordinator whose cache is
empty (a restarted process) takes the other ranks' "unchanged" empty plans for their plans.

Every rank replays, all from the same planned save, or none does
(`collective_agree_to_replay`): a rank whose image was made anew (a layout changed), whose last
plan held anything else (a part of a DTensor that is not sharded on every mesh dimension, a byte
item) or whose last save failed plans with DCP, and so then does every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tiekit.dcp.shard_image import ShardImage
from tiekit.dcp.staging import Staging
from tiekit.dcp.state import dcp_save


@dataclass(frozen=True)
class Recipe:
    """What DCP planned for a background save whose shard file on this rank was ``image`` whole,
    then the records of ``extras`` (write items of whole plain tensors: the replicated ones DCP
    gave this rank, such as optimizer step counts): the state's names in order, the file's name,
    the image's write results and (rank 0) the global metadata without storage data, in a world
    of ``world`` ranks; ``origin``, the id of the save DCP planned (the same on every rank), and
    ``layout``, the digest of its state's description (every name's shape and dtype, the plan)."""

    origin: str
    layout: str
    image: ShardImage
    names: tuple[str, ...]
    file: str
    results: tuple[Any, ...]
    extras: tuple[Any, ...]
    metadata: Any
    world: int


def recipe_for(hosts: Mapping[str, Any], previous: Recipe | None, layout: str, world: int) -> Recipe | None:
    """``previous`` when it describes a save of ``hosts`` (a `Staging` of the same image, the same
    names in the same order, each of the same shape and dtype: the same ``layout`` digest, in the
    same world), else None. The image alone does not say it: a tensor outside it (a replicated
    one, an empty one, one that left it) may change while the image is kept. Local."""
    if previous is None or getattr(hosts, "image", None) is not previous.image:
        return None
    if previous.world != world or previous.layout != layout:
        return None
    return previous if tuple(hosts) == previous.names else None


def collective_write_copies(
    save: tuple[str, str],
    hosts: Mapping[str, Any],
    writer: Any,
    recipe: Recipe | None,
    planner: Any,
    group: Any,
    distributed: bool,
) -> None:
    """Collective over ``group`` when ``distributed``: the host copies of ``save`` (its id and its
    layout digest) written by DCP (`dcp_save`), or as DCP planned the last save of the same image
    when every rank can (`collective_replay`); either way, what the next save of this image can
    replay kept in ``hosts``."""
    if collective_agree_to_replay(recipe, distributed, group):
        assert recipe is not None and isinstance(hosts, Staging)  # a recipe is found for a Staging only
        collective_replay(recipe, hosts, writer, distributed, group)
        hosts.recipe = recipe
        return
    dcp_save(hosts, storage_writer=writer, planner=planner, process_group=group, no_dist=not distributed)
    if isinstance(hosts, Staging):
        hosts.recipe = recorded(save, writer, hosts, torch.distributed.get_world_size() if distributed else 1)


def collective_agree_to_replay(recipe: Recipe | None, distributed: bool, group: Any) -> bool:
    """Collective over ``group`` when ``distributed``: whether every rank holds a recipe, all of
    them of the same planned save."""
    if not distributed:
        return recipe is not None
    # One gather of a number per rank: 0 for none, else one naming the recipe's planned save.
    named = 0 if recipe is None else 1 + int.from_bytes(hashlib.blake2b(recipe.origin.encode(), digest_size=7).digest())
    mine = torch.tensor([named])
    every = [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(every, mine, group=group)
    return bool(mine.item()) and all(torch.equal(other, mine) for other in every)


def collective_replay(recipe: Recipe, hosts: Mapping[str, Any], writer: Any, distributed: bool, group: Any) -> None:
    """Collective over ``group`` when ``distributed`` (every rank replaying): write ``recipe``'s
    image and its extras (their values from ``hosts``) to its file with ``writer`` (a
    `DurableWriter`), then DCP's second phase: rank 0 writes the ``.metadata`` once every rank's
    file is written, and a failure anywhere is DCP's ``CheckpointException`` on every rank, as
    from DCP's own save."""
    from torch.distributed.checkpoint.utils import _DistWrapper

    ranks = _DistWrapper(group, distributed, 0)
    writer.set_up_storage_writer(ranks.is_coordinator, rank=ranks.rank, use_collectives=True)

    def write() -> list[Any]:
        extras = [(item, hosts[item.index.fqn]) for item in recipe.extras]
        written: list[Any] = writer.write_image_file(recipe.image, recipe.file, extras)
        return list(recipe.results) + written

    def finish(results: list[list[Any]]) -> None:
        writer.finish(metadata=dataclasses.replace(recipe.metadata), results=results)

    ranks.all_reduce("write", write, finish)


def recorded(save: tuple[str, str], writer: Any, hosts: Staging, world: int) -> Recipe | None:
    """The recipe of ``save`` (its id and layout digest), which ``writer`` (a `DurableWriter`) just
    completed for ``hosts``, if this rank's shard file was the image whole, then whole plain
    tensors only (and, on rank 0, the metadata was written). Local."""
    if writer.image_file is None or hosts.image is None or (writer.coordinator and writer.planned_metadata is None):
        return None
    file, results, extras = writer.image_file
    if not all(_whole(item, hosts.get(item.index.fqn)) for item in extras):
        return None
    save_id, layout = save
    return Recipe(
        save_id, layout, hosts.image, tuple(hosts), file, tuple(results), tuple(extras), writer.planned_metadata, world
    )


def _whole(item: Any, value: Any) -> bool:
    """Whether DCP's write item ``item`` is the whole of ``value``, a plain tensor: what the
    next save's value of the same name is written as, without DCP resolving it."""
    if type(value) is not torch.Tensor or item.tensor_data is None:
        return False
    chunk = item.tensor_data.chunk
    return tuple(chunk.sizes) == tuple(value.shape) and not any(chunk.offsets)
