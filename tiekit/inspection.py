"""What the ``tiekit`` command reports: a checkpoint's ties and sizes, a model's plan, a load check.

Reading a checkpoint here never loads its tensors: the header (or the index and the shards'
headers) says every name, dtype, shape and byte range, and the tie plan tiekit wrote there
says which names were stored once. Building a model from ``module:factory`` happens on the
meta device when the factory allows it, so inspecting a large model allocates no weights.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiekit.analyze import count_parameters, dtype_name, find_ties
from tiekit.checkpoint import PLAN_KEY, SAVE_ID_KEY, STATE_KEY, declared_ties, load_model, open_source
from tiekit.errors import CheckpointError, TieError, TiekitError
from tiekit.plan import TieGroup, TiePlan
from tiekit.retie import verify
from tiekit.slots import walk_slots

# module.path:attribute.path, both made of identifiers
FACTORY_PATTERN = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
FACTORY_HINT = (
    "a factory is 'module:function' (e.g. examples.tied_lm:build), importable from the current "
    "directory, called with no arguments, returning an nn.Module"
)
_HIDDEN_METADATA = {PLAN_KEY, STATE_KEY, SAVE_ID_KEY, "format", "total_size"}


class TargetError(TiekitError):
    """``tiekit inspect`` was given something that is neither an existing path nor ``module:factory``."""

    hint = "TARGET is a .safetensors file, a *.safetensors.index.json, a folder holding one, or module:factory"


class FactoryError(TiekitError):
    """``module:factory`` could not be imported, called, or did not return an ``nn.Module``."""

    hint = FACTORY_HINT


def is_factory_spec(text: str) -> bool:
    """True when ``text`` reads as ``module:factory`` and names no existing file or folder."""
    return FACTORY_PATTERN.fullmatch(text) is not None and not os.path.exists(text)


# -- checkpoints on disk ------------------------------------------------------------------


@dataclass(frozen=True)
class StoredTensor:
    """One tensor a checkpoint holds, as its header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str


