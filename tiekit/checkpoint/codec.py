"""Values beside the tensors (optimizer options, step, ``extra``) as JSON plus tensors: no pickle."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tiekit.errors import CheckpointError


def encode(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON for ``value``, its tensors moved into ``tensors`` under keys derived from ``key``."""
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach()
        return {"__tensor__": key}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{key}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{key}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value) or {"__tensor__", "__tuple__"} & set(value):
            raise CheckpointError(f"cannot store {key!r}: dict keys must be strings other than __tensor__/__tuple__")
        return {k: encode(v, f"{key}/{k}", tensors) for k, v in value.items()}
    raise CheckpointError(
        f"cannot store {key!r}: a {type(value).__name__} (tiekit stores tensors, numbers, strings, None, and "
        "lists, tuples and dicts of these; it never pickles)"
    )


def decode(value: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, list):
        return [decode(v, tensors, where) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            key = value["__tensor__"]
            if key not in tensors:
                raise CheckpointError(f"{where}: the checkpoint metadata names key {key!r}, which the file lacks")
            return tensors[key]
        if set(value) == {"__tuple__"} and isinstance(value["__tuple__"], list):
            return tuple(decode(v, tensors, where) for v in value["__tuple__"])
        return {k: decode(v, tensors, where) for k, v in value.items()}
    return value
