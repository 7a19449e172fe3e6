"""How spawned replicas report to the process that called `fit`, and how it reads them.

Each replica writes its `Outcome` (``outcome-<rank>.json``) or the error it raised
(``error-<rank>.json``), every file whole or not there; one replica per host writes the trained
weights, which the caller's model then loads with `tiekit.load_model` (ties included). A replica
that failed is named by the first error written, not by whichever exit torch saw first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import safetensors.torch as safetensors_torch
from torch import nn

from tiekit import load_model
from tiekit.errors import CheckpointError, TieError, TiekitError
from tiekit.train import state
from tiekit.train.config import Job, Outcome


def died_after_reporting(job: Job, world: int, exc: Exception) -> bool:
    """Whether a replica that died by a signal did so only on its way out: every replica wrote its
    outcome (each does before the ranks' last meeting, so the one that died had passed it) and
    none an error."""
    from torch.multiprocessing.spawn import ProcessExitedException

    assert job.result_dir is not None
    reported = all((job.result_dir / f"outcome-{rank}.json").is_file() for rank in range(world))
    failed = any(job.result_dir.glob("error-*.json"))
    return isinstance(exc, ProcessExitedException) and bool(exc.signal_name) and reported and not failed


def report(job: Job, outcome: Outcome, model: nn.Module, host_leader: bool) -> None:
    """Record a trained replica's ``outcome``, and (``host_leader``) the trained weights."""
    assert job.result_dir is not None
    if host_leader:
        # The replicas are identical; one per host writes, because on a pod slice every host's
        # caller collects from its own folder. safetensors' save_model stores a tie once and
        # records it; tiekit.load_model reads that record.
        safetensors_torch.save_model(model, str(job.result_dir / "model.safetensors"))
    _write_whole(job.result_dir / f"outcome-{outcome.rank}.json", json.dumps(dataclasses.asdict(outcome)))


def report_error(job: Job, rank: int, exc: BaseException) -> None:
    """Record the error ``exc`` a replica raised, with the time and its process id, for the caller
    (`failure` names the replica that failed first)."""
    assert job.result_dir is not None
    error = {"type": type(exc).__name__, "message": str(exc), "time": time.time(), "pid": os.getpid()}
    # Whole or not there: torch stops this process when a peer dies, maybe in the middle of the write.
    _write_whole(job.result_dir / f"error-{rank}.json", json.dumps(error))


def _write_whole(path: Path, text: str) -> None:
    """``path`` holding ``text``, whole or not there: written aside, then renamed (its reader in the
    parent may look at any moment, and this process may be stopped in the middle)."""
    partial = path.with_name("." + path.name)
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)