@dataclass(frozen=True)
class FileReport:
    """A checkpoint's contents as far as its headers tell: tensors, ties, sizes, versions.

    ``plan_origin`` is ``"tiekit"`` (a tie plan is recorded), ``"safetensors"`` (only the
    ``removed -> kept`` names ``safetensors.torch.save_model`` writes) or ``"none"``.
    ``identical`` lists groups of stored tensors with byte-identical data (filled only when
    asked for, since it reads the data): candidates for ties that were stored twice.
    """

    path: str
    files: tuple[str, ...]
    tensors: tuple[StoredTensor, ...]
    side_tensors: int
    side_bytes: int
    plan: TiePlan | None
    plan_origin: str
    plan_version: int | None
    checkpoint_version: int | None
    metadata: Mapping[str, str]
    identical: tuple[tuple[str, ...], ...] | None = None

    @property
    def stored_bytes(self) -> int:
        """Bytes of the model tensors in the file (optimizer state excluded)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def tied_names(self) -> tuple[str, ...]:
        """Names the file covers without storing them: tied names and views of stored tensors."""
        return () if self.plan is None else self.plan.tied_names

    @property
    def saved_bytes(self) -> int:
        """Bytes the file would need more if every tied name were stored as its own tensor."""
        if self.plan is None:
            return 0
        return _tied_bytes(self.plan.groups)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (``tiekit inspect --json``)."""
        return {
            "path": self.path,
            "files": list(self.files),
            "plan_origin": self.plan_origin,
            "plan_version": self.plan_version,
            "checkpoint_version": self.checkpoint_version,
            "stored_tensors": len(self.tensors),
            "names": len(self.tensors) + len(self.tied_names),
            "stored_bytes": self.stored_bytes,
            "saved_bytes": self.saved_bytes,
            "optimizer_tensors": self.side_tensors,
            "optimizer_bytes": self.side_bytes,
            "plan": None if self.plan is None else self.plan.to_dict(),
            "metadata": dict(self.metadata),
            "identical": None if self.identical is None else [list(g) for g in self.identical],
            "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes, "file": t.file}
                for t in self.tensors
            ],
        }

    def render(self, *, tensors: bool = False) -> str:
        """The human-readable report (``tiekit inspect PATH``)."""
        shards = f"{len(self.files)} shard files" if len(self.files) > 1 else "1 file"
        lines = [f"{self.path}: {shards}, {_size(self.stored_bytes + self.side_bytes)} of tensors"]
        if self.plan_origin == "tiekit":
            assert self.plan is not None
            lines.append(f"  tie plan: recorded by tiekit (plan format v{self.plan_version})")
        elif self.plan_origin == "safetensors":
            lines.append("  tie plan: none recorded; safetensors.save_model listed the duplicates it dropped")
        else:
            lines.append("  tie plan: none recorded (a plain safetensors / Hugging Face file)")
        names = len(self.tensors) + len(self.tied_names)
        lines.append(f"  tensors: {len(self.tensors)} stored for {names} names (unique vs total)")
        lines.append(
            f"  bytes: {_size(self.stored_bytes)} stored, {_size(self.saved_bytes)} saved by de-duplication"
            + (f" ({100 * self.saved_bytes / (self.stored_bytes + self.saved_bytes):.1f}%)" if self.saved_bytes else "")
        )
        if self.checkpoint_version is not None:
            lines.append(
                f"  training checkpoint (format v{self.checkpoint_version}): {self.side_tensors} optimizer/extra "
                f"tensors, {_size(self.side_bytes)}"
            )
        dtypes: dict[str, int] = {}
        for t in self.tensors:
            dtypes[t.dtype] = dtypes.get(t.dtype, 0) + 1
        lines.append("  dtypes: " + ", ".join(f"{d} x{n}" for d, n in sorted(dtypes.items())))
        if self.plan is not None and self.plan.groups:
            lines.append("  tie groups (stored once, under the source name):")
            lines.extend("  " + line for line in _group_table(self.plan.groups))
        elif self.plan_origin == "none":
            lines.append("  storage sharing is not visible in a file: every stored tensor has its own bytes;")
            lines.append(
                "  --check-values finds byte-identical tensors, `tiekit inspect module:factory` the model's ties"
            )
        if self.identical is not None:
            if self.identical:
                lines.append("  byte-identical stored tensors (ties stored twice?), constant tensors left out:")
                lines.extend("    " + ", ".join(g) for g in self.identical)
            else:
                lines.append("  byte-identical stored tensors: none (constant tensors left out)")
        if self.metadata:
            lines.append("  metadata: " + ", ".join(f"{k}={_short(v)}" for k, v in sorted(self.metadata.items())))
        if tensors:
            lines.append("  stored tensors:")
            width = max(len(t.name) for t in self.tensors) if self.tensors else 0
            for t in self.tensors:
                shape = "x".join(map(str, t.shape)) or "scalar"
                lines.append(f"    {t.name.ljust(width)}  {t.dtype:<9} {shape:<12} {_size(t.nbytes)}")
        return "\n".join(lines)


def inspect_file(path: str | os.PathLike[str], *, check_values: bool = False) -> FileReport:
    """Describe the checkpoint at ``path`` (a file, an index, a folder, or a `tiekit.save_sharded`
    folder) from its headers (DCP's metadata for a sharded folder).

    ``check_values`` also reads the data of tensors that share a dtype and shape and reports the
    byte-identical ones. Raises `CheckpointError` naming the file for anything unreadable.
    """
    from tiekit.dcp import is_sharded_checkpoint

    if is_sharded_checkpoint(path):  # a save_sharded folder: its marker and DCP's metadata
        from tiekit.dcp.report import inspect_sharded

        return inspect_sharded(path, check_values=check_values)
    source = open_source(path)
    tensors = tuple(
        StoredTensor(name, dtype_name(entry.dtype), entry.shape, entry.end - entry.start, file)
        for name, (file, entry) in source.entries.items()
    )
    files = tuple(dict.fromkeys(file for file, _ in [*source.entries.values(), *source.side.values()]))
    plan_version = _version(source.metadata.get(PLAN_KEY), source.where, PLAN_KEY)
    checkpoint_version = _version(source.metadata.get(STATE_KEY), source.where, STATE_KEY)
    shown = {k: v for k, v in source.metadata.items() if k not in _HIDDEN_METADATA and isinstance(v, str)}
    if source.plan_origin == "safetensors":
        # Those entries are what the plan was rebuilt from; keep them out of "metadata".
        assert source.plan is not None
        shown = {k: v for k, v in shown.items() if k not in source.plan}
    identical = _identical(source.entries) if check_values else None
    return FileReport(
        path=source.where,
        files=files,
        tensors=tensors,
        side_tensors=len(source.side),
        side_bytes=sum(e.end - e.start for _, e in source.side.values()),
        plan=source.plan,
        plan_origin="none" if source.plan is None else source.plan_origin,
        plan_version=plan_version,
        checkpoint_version=checkpoint_version,
        metadata=shown,
        identical=identical,
    )


