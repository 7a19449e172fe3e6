"""What the ranks of one `tiekit.fit` run must have passed and built alike, and how a difference
is told: local judgements over values every rank gathered (`tiekit.train.joining.join` and the
``Coordinator.agree_on_*`` collectives gather them, then call these on every rank, so every rank
raises the same `TiekitError`)."""

from __future__ import annotations

from typing import Any

import torch

from tiekit.checkpoint.layout import name_list
from tiekit.dcp.ranks import same_folder
from tiekit.errors import TiekitError


def refuse_different_optimizers(gathered: list[dict[str, str]]) -> None:
    """Local: ``gathered`` holds every rank's `optimizer_description`, in rank order; a
    `TiekitError` naming the first option that differs, and the ranks, if they are not equal."""
    differ = [r for r, other in enumerate(gathered) if other != gathered[0]]
    if not differ:
        return
    first = differ[0]
    what = next(
        k for k in sorted(set(gathered[0]) | set(gathered[first])) if gathered[0].get(k) != gathered[first].get(k)
    )
    shown = "; ".join(f"rank {r}: {gathered[r].get(what, 'none')}" for r in [0, *differ[:7]])
    raise TiekitError(
        f"the ranks of this run built different optimizers: {what} is {shown}. The optimizer factory must "
        "build the same optimizer on every rank of a run (a learning rate that depends on the rank?)"
    )


def refuse_different_data(gathered: list[dict[str, tuple[int, int]]]) -> None:
    """Local: ``gathered`` holds every rank's ``{"train_data": (samples, batches)}``, in rank
    order; a `TiekitError` naming the ranks and their shares if a dataset is missing on some
    ranks or their shares have different numbers of batches."""
    for what in sorted(set().union(*gathered)):  # train_data first
        lacking = [r for r, other in enumerate(gathered) if what not in other]
        if lacking:
            given = [r for r, other in enumerate(gathered) if what in other]
            raise TiekitError(
                f"{what} was passed to fit on rank(s) {name_list(given)} but not on rank(s) {name_list(lacking)}: "
                "pass it on every rank or on none (each rank takes its share, and the ranks sum their losses)"
            )
        batches = gathered[0][what][1]
        differ = [r for r, other in enumerate(gathered) if other[what][1] != batches]
        if differ:
            shown = "; ".join(
                f"rank {r}: {gathered[r][what][0]} samples in {gathered[r][what][1]} batches" for r in [0, *differ[:7]]
            )
            raise TiekitError(
                f"the ranks of this run were given different {what}: each rank's share of one epoch is "
                f"{shown}. Pass the same dataset on every rank: fit gives each rank its share (a "
                "DistributedSampler); ranks whose epochs end at different steps would wait for each other "
                "for good"
            )


def refuse_different_options(gathered: list[dict[str, Any]], shared_folder: str | None) -> None:
    """Local: ``gathered`` holds every rank's options of `tiekit.fit` (strategy first), in rank
    order; a `TiekitError` naming the first that differs and the ranks. ``shared_folder``: the
    strategy whose every rank writes into one ``checkpoint_dir`` and reads its part of one
    ``resume`` folder: those paths are each rank's `tiekit.dcp.ranks.folder_names` (a tuple), the
    same folder when either name is the same."""
    first = gathered[0]
    for name in first:
        differ = [r for r, other in enumerate(gathered) if _differs(other[name], first[name])]
        if differ:
            shown = "; ".join(f"rank {r}: {_shown(gathered[r][name])!r}" for r in [0, *differ[:7]])
            why = (
                f" (strategy={shared_folder!r} has every rank write or read its part of one folder; a relative "
                "path names a folder in each rank's working directory)"
                if name in ("checkpoint_dir", "resume") and shared_folder is not None
                else ""
            )
            raise TiekitError(
                f"the ranks of this run passed fit different {name} ({shown}); it must be the same on every rank{why}"
            )


def _differs(value: Any, first: Any) -> bool:
    if isinstance(value, tuple) and isinstance(first, tuple):  # a folder's (absolute, resolved) names
        return not same_folder(value, first)
    return bool(value != first)


def _shown(value: Any) -> Any:
    return value[0] if isinstance(value, tuple) else value  # a folder as the rank named it (made absolute)


def optimizer_description(optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """``{"the optimizer": class, "param group 0's lr": "0.01", ...}``: what must be equal on every rank."""
    found = {
        "the optimizer": type(optimizer).__qualname__,
        "the number of param groups": str(len(optimizer.param_groups)),
    }
    for i, group in enumerate(optimizer.param_groups):
        found[f"param group {i}'s parameter count"] = str(len(group["params"]))
        found.update((f"param group {i}'s {key}", _option(value)) for key, value in group.items() if key != "params")
    return found


def _option(value: Any) -> str:
    # A tensor option (a tensor lr) lives on each rank's own device: compared by value.
    if isinstance(value, torch.Tensor):
        return f"{value.tolist()!r} ({str(value.dtype).removeprefix('torch.')} tensor)"
    return repr(value)
