"""What a sharded checkpoint holds: the model as the user holds it, reduced to one tensor per tie group.

Saving stores each tie group's source name once (a plain tensor or FSDP2's DTensor shard, as
the model holds it), every untied name, and the optimizer state and ``extra`` through the codec
of `tiekit.checkpoint` (tensors beside the weights under ``optimizer/...`` and ``extra/...``, the
rest as JSON in the marker). Loading fills destinations shaped like the live model, so DCP
reshards: a DTensor destination gets this rank's rows, a plain one the whole tensor.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiekit.checkpoint.contents import encode_training_state
from tiekit.errors import CheckpointError
from tiekit.plan import TiePlan, dtype_name
from tiekit.tracebacks import drop_frames

STATE_VERSION = 1


@dataclass(frozen=True)
class SaveState:
    """Everything a save writes: the DCP state dict and the marker's JSON record."""

    plan: TiePlan
    tensors: dict[str, torch.Tensor]
    record: dict[str, Any]


def save_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: Any) -> SaveState:
    """The tensors to save (one per tie group, then optimizer state and ``extra`` tensors) and the
    JSON record. Local: reads only this rank's model; `CheckpointError` naming the key on anything
    that cannot be stored."""
    plan, state, encoded = encode_training_state(model, optimizer, {"extra": (extra, "extra/value")})
    record: dict[str, Any] = {"state_version": STATE_VERSION, **encoded}
    record["tensors"] = {k: [list(t.shape), dtype_name(t.dtype)] for k, t in state.items()}
    return SaveState(plan, state, record)


def destination(like: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor to load a saved ``shape``/``dtype`` value into: sharded as ``like`` when ``like`` is
    a DTensor or a sharded XLA SPMD tensor of that global shape (so DCP reads only this rank's, or
    these devices', part), else whole on the CPU."""
    if like is None or tuple(like.shape) != shape or like.is_meta:
        return torch.empty(shape, dtype=dtype)
    if type(like).__name__ == "DTensor":
        return torch.empty_like(like.detach(), dtype=dtype)
    if xla_spmd([like]):
        from tiekit.backends.xla_spmd import spmd_empty_like

        made = spmd_empty_like(like, dtype)
        if made is not None:
            return made
    return torch.empty(shape, dtype=dtype)


def xla_spmd(tensors: Iterable[torch.Tensor]) -> bool:
    """True when ``tensors`` hold XLA SPMD tensors, which DCP saves and loads with torch_xla's
    planners (`tiekit.backends.xla_spmd`, imported here only: ``import tiekit`` never imports
    torch_xla, and a process without it holds no XLA tensor)."""
    from tiekit.backends.xla_spmd import spmd_tensors

    return spmd_tensors(tensors)


def parameters_by_name(model: nn.Module) -> Mapping[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False))


@contextlib.contextmanager
def running_dcp(where: object, reading: bool) -> Iterator[None]:
    """Around a call of DCP's save (``reading=False``) or load: its two warnings that say nothing
    to a tiekit user hidden (single-process saves are intended here; its use of TypedStorage is
    DCP's to change), and its failure, a ``CheckpointException`` (a ``BaseException`` DCP raises on
    every rank alike, holding each failed rank's error), raised as a `CheckpointError` naming
    ``where`` (the folder) and the first line of each failed rank's error.

    The two warnings are hidden by filters for their messages alone, put first in the process's
    filters at every call and left there: ``warnings.catch_warnings`` is not thread-safe, and a
    background save's writer thread leaving it restored the filters it had found, undoing those
    the program set meanwhile (``simplefilter("error")``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not dcp_takes_no_dist():
        raise CheckpointError(
            f"{where}: tiekit's sharded checkpoints call torch.distributed.checkpoint's save and load with "
            f"no_dist, which this torch ({torch.__version__}) lacks (torch 2.4 to 2.6 do; 2.9.1 and 2.14.1 "
            "are tested): upgrade torch, or use single-file checkpoints (tiekit.save_checkpoint)"
        )
    for message in _DCP_NOISE:  # first again at every call: ahead of an "error" filter set since
        warnings.filterwarnings("ignore", message=message)
    try:
        yield
    except CheckpointException as exc:
        raise dcp_failure(exc, where, reading) from exc


@functools.cache
def dcp_takes_no_dist() -> bool:
    """Whether this torch's DCP ``save`` and ``load`` take ``no_dist`` (a single-process or
    rank-local call, without a collective), which every DCP call of tiekit passes."""
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    return all("no_dist" in inspect.signature(call).parameters for call in (save, load))


def dcp_save(
    state: Mapping[str, Any], *, storage_writer: Any, no_dist: bool, planner: Any = None, process_group: Any = None
) -> None:
    """Collective unless ``no_dist`` (then this process alone): DCP's save of ``state``, whose
    values are tensors and plain data, no ``Stateful`` objects. DCP's own ``_save_state_dict``
    where this torch has it: its public ``save`` first passes each top-level value through a
    call wrapped in DCP's method logger (a UUID and a log record per key, discarded unless a
    handler was added), 17 µs a key on torch 2.14, 7.7 ms of a background save's Python for 450
    keys, taken from the training thread, which waits for the GIL. ``save`` itself otherwise."""
    from torch.distributed.checkpoint import state_dict_saver

    kwargs = {"storage_writer": storage_writer, "planner": planner, "process_group": process_group, "no_dist": no_dist}
    if _takes_state_dict_directly():
        state_dict_saver._save_state_dict(state_dict=dict(state), **kwargs)
    else:
        state_dict_saver.save(dict(state), **kwargs)


@functools.cache
def _takes_state_dict_directly() -> bool:
    from torch.distributed.checkpoint import state_dict_saver

    inner = getattr(state_dict_saver, "_save_state_dict", None)
    wanted = {"state_dict", "storage_writer", "planner", "process_group", "no_dist"}
    return inner is not None and wanted <= set(inspect.signature(inner).parameters)


_DCP_NOISE = ("torch.distributed is disabled, unavailable or uninitialized", "TypedStorage is deprecated")


def dcp_failure(exc: Any, where: object, reading: bool) -> CheckpointError:
    """DCP's ``CheckpointException`` ``exc`` as a `CheckpointError` naming ``where`` and the first
    line of each failed rank's error (see `running_dcp`)."""
    what = "read its shard files (corrupt, or not written by DCP?)" if reading else "write its shard files"
    for failure in exc.failures.values():
        # DCP keeps each rank's error with a summary of its stack, which it prints: the error's
        # own frames would only keep the state being written alive (see `SaveHandle`).
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, BaseException):
            drop_frames(error)  # and its causes': torch's zip writer error under it held the tensors
    return CheckpointError(f"{where}: DCP could not {what}: {_failures(exc.failures)}")


def _failures(failures: Mapping[int, Any]) -> str:
    told = []
    for rank, failure in sorted(failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure  # DCP keeps (error, traceback)
        first_line = next(iter(str(error).splitlines()), "")  # the rest is torch's advice or a traceback
        told.append(f"rank {rank}: {type(error).__name__}: {first_line}")
    return "; ".join(told)