def collect(job: Job) -> tuple[list[Outcome], nn.Module]:
    """Every replica's `Outcome` (rank order) and the caller's model holding the trained weights."""
    assert job.result_dir is not None
    files = sorted(job.result_dir.glob("outcome-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    if not files:
        # Every replica ended without an outcome, yet without an error exit torch would report
        # (its spawn wrapper exits 0 on KeyboardInterrupt): their error files say why.
        errors = _replica_errors(job)
        if errors:
            who, kind, how = _first_failure(errors)
            raise kind(f"{who} {how}")
        raise TiekitError(f"the {job.strategy!r} replicas exited without reporting (see their output above)")
    outcomes = []
    for path in files:
        fields: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
        outcomes.append(Outcome(**values))
    if isinstance(job.model, nn.Module):
        model = job.model
    else:
        state.seed_generators(job.config.seed)
        model = job.model()
    load_model(model, job.result_dir / "model.safetensors")
    return outcomes, model


def _replica_errors(job: Job) -> dict[int, dict[str, Any]]:
    """The errors the replicas reported before they raised (their error files), the first first."""
    assert job.result_dir is not None
    found = {
        int(p.stem.split("-")[1]): json.loads(p.read_text(encoding="utf-8"))
        for p in job.result_dir.glob("error-*.json")  # each whole (see report_error)
    }
    return dict(sorted(found.items(), key=lambda item: item[1]["time"]))


def _first_failure(errors: dict[int, dict[str, Any]]) -> tuple[str, type[TiekitError], str]:
    """``replica <r> (process <pid>)``, the replica that failed first (`_replica_errors`), the class
    to raise (a tiekit error keeps its own) and ``failed: <its error> (then replica ... failed too)``.
    Replicas that all raised the same error are named together: a collective raises one error on
    every rank (its text names the rank where it began), and whichever wrote first is chance."""
    kind = _TIEKIT_ERRORS.get(next(iter(errors.values()))["type"], TiekitError)
    if len(errors) > 1 and len({_described(e) for e in errors.values()}) == 1:
        ranks = sorted(errors)
        who = f"replicas {', '.join(map(str, ranks))} (processes {', '.join(str(errors[r]['pid']) for r in ranks)})"
        return who, kind, f"all failed with: {_described(errors[ranks[0]])}"
    index, error = next(iter(errors.items()))
    later = [str(r) for r in errors if r != index]
    how = f"failed: {_described(error)}" + (f" (then replica {', '.join(later)} failed too)" if later else "")
    return f"replica {index} (process {error['pid']})", kind, how


def _described(error: dict[str, Any]) -> str:
    """``Type: message`` of a replica's error file (``Type`` alone for an empty message)."""
    return f"{error['type']}: {error['message']}" if error["message"] else str(error["type"])


def failure(job: Job, world: int, exc: Exception) -> TiekitError:
    """The error `fit` raises when one of its ``world`` spawned replicas failed (``exc``: torch's
    report, or the error reading it) and torch stopped the others: which replica, how (its
    error, the signal that killed it), and the last checkpoint. A tiekit error of the replica
    keeps its class (`CheckpointError`...).

    The replica named is the first to report an error: once one fails, the others fail in the
    broken group ("Connection closed by peer"), and torch reports whichever exit it saw first.
    A replica killed by a signal is named as torch reports it (it could not report)."""
    from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

    errors = _replica_errors(job)
    kind = TiekitError
    if isinstance(exc, ProcessException):
        index, pid = exc.error_index, getattr(exc, "error_pid", getattr(exc, "pid", "?"))  # renamed in torch 2.10
        who = f"replica {index} (process {pid})"
    else:  # torch's record of the error, cut short: it unpickles it only after stopping every replica
        index, who = -1, "a replica"
    if isinstance(exc, ProcessExitedException) and exc.signal_name:
        how = f"was killed by signal {exc.signal_name}"
        others = [f"replica {r}: {_described(e)}" for r, e in errors.items() if r != index]
        how += f" (replicas reported errors too: {'; '.join(others)})" if others else ""
    elif errors:
        who, kind, how = _first_failure(errors)
    elif isinstance(exc, ProcessExitedException):
        how = f"exited with code {exc.exit_code} without reporting an error (its output above says why)"
    elif isinstance(exc, ProcessException):  # raised before its replica ran (joining the group)
        how = "failed: see its traceback above"
    else:
        how = (
            f"failed, and the error torch recorded for it cannot be read ({type(exc).__name__}: {exc}): "
            "its file was cut short (a full disk or a file size limit?); its traceback is above"
        )
    everyone = who.startswith("replicas ") and len(errors) == world
    stopped = "" if everyone else "; the run stopped its other replicas"
    return kind(f"{who} {how}{stopped}{last_checkpoint_note(job)}")


def last_checkpoint_note(job: Job) -> str:
    """``; the last checkpoint in <folder>: <path or 'none written'>`` of a run that failed ('' without
    a checkpoint folder): where ``resume="last"`` goes on from (perhaps an earlier run's: a run
    refused at its start wrote none)."""
    folder = job.config.checkpoint_dir
    last = None if folder is None or not folder.is_dir() else state.last_checkpoint(folder)
    return "" if folder is None else f'; resume="last" would go on from: {last or "none (the folder holds none)"}'


_TIEKIT_ERRORS: dict[str, type[TiekitError]] = {e.__name__: e for e in (TiekitError, CheckpointError, TieError)}
