"""Coordination between the ranks of a run. Every function here that waits for other ranks says
so: its name starts with ``collective_`` and every rank must call it, in the same order.

Everything else in tiekit is local: `tiekit.save_model` writes where it is called and never
waits. The one convention for multi-rank code:

* one writer: ``if tiekit.is_writer(): tiekit.save_model(model, path)``, then your own
  ``dist.barrier()`` if other ranks read the file next (Lightning calls its ``CheckpointIO``
  on rank 0 only: that is this pattern);
* or every rank calls `collective_save_model` (or `collective_save_checkpoint`): each distinct
  path is written once, by the lowest rank that names it (so one shared path is written once,
  per-rank paths each by their rank), and a failure of any writer, or a rank that cannot see
  the file written at its path (node-local disks), is raised on every rank.

Ranks are torch.distributed processes, ``torch_xla.launch`` replicas (threads of one process on
XLA:CPU, processes on TPU hosts), or the hosts of a multi-host SPMD run (one process each,
told apart by the process index: under SPMD every host is XLA replica 0).
"""

from __future__ import annotations

import inspect
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch

from tiekit import launch_threads
from tiekit.errors import CheckpointError, TiekitError

T = TypeVar("T")

if torch.distributed.is_available():
    # torch.distributed.nn.functional's collectives take ``group=group.WORLD`` as a default
    # argument, evaluated at its first import. torch.distributed.checkpoint imports it, so a first
    # sharded save after init_process_group left the default group in those defaults for the life
    # of the process: destroy_process_group could not free it, and its gloo threads were torn
    # down during interpreter shutdown, where torch 2.14 can abort the process ("terminate called
    # without an active exception", pytorch/pytorch#179291). Imported now, before any group
    # exists (2.5 ms), the defaults are None.
    import torch.distributed.nn.functional

#: Seconds a collective waits for the other ranks before it fails (threads, gloo): a stuck
#: rank is an error naming it, never a hang.
DEFAULT_TIMEOUT = 1800.0


@dataclass(frozen=True)
class Ranks:
    """Where this process (or launch thread) stands in its run: ``rank`` of ``world``, and how the
    ranks are joined: ``"single"``, ``"torch.distributed"``, ``"xla-threads"`` (launch threads
    of one process), ``"xla-processes"`` or ``"spmd-hosts"``."""

    rank: int
    world: int
    kind: str

    @property
    def is_writer(self) -> bool:
        """True on the rank that writes shared files: rank 0."""
        return self.rank == 0


def ranks() -> Ranks:
    """This process's `Ranks` (local: asks the runtimes, never waits, never starts torch_xla)."""
    from tiekit.backends import xla  # its Backend class needs this module: imported on use

    replicas = xla.xla_replicas()
    if replicas is not None:
        ordinal, world, processes = replicas
        return Ranks(ordinal, world, "xla-threads" if processes == 1 else "xla-processes")
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return Ranks(int(dist.get_rank()), int(dist.get_world_size()), "torch.distributed")
    hosts = xla.spmd_hosts()
    if hosts is not None:
        return Ranks(hosts[0], hosts[1], "spmd-hosts")
    return Ranks(0, 1, "single")


def is_writer() -> bool:
    """True in the one rank of the run that writes shared files (local, never waits): global
    rank 0, XLA global ordinal 0, SPMD process index 0, or the only process there is."""
    return ranks().is_writer


# -- collectives ------------------------------------------------------------------------------


def collective_gather(value: Any, *, timeout: float = DEFAULT_TIMEOUT, operation: str | None = None) -> list[Any]:
    """Collective: every rank's picklable ``value``, in rank order, on every rank.

    A rank that does not arrive within ``timeout`` seconds is a `TiekitError` naming it (launch
    threads, gloo); nccl and XLA processes wait as long as their runtime's own timeout.
    ``operation`` names the call this gather begins (``"save_sharded"``): ranks that meet in
    gathers of different operations (one saving, another loading) raise a `TiekitError` on every
    rank naming each rank's, instead of pairing the wrong values.
    """
    where = ranks()
    if where.world == 1:
        return [value]
    if where.kind == "xla-threads":
        gathered = launch_threads.gather(where.rank, where.world, (operation, value), timeout)
    elif where.kind == "torch.distributed":
        gathered = _dist_gather(where, (operation, value), timeout)
    else:
        # XLA replicas or SPMD hosts in several processes: the runtime's rendezvous carries bytes.
        from tiekit.backends import xla

        payloads = xla.xla_rendezvous("tiekit.collective", pickle.dumps((operation, value)))
        gathered = [pickle.loads(p) for p in payloads]  # peers of this very run, not files from outside
    operations = [op for op, _ in gathered]
    if any(op != operation for op in operations):
        shown = "; ".join(f"rank {r}: {op or 'another tiekit collective'}" for r, op in enumerate(operations))
        raise TiekitError(
            f"rank {where.rank}: the ranks are in different tiekit collectives ({shown}); every rank must call "
            "the same collectives in the same order (did one rank skip a call, or fail and go on?)"
        )
    return [v for _, v in gathered]


