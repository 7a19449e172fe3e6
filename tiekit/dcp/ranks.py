"""The ranks of a sharded save or load: who they are, what they must agree on, and how a failure
on one reaches all (`raise_anywhere`). Every function here is local unless its docstring starts
with "Collective"."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tiekit.collective import Ranks, collective_gather, failure_message
from tiekit.errors import CheckpointError


def raise_anywhere(
    error: BaseException | None,
    what: str,
    share: Any = None,
    on_failure: Callable[[list[Any]], None] | None = None,
    operation: str | None = None,
) -> list[Any]:
    """Collective: raise on every rank if any rank failed (the failing rank's own error there),
    after calling ``on_failure`` (local) with every rank's ``share``; else every rank's ``share``,
    in rank order (sent in the same exchange). ``operation``: as in `collective_gather`."""
    text = None if error is None else f"{type(error).__name__}: {error}"
    gathered = collective_gather((text, share), operation=operation)
    errors = [e for e, _ in gathered]
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return [shared for _, shared in gathered]
    if on_failure is not None:
        on_failure([shared for _, shared in gathered])
    if isinstance(error, CheckpointError) and all(e == text for _, e in failed):
        raise error  # the same failure everywhere (a bad checkpoint): this rank's own error says it all
    raise CheckpointError(failure_message(what, errors)) from error


def folder_names(root: Path) -> tuple[str, str]:
    """``root`` (absolute) as this rank names it and with its symbolic links resolved: what the
    ranks compare (`refuse_different_folders`). Local."""
    return os.fspath(root), os.path.realpath(root)


def same_folder(names: tuple[str, str], other: tuple[str, str]) -> bool:
    """Whether two ranks' `folder_names` name one folder: the same absolute path, or the same
    folder once symbolic links are resolved (one rank reaching it through a link). Local."""
    return names[0] == other[0] or names[1] == other[1]


def refuse_different_folders(paths: list[tuple[str, str]], what: str) -> None:
    """`CheckpointError` unless every rank's folder (``paths``: each rank's `folder_names`, in rank
    order, as gathered) is rank 0's (`same_folder`). Local."""
    if not all(same_folder(names, paths[0]) for names in paths[1:]):
        shown = "; ".join(f"rank {r}: {p}" for r, (p, _) in enumerate(paths))
        raise CheckpointError(f"{what} needs the same folder on every rank ({shown})")


def process_group_needed(
    where: Ranks, distributed: bool, what: str, root: Path, unchanged: str = "Nothing was written"
) -> CheckpointError | None:
    """The error for a sharded save or load among ranks DCP cannot coordinate: several ranks and
    no torch.distributed process group (each would write or read as the only rank), ending with
    ``unchanged`` (what the refusal left as it was). Local: every rank finds the same, so all
    raise before any collective."""
    if where.world == 1 or distributed:
        return None
    start = f"{root}: {what} runs torch.distributed.checkpoint"
    if where.kind == "xla-threads":
        instead = (
            "save them once, with tiekit.collective_save_checkpoint (one file), instead"
            if what.startswith("save")
            else "load the folder in one replica (devices=1), or convert it to one file with tiekit.convert "
            "and load that"
        )
        return CheckpointError(
            f"{start}, which needs one process per rank; the {where.world} replicas here are threads of "
            f"one process (torch_xla.launch on XLA:CPU). They hold the same weights: {instead}. {unchanged}"
        )
    who = "hosts of this SPMD run" if where.kind == "spmd-hosts" else "XLA processes"
    return CheckpointError(
        f"{start}, which coordinates the {where.world} {who} through a torch.distributed process group, "
        "and there is none: call torch.distributed.init_process_group('gloo', init_method='xla://') in "
        "every process first (torch_xla's rendezvous; import torch_xla.distributed.xla_backend). "
        f"{unchanged}"
    )


def distributed() -> bool:
    """True with an initialized torch.distributed process group (local)."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized())


def rank() -> int:
    """This process's rank in the default group, 0 without one (local)."""
    return int(torch.distributed.get_rank()) if distributed() else 0


def world() -> int:
    """The default group's size, 1 without one (local)."""
    return int(torch.distributed.get_world_size()) if distributed() else 1


def extra_keys(extra: Any) -> list[str]:
    """The keys of ``extra`` when it is a dict. Values are not compared (they may differ by rank,
    a timer), nor the keys of dicts inside (``fit``'s RNG states hold numpy's only where numpy
    was imported). Local."""
    return sorted(map(str, extra)) if isinstance(extra, dict) else []


def refuse_different_options(root: Path, options: list[dict[str, Any]]) -> None:
    """`CheckpointError` when the ranks' ``options`` of `save_sharded` (in rank order, as
    gathered: ``blocking`` and `extra_keys`) do not go together: ``blocking`` differs (a blocking
    rank would wait in DCP's collectives for ranks writing in the background), or a rank's
    ``extra`` has keys rank 0's lacks (only rank 0's is stored: they would be lost; ``extra`` on
    rank 0 alone is fine when it holds no tensors, which every rank writes as the model's). Local."""
    if any(o["blocking"] != options[0]["blocking"] for o in options):
        shown = "; ".join(f"rank {r}: {o['blocking']}" for r, o in enumerate(options))
        raise CheckpointError(
            f"{root}: save_sharded needs the same blocking on every rank ({shown}); a blocking rank would wait in "
            "DCP's collectives for ranks writing in the background. Nothing was written"
        )
    stored = set(options[0]["extra's keys"])
    lost = {r: sorted(set(o["extra's keys"]) - stored) for r, o in enumerate(options)}
    lost = {r: keys for r, keys in lost.items() if keys}
    if lost:
        shown = "; ".join(f"rank {r}: {keys}" for r, keys in lost.items())
        raise CheckpointError(
            f"{root}: save_sharded was given extra keys that rank 0's extra lacks ({shown}; rank 0: "
            f"{sorted(stored)}); only rank 0's extra is stored (tensors are written by every rank, other values by "
            "rank 0), so they would be lost. Nothing was written"
        )
