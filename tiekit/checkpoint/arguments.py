"""The checkpoint functions' arguments, checked before anything is read or written.

A wrong one (a model where the path goes, arguments swapped, None, a model given as the optimizer)
otherwise failed deep inside as pathlib's ``TypeError`` or an ``AttributeError`` naming neither
the function nor the argument; here it is a `CheckpointError` naming both.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from tiekit.errors import CheckpointError


def check_path(path: Any, call: str, argument: str = "path") -> None:
    """`CheckpointError` unless ``path`` is a str or ``os.PathLike``; ``call`` shows the function's
    arguments in order (``"save_model(model, path)"``)."""
    if isinstance(path, str | os.PathLike):
        return
    raise CheckpointError(f"tiekit.{call}: {argument} must be a str or os.PathLike, not {_what(path)}")


def check_model(model: Any, call: str) -> None:
    """`CheckpointError` unless ``model`` is a ``torch.nn.Module``."""
    if not isinstance(model, nn.Module):
        raise CheckpointError(f"tiekit.{call}: model must be a torch.nn.Module, not {_what(model)}")


def check_optimizer(optimizer: Any, call: str) -> None:
    """`CheckpointError` unless ``optimizer`` is None or a ``torch.optim.Optimizer``."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(
            f"tiekit.{call}: optimizer must be a torch.optim.Optimizer or None, not {_what(optimizer, swap=False)}"
        )


def _what(value: Any, *, swap: bool = True) -> str:
    """What was given, with the likely mix-up: swapped arguments give a model for the path and a
    path for the model."""
    if isinstance(value, nn.Module):
        return f"a model ({type(value).__name__})" + (": are the arguments in this order?" if swap else "")
    if isinstance(value, str | os.PathLike) and swap:
        return f"a path ({os.fspath(value)!r}): are the arguments in this order?"
    return "None" if value is None else f"a {type(value).__name__}"