def _version(raw: Any, where: str, key: str) -> int | None:
    if raw is None:
        return None
    try:
        data = json.loads(raw) if isinstance(raw, str) else raw
        version = data["version"]
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"{where}: corrupted {key!r} metadata: no version ({exc})") from exc
    if not isinstance(version, int):
        raise CheckpointError(f"{where}: corrupted {key!r} metadata: version {version!r} is not an integer")
    return version


def _identical(entries: Mapping[str, Any]) -> tuple[tuple[str, ...], ...]:
    # Only tensors of one dtype and shape can be copies of one another: hash just those.
    # Constant tensors (zero biases, fresh LayerNorm weights) are equal by construction, not
    # by a tie stored twice, and are left out, as `find_ties(check_values=True)` does.
    buckets: dict[tuple[Any, ...], list[str]] = {}
    for name, (_, entry) in entries.items():
        if entry.end - entry.start > entry.dtype.itemsize:
            buckets.setdefault((entry.dtype, entry.shape), []).append(name)
    found: list[tuple[str, ...]] = []
    for names in buckets.values():
        if len(names) < 2:
            continue
        by_digest: dict[bytes, list[str]] = {}
        for name in names:
            file, entry = entries[name]
            digest = _digest(file, entry.start, entry.end, entry.dtype.itemsize)
            if digest is not None:
                by_digest.setdefault(digest, []).append(name)
        found.extend(tuple(same) for same in by_digest.values() if len(same) > 1)
    return tuple(sorted(found))