def collective_barrier(*, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Collective: return once every rank has called it (`TiekitError` naming the missing ranks
    after ``timeout`` seconds, where the runtime allows)."""
    collective_gather(None, timeout=timeout)


def collective_agree(value: T, what: str, *, timeout: float = DEFAULT_TIMEOUT) -> T:
    """Collective: rank 0's ``value`` (picklable, comparable), after checking every rank holds the
    same; a disagreement is a `TiekitError` on every rank naming ``what`` and the ranks that differ."""
    values = collective_gather(value, timeout=timeout)
    differ = [r for r, v in enumerate(values) if v != values[0]]
    if differ:
        shown = "; ".join(f"rank {r}: {values[r]!r}" for r in [0, *differ[:7]])
        raise TiekitError(f"the ranks disagree on {what} ({shown}); it must be the same on every rank")
    agreed: T = values[0]
    return agreed


def failure_message(what: str, errors: list[str | None], where: list[str] | None = None) -> str:
    """``what`` failed on which of ``len(errors)`` ranks (``None``: that rank did not fail), each
    distinct error once with the ranks that raised it, and ``where[rank]`` after each rank (local).
    A save that fails alike on every rank (DCP reports all ranks' failures to each) reads once."""
    by_text: dict[str, list[str]] = {}
    for rank, error in enumerate(errors):
        if error is not None:
            by_text.setdefault(error, []).append(f"{rank}" + (f" ({where[rank]})" if where else ""))
    detail = "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(rs)}: {text}" for text, rs in by_text.items())
    if len(errors) == 1:
        return f"{what} failed: {detail}"
    failed = sum(e is not None for e in errors)
    return f"{what} failed on {failed} of {len(errors)} rank(s): {detail}"


def collective_run(
    path_key: str,
    write: Callable[[], None],
    *,
    what: str,
    timeout: float = DEFAULT_TIMEOUT,
    refusal: Exception | None = None,
) -> None:
    """Collective: run ``write`` once per distinct ``path_key`` (on the lowest rank naming it) and
    raise every writer's failure on every rank (`CheckpointError` naming the rank and its error).
    Then each rank whose path another rank wrote checks it sees that file (same size and
    modification time); a rank that does not (node-local disks) is a `CheckpointError` on every rank.
    ``refusal``: this rank's arguments are wrong (its own check); any rank's refusal is raised on
    every rank before anything is written, so no rank waits for one that gave up alone. The
    building block of `collective_save_model`; ``what`` names the operation in errors."""
    where = ranks()
    refused = None if refusal is None else f"{type(refusal).__name__}: {refusal}"
    gathered = collective_gather((path_key, refused), timeout=timeout, operation=what)
    refusals = [r for _, r in gathered]
    if any(r is not None for r in refusals):
        if refusal is not None and all(r == refused for r in refusals):
            raise refusal  # the same mistake on every rank (or the only one): its own error says it all
        raise TiekitError(f"{failure_message(what, refusals)}. Nothing was written") from refusal
    keys = [k for k, _ in gathered]
    writers = [keys.index(k) for k in keys]
    error: str | None = None
    own: Exception | None = None
    written: tuple[int, int] | None = None
    if writers[where.rank] == where.rank:
        try:
            write()
            written = _identity(path_key)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below, then raised here too
            error = f"{type(exc).__name__}: {exc}"
            own = exc
    reports = collective_gather((error, written), timeout=timeout)
    errors = [e for e, _ in reports]
    if any(e is not None for e in errors):
        # The same error on every rank, the writer's own included: it names the ranks that failed.
        raise CheckpointError(failure_message(what, errors, keys)) from own
    if all(w == r for r, w in enumerate(writers)):
        return  # per-rank paths: each rank wrote its own, no rank reads another's
    # A path written by another rank is the same file here only on a filesystem both see: on
    # node-local disks the others returned as if saved and their next load found nothing.
    unseen: str | None = None
    if writers[where.rank] != where.rank:
        unseen = _unseen(path_key, reports[writers[where.rank]][1])
    unseens = collective_gather(unseen, timeout=timeout)
    missing = [r for r, u in enumerate(unseens) if u is not None]
    if missing:
        shown = "; ".join(f"rank {r} {unseens[r]} (written by rank {writers[r]})" for r in missing)
        raise CheckpointError(
            f"{what}: {len(missing)} of {len(keys)} rank(s) do not see the file another rank wrote for them: "
            f"{shown}. Each path was written once, by the lowest rank naming it, so one path must be the same "
            "file on every rank: these ranks' storage is their own (node-local disks?). Use a filesystem every "
            "rank sees, give each rank its own path, or save with `if tiekit.is_writer(): tiekit.save_model(...)` "
            "and copy the file yourself. The written file was left in place"
        )


def collective_save_model(
    model: torch.nn.Module, path: str | os.PathLike[str], *, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any
) -> None:
    """Collective: every rank calls it; `tiekit.save_model` runs once per distinct path, on the
    lowest rank naming it (one shared path: written once; per-rank paths: each by its rank). A
    failure of any writer raises `CheckpointError` on every rank, and so does a rank that cannot
    see the file another rank wrote at its path (a shared path on node-local disks); the written
    file is kept. ``timeout`` as in `collective_gather`; other keywords as `tiekit.save_model`."""
    from tiekit.checkpoint import save_model

    target, refusal = _target(path, "collective_save_model(model, path)")
    refusal = refusal or _unknown_keywords(save_model, model, target, **kwargs)
    collective_run(
        target,
        lambda: save_model(model, target, **kwargs),
        what="collective_save_model",
        timeout=timeout,
        refusal=refusal,
    )


def collective_save_checkpoint(
    path: str | os.PathLike[str], *, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any
) -> None:
    """Collective: `tiekit.save_checkpoint` as `collective_save_model` runs `tiekit.save_model`:
    once per distinct path, every writer's failure (or a rank not seeing the file written for
    it) raised on every rank."""
    from tiekit.checkpoint import save_checkpoint

    target, refusal = _target(path, "collective_save_checkpoint(path, model=...)")
    refusal = refusal or _unknown_keywords(save_checkpoint, target, **kwargs)
    if refusal is None and kwargs.get("blocking", True) is not True:
        refusal = TiekitError(
            "collective_save_checkpoint writes before it returns (it reports the writer's failure to every "
            "rank); for a background save call tiekit.save_checkpoint(..., blocking=False) on the writer"
        )

    def write() -> None:
        save_checkpoint(target, **kwargs)

    collective_run(target, write, what="collective_save_checkpoint", timeout=timeout, refusal=refusal)


def _target(path: Any, call: str) -> tuple[str, Exception | None]:
    """The absolute path the ranks compare, or this rank's refusal of a ``path`` that is none (a
    model there: arguments swapped), raised on every rank before anything is written."""
    from tiekit.checkpoint.arguments import check_path

    try:
        check_path(path, call)
    except CheckpointError as exc:
        return "", exc
    return os.path.abspath(os.fspath(path)), None


def _identity(path: str) -> tuple[int, int]:
    """The size and modification time of what a save to ``path`` wrote, read through an open
    file: on NFS an open revalidates what this machine cached (close-to-open), a bare stat may
    answer from its cache. A file path saved as shards (``max_shard_size``) holds no file at
    ``path`` but its index beside it, which names the shards."""
    from tiekit.checkpoint.layout import saved_at  # the checkpoint package imports this module

    fd = os.open(saved_at(path), os.O_RDONLY)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return st.st_size, st.st_mtime_ns


def _unseen(path: str, written: tuple[int, int] | None) -> str | None:
    """Why this rank does not see the file the writer reported as ``written`` at ``path`` (None: it does)."""
    try:
        here = _identity(path)
    except OSError as exc:
        return f"cannot open {path} ({exc.strerror or exc})"
    if written is not None and here != written:
        return (
            f"sees another file at {path} ({here[0]} bytes, modified {here[1]} ns; "
            f"the writer's: {written[0]} bytes, modified {written[1]} ns)"
        )
    return None


def _unknown_keywords(function: Callable[..., Any], *args: Any, **kwargs: Any) -> TypeError | None:
    """The `TypeError` for a keyword ``function`` does not take, checked on every rank (only the
    writer calls it: another rank's misspelled keyword went unnoticed). Missing arguments are the
    writer's to report: a rank that writes nothing may leave them out."""
    try:
        inspect.signature(function).bind_partial(*args, **kwargs)
    except TypeError as exc:
        return TypeError(f"{function.__name__}() {exc}")
    return None


# -- runtimes ---------------------------------------------------------------------------------


def _dist_gather(where: Ranks, value: Any, timeout: float) -> list[Any]:
    dist = torch.distributed
    if dist.get_backend() == "gloo":
        # monitored_barrier names the ranks that did not arrive instead of hanging.
        start = time.monotonic()
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=True)
        except RuntimeError as exc:
            # Rank 0 waits up to `timeout`; the others wait for rank 0's answer, bounded by the
            # process group's own timeout when that is shorter: name both bounds. A rank whose
            # process ended fails it at once, with the same words from gloo: the wait tells.
            raise TiekitError(
                f"rank {where.rank}: a collective failed after {time.monotonic() - start:.1f} s: another rank's "
                f"process ended (exited or crashed), or not every rank arrived within {timeout:g} s (or the "
                f"process group's timeout, if shorter): {exc}"
            ) from exc
    out: list[Any] = [None] * where.world
    dist.all_gather_object(out, value)
    return out
