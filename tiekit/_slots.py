"""Reading and writing a parameter or buffer slot by its dotted name."""

from __future__ import annotations

import torch
from torch import nn

from tiekit.errors import TieError
from tiekit.plan import MemberKind


def resolve(model: nn.Module, name: str, what: str = "tensor") -> tuple[nn.Module, str, torch.Tensor, MemberKind]:
    """(owning module, attribute, tensor, kind) of ``name``; `TieError` naming the path if absent."""
    module_path, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_path)
    except AttributeError as exc:
        raise TieError(f"{what} {name!r}: no module at {module_path!r} in {type(model).__name__}") from exc
    param = module._parameters.get(attr)
    if param is not None:
        return module, attr, param, "parameter"
    buffer = module._buffers.get(attr)
    if buffer is not None:
        return module, attr, buffer, "buffer"
    raise TieError(
        f"{what} {name!r}: module {module_path or '<root>'!r} ({type(module).__name__}) "
        f"has no parameter or buffer {attr!r}"
    )


def assign(module: nn.Module, attr: str, tensor: torch.Tensor, kind: MemberKind) -> None:
    """Point ``module.attr`` at ``tensor`` in the parameter or buffer table, as registered."""
    if kind == "parameter":
        if not isinstance(tensor, nn.Parameter):
            raise TieError(f"cannot register a plain tensor as parameter {attr!r} of {type(module).__name__}")
        module._parameters[attr] = tensor
    else:
        module._buffers[attr] = tensor