def _digest(file: str, start: int, end: int, itemsize: int) -> bytes | None:
    """Hash of the bytes in ``[start, end)``; None when every element is the same."""
    digest = hashlib.blake2b(digest_size=16)
    first = b""
    constant = True
    try:
        with open(file, "rb") as f:
            f.seek(start)
            left = end - start
            while left:
                chunk = f.read(min(left, 1 << 24))  # a multiple of every itemsize
                if not chunk:
                    raise CheckpointError(f"{file}: truncated while reading tensor data")
                first = first or chunk[:itemsize]
                constant = constant and chunk == first * (len(chunk) // itemsize)
                digest.update(chunk)
                left -= len(chunk)
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read: {exc.strerror or exc}") from exc
    return None if constant else digest.digest()


# -- models from module:factory -----------------------------------------------------------


@dataclass(frozen=True)
class BuiltModel:
    """A model made by a factory, where it was built, and why if not on meta."""

    model: nn.Module
    spec: str
    device: str
    note: str = ""


def load_factory(spec: str) -> Callable[[], Any]:
    """Import ``module:attribute`` (the current directory first on ``sys.path``) and return it."""
    if FACTORY_PATTERN.fullmatch(spec) is None:
        raise FactoryError(f"{spec!r} is not module:factory")
    module_name, _, attr_path = spec.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise FactoryError(f"cannot import {module_name!r} (from {cwd} or sys.path): {exc}") from exc
    except Exception as exc:  # any error in the user's module is reported, not a crash
        raise FactoryError(f"importing {module_name!r} failed: {_one_line(exc)}") from exc
    target: Any = module
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise FactoryError(f"{module_name!r} has no attribute {attr_path!r}") from exc
    if not callable(target):
        raise FactoryError(f"{spec} is a {type(target).__name__}, not a callable factory")
    return target  # type: ignore[no-any-return]


def build_model(spec: str, *, meta: bool = True) -> BuiltModel:
    """Call the factory named by ``spec``: on the meta device first (no weights allocated), on the
    CPU if that fails. Raises `FactoryError` if it cannot be built or is not an ``nn.Module``."""
    factory = load_factory(spec)
    note = ""
    if meta:
        try:
            with torch.device("meta"):
                model = factory()
            return BuiltModel(_module(model, spec), spec, "meta")
        except FactoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the factory does on meta, retry as written
            note = f"the factory failed on the meta device ({_one_line(exc)}), so it was built on the CPU"
    try:
        model = factory()
    except Exception as exc:  # the user's factory: report it in one line
        raise FactoryError(f"{spec}() failed: {_one_line(exc)}") from exc
    return BuiltModel(_module(model, spec), spec, "cpu", note)


def _module(value: Any, spec: str) -> nn.Module:
    if not isinstance(value, nn.Module):
        raise FactoryError(f"{spec}() returned a {type(value).__name__}, not an nn.Module")
    return value


def model_plan(model: nn.Module) -> TiePlan:
    """The plan tiekit saves and loads with: detected ties plus declared ones (``tied_weights``,
    transformers' ``_tied_weights_keys``) that hold in memory."""
    return find_ties(model, declared=declared_ties(model) or None)


@dataclass(frozen=True)
class ModelReport:
    """A model's plan and sizes (``tiekit inspect module:factory``)."""

    built: BuiltModel
    plan: TiePlan
    unique_bytes: int
    saved_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (``tiekit inspect module:factory --json``)."""
        return {
            "factory": self.built.spec,
            "model": type(self.built.model).__name__,
            "device": self.built.device,
            "note": self.built.note,
            "unique_parameters": self.plan.unique_count,
            "parameter_names": self.plan.total_count,
            "unique_bytes": self.unique_bytes,
            "saved_bytes": self.saved_bytes,
            "plan": self.plan.to_dict(),
        }

    def render(self) -> str:
        """The human-readable report."""
        where = "on meta (no memory allocated)" if self.built.device == "meta" else "on the CPU"
        lines = [f"{self.built.spec} -> {type(self.built.model).__name__}, built {where}"]
        if self.built.note:
            lines.append(f"note: {self.built.note}")
        lines.append(str(self.plan))
        lines.append(
            f"tensors: {_size(self.unique_bytes)} unique, {_size(self.saved_bytes)} saved by tying "
            "(parameters and buffers)"
        )
        return "\n".join(lines)


def inspect_model(spec: str) -> ModelReport:
    """Build the model of ``spec`` (on meta when possible) and describe its ties and sizes."""
    built = build_model(spec)
    plan = model_plan(built.model)
    unique = {id(t): t for t in walk_slots(built.model).tensors}
    unique_bytes = sum(_tensor_bytes(t) for t in unique.values())
    return ModelReport(built, plan, unique_bytes, _tied_bytes(plan.groups))


def _tensor_bytes(t: torch.Tensor) -> int:
    try:
        return t.numel() * t.element_size()
    except (RuntimeError, ValueError):  # an uninitialised lazy parameter has no size yet
        return 0


# -- loading a checkpoint into a fresh model ------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One line of `tiekit verify`'s report."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class VerifyOutcome:
    """Every check of `verify_checkpoint`; ``ok`` when all passed."""

    path: str
    spec: str
    model: str
    device: str
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        """True when every check passed."""
        return all(c.ok for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready report (``tiekit verify --json``)."""
        return {
            "path": self.path,
            "factory": self.spec,
            "model": self.model,
            "built_on": self.device,
            "ok": self.ok,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
        }

    def render(self) -> str:
        """The human-readable report, one line per check and a verdict."""
        lines = [f"tiekit verify: {self.path} into {self.spec} ({self.model}, built on {self.device})"]
        lines.extend(f"  {'ok  ' if c.ok else 'FAIL'}  {c.name}: {c.detail}" for c in self.checks)
        failed = sum(not c.ok for c in self.checks)
        lines.append("PASSED" if self.ok else f"FAILED: {failed} of {len(self.checks)} check(s)")
        return "\n".join(lines)


def verify_checkpoint(path: str | os.PathLike[str], spec: str) -> VerifyOutcome:
    """Load ``path`` into a fresh model from ``spec`` and check every key, shape, dtype and tie.

    Problems with the file or the load are failed checks, not exceptions; an unusable factory
    raises `FactoryError`.
    """
    built = build_model(spec)
    model = built.model
    where = os.fspath(path)

    def outcome(*checks: Check) -> VerifyOutcome:
        return VerifyOutcome(where, spec, type(model).__name__, built.device, checks)

    try:
        report = inspect_file(path)
    except CheckpointError as exc:
        return outcome(Check("file", False, str(exc)))
    where = report.path
    origin = {"tiekit": f"tie plan v{report.plan_version}", "safetensors": "safetensors' duplicate list"}
    file_check = Check(
        "file",
        True,
        f"{len(report.tensors)} tensors, {_size(report.stored_bytes)}, ties from "
        + origin.get(report.plan_origin, "the model (no tie plan recorded)"),
    )
    try:
        before = model_plan(model)
    except TieError as exc:
        return outcome(file_check, Check("model", False, f"cannot plan {type(model).__name__}: {exc}"))
    try:
        from tiekit.dcp import is_sharded_checkpoint, load_sharded

        result = load_sharded(model, path) if is_sharded_checkpoint(path) else load_model(model, path, strict=True)
    except CheckpointError as exc:
        return outcome(file_check, Check("load", False, str(exc)))
    names = len(model.state_dict())
    load_check = Check(
        "load",
        True,
        f"{len(report.tensors)} stored tensors filled {names} names of {type(model).__name__}; "
        "no key missing or unexpected; every shape and dtype matches",
    )
    return outcome(file_check, load_check, *_tie_checks(model, before, result.retied))


def _tie_checks(model: nn.Module, before: TiePlan, retied: tuple[TieGroup, ...]) -> list[Check]:
    checks = []
    applied = TiePlan(tuple(retied), count_parameters(model), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        file_ties = verify(model, applied, on_error="warn")
        model_ties = verify(model, before, on_error="warn")
    broken = list(dict.fromkeys([*file_ties.broken, *model_ties.broken]))
    groups = list({frozenset(g.names): g for g in [*before.groups, *retied]}.values())
    if broken:
        checks.append(Check("ties", False, "; ".join(broken)))
    elif not groups:
        checks.append(Check("ties", True, "none: the file records no tie and the model has none"))
    else:
        shown = "; ".join(f"{', '.join(g.names[1:])} -> {g.source}" for g in groups[:4])
        more = f" and {len(groups) - 4} more" if len(groups) > 4 else ""
        checks.append(Check("ties", True, f"{len(groups)} group(s) hold ({shown}{more})"))
    after = count_parameters(model)
    if after == before.unique_count:
        checks.append(
            Check("parameters", True, f"{after} unique under {before.total_count} names, as the model was built")
        )
    else:
        extra = sorted({frozenset(g.names) for g in retied} - {frozenset(g.names) for g in before.groups}, key=sorted)
        why = "; ".join(f"the file ties {', '.join(sorted(g))}" for g in extra) or "the ties differ"
        checks.append(
            Check(
                "parameters",
                False,
                f"{type(model).__name__} was built with {before.unique_count} unique parameters, "
                f"{after} after loading: {why}, the model as built does not",
            )
        )
    return checks


# -- formatting ---------------------------------------------------------------------------


def _group_table(groups: tuple[TieGroup, ...]) -> list[str]:
    # The plan's own table, without its summary line (the report has its own).
    return str(TiePlan(groups, 0, 0)).splitlines()[1:]


def _tied_bytes(groups: tuple[TieGroup, ...]) -> int:
    """Bytes of every non-source member: what storing each tied name separately would add."""
    total = 0
    for group in groups:
        itemsize = getattr(torch, group.dtype).itemsize
        for member in group.members[1:]:
            total += math.prod(group.shape if member.view is None else member.view.size) * itemsize
    return total


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover - the loop always returns


def _short(value: str, limit: int = 60) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
