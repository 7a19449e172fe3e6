"""`tiekit inspect module:factory`: build a model from its factory (on the meta device when the
factory allows it, so no weights are allocated) and describe its ties and sizes."""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiekit.analyze import find_ties
from tiekit.checkpoint import declared_ties
from tiekit.errors import TiekitError
from tiekit.inspection.text import one_line, size_text, tied_bytes
from tiekit.plan import TiePlan
from tiekit.slots import walk_slots

# module.path:attribute.path, both made of identifiers
FACTORY_PATTERN = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
FACTORY_HINT = (
    "a factory is 'module:function' (e.g. examples.tied_lm:build), importable from the current "
    "directory, called with no arguments, returning an nn.Module"
)


class TargetError(TiekitError):
    """``tiekit inspect`` was given something that is neither an existing path nor ``module:factory``."""

    hint = (
        "TARGET is a .safetensors file, a *.safetensors.index.json, a folder holding one, a tiekit.save_sharded "
        "folder or a plain torch.distributed.checkpoint one, or module:factory"
    )


class FactoryError(TiekitError):
    """``module:factory`` could not be imported, called, or did not return an ``nn.Module``."""

    hint = FACTORY_HINT


def is_factory_spec(text: str) -> bool:
    """True when ``text`` reads as ``module:factory`` and names no existing file or folder."""
    return FACTORY_PATTERN.fullmatch(text) is not None and not os.path.exists(text)


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
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # any error in the user's module is reported, not a crash
        raise FactoryError(f"importing {module_name!r} failed: {one_line(exc)}{_exited(exc)}") from exc
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
    if not isinstance(spec, str):
        raise FactoryError(
            f"a model is named by a 'module:factory' string, not given as a {type(spec).__name__} "
            "(for a model you hold, tiekit.find_ties(model))"
        )
    factory = load_factory(spec)
    note = ""
    if meta:
        try:
            with torch.device("meta"):
                model = factory()
            return BuiltModel(_module(model, spec), spec, "meta")
        except (FactoryError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the factory does on meta, retry as written
            note = f"the factory failed on the meta device ({one_line(exc)}), so it was built on the CPU"
        except BaseException as exc:  # sys.exit, argparse reading tiekit's command line, a user's abort: no retry
            raise FactoryError(f"{spec}() failed: {one_line(exc)}{_exited(exc)}") from exc
    try:
        model = factory()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the user's factory, whatever it raises: report it in one line
        raise FactoryError(f"{spec}() failed: {one_line(exc)}{_exited(exc)}") from exc
    return BuiltModel(_module(model, spec), spec, "cpu", note)


def _exited(exc: BaseException) -> str:
    """What a factory that exited the process (``sys.exit``, argparse) did, told apart from tiekit's own exit."""
    if not isinstance(exc, SystemExit):
        return ""
    return " (it exited, as sys.exit and argparse do: a factory must build the model without reading the command line)"


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
            f"tensors: {size_text(self.unique_bytes)} unique, {size_text(self.saved_bytes)} saved by tying "
            "(parameters and buffers)"
        )
        return "\n".join(lines)


def inspect_model(spec: str) -> ModelReport:
    """Build the model of ``spec`` (on meta when possible) and describe its ties and sizes."""
    built = build_model(spec)
    plan = model_plan(built.model)
    unique = {id(t): t for t in walk_slots(built.model).tensors}
    unique_bytes = sum(_tensor_bytes(t) for t in unique.values())
    return ModelReport(built, plan, unique_bytes, tied_bytes(plan.groups))


def _tensor_bytes(t: torch.Tensor) -> int:
    try:
        return t.numel() * t.element_size()
    except (RuntimeError, ValueError):  # an uninitialised lazy parameter has no size yet
        return 0
