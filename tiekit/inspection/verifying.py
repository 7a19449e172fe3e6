"""`tiekit verify PATH module:factory`: load a checkpoint into a fresh model and check every key,
shape, dtype and tie, each as one line of a report."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn

from tiekit.analyze import count_parameters
from tiekit.checkpoint import load_model
from tiekit.errors import CheckpointError, TieError
from tiekit.inspection.files import FileReport, inspect_file
from tiekit.inspection.models import build_model, model_plan
from tiekit.inspection.text import size_text
from tiekit.plan import TieGroup, TiePlan, dtype_name
from tiekit.retie import verify


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
        f"{len(report.tensors)} tensors, {size_text(report.stored_bytes)}, ties from "
        + origin.get(report.plan_origin, "the model (no tie plan recorded)"),
    )
    try:
        before = model_plan(model)
    except TieError as exc:
        return outcome(file_check, Check("model", False, f"cannot plan {type(model).__name__}: {exc}"))
    # The dtypes the model was built with: loading casts floating-point values to them.
    built_dtypes = {name: dtype_name(t.dtype) for name, t in model.state_dict(keep_vars=True).items()}
    try:
        from tiekit.dcp import is_sharded_checkpoint, load_sharded

        sharded = is_sharded_checkpoint(path)
        result = load_sharded(model, path) if sharded else load_model(model, path, strict=True)
    except CheckpointError as exc:
        return outcome(file_check, Check("load", False, str(exc)))
    filled = f"{len(report.tensors)} stored tensors filled {len(model.state_dict())} names of {type(model).__name__}"
    cast = _casts(report, built_dtypes)
    if cast:
        loader = (
            "tiekit.load_sharded casts them to the model's dtypes"
            if sharded
            else "tiekit.load_model casts them to the model's dtypes (dtype='file' keeps the file's)"
        )
        load_check = Check("load", False, f"{where}: {cast}; the file still loads ({filled}): {loader}")
    else:
        load_check = Check("load", True, f"{filled}; no key missing or unexpected; every shape and dtype matches")
    return outcome(file_check, load_check, *_tie_checks(model, before, result.retied))


def _casts(report: FileReport, built_dtypes: dict[str, str]) -> str:
    """The stored tensors whose dtype is not the one the model was built with ("" for none).

    The load succeeded anyway, since it casts floating-point values to the model's dtypes as
    ``load_state_dict`` does (other mismatches fail it), but the model then does not hold the
    file's values exactly: a bfloat16 file in a float32 model is the usual surprise."""
    differing: dict[tuple[str, str], list[str]] = {}
    for t in report.tensors:
        built = built_dtypes.get(t.name)
        if built is not None and built != t.dtype:
            differing.setdefault((t.dtype, built), []).append(t.name)
    parts = []
    for (stored, built), keys in differing.items():
        more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
        named = ", ".join(repr(k) for k in keys[:3])
        parts.append(f"dtype mismatch for {named}{more}: the file has {stored}, the model {built}")
    return "; ".join(parts)


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
