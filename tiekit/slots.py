"""Parameter and buffer slots: the one walk over a model's slots, and reading and writing a slot
by its dotted name."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

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


def has_module(model: nn.Module, path: str) -> bool:
    """Whether ``model`` has a submodule at the dotted ``path`` ("" is the model itself)."""
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def assign(module: nn.Module, attr: str, tensor: torch.Tensor, kind: MemberKind) -> None:
    """Point ``module.attr`` at ``tensor`` in the parameter or buffer table, as registered (and
    out of the other one: torch's ``load_state_dict(assign=True)`` moves a buffer holding a
    Parameter into the parameters, as attribute assignment of a Parameter does)."""
    if kind == "parameter":
        if not isinstance(tensor, nn.Parameter):
            raise TieError(f"cannot register a plain tensor as parameter {attr!r} of {type(module).__name__}")
        module._buffers.pop(attr, None)
        module._parameters[attr] = tensor
    else:
        module._parameters.pop(attr, None)
        module._buffers[attr] = tensor


@dataclass
class Walk:
    """Every (name, tensor) of a model in registration order, as parallel lists.

    Identity is settled afterwards by sorting ids (`identities`), not by a dict looked up per
    name: tensors are allocated in about the order they are registered, so the ids come nearly
    sorted and timsort reads them in one sequential sweep, where a hash table of 100,000 ids
    misses the cache on every probe and makes the walk grow faster than the model. Full names
    are joined only for the few tensors that end up in a group.
    """

    tensors: list[torch.Tensor] = field(default_factory=list)
    prefixes: list[str] = field(default_factory=list)
    attrs: list[str] = field(default_factory=list)
    kinds: list[MemberKind] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)

    def name(self, i: int) -> str:
        """The dotted name of slot ``i``."""
        return self.prefixes[i] + self.attrs[i]


def checked_module(model: object, where: str = "") -> nn.Module:
    """``model`` if it is an ``nn.Module``; `TieError` naming ``where`` (a function) otherwise."""
    if not isinstance(model, nn.Module):
        raise TieError(f"{where + ': ' if where else ''}expected a torch.nn.Module, got {type(model).__name__}")
    return model


def walk_slots(model: nn.Module, *, buffers: bool = True) -> Walk:
    """Every parameter (and buffer) slot of ``model`` in registration order, the order of
    ``named_modules(remove_duplicate=False)``; `TieError` on a cyclic or too deep module graph."""
    checked_module(model)
    # One pre-order walk in registration order, the order of named_modules(remove_duplicate=False),
    # on an explicit stack: nested generators cost a frame switch per level for every module.
    walk = Walk()
    tensors, prefixes, attrs, kinds, owners = walk.tensors, walk.prefixes, walk.attrs, walk.kinds, walk.modules
    limit = sys.getrecursionlimit()
    stack: list[tuple[str, nn.Module, int]] = [("", model, 0)]
    pop = stack.pop
    while stack:
        dot, module, depth = pop()
        for attr, t in module._parameters.items():
            if t is not None:
                tensors.append(t)
                prefixes.append(dot)
                attrs.append(attr)
                kinds.append("parameter")
                owners.append(module)
        if buffers and module._buffers:
            for attr, buf in module._buffers.items():
                if buf is not None:
                    tensors.append(buf)
                    prefixes.append(dot)
                    attrs.append(attr)
                    kinds.append("buffer")
                    owners.append(module)
        children = module._modules
        if children:
            if depth >= limit:
                raise TieError(
                    f"cannot walk {type(model).__name__}: its module graph has a cycle or is deeper "
                    f"than {limit} levels (at {dot[:200].rstrip('.')!r}...)"
                )
            stack.extend([(dot + name + ".", m, depth + 1) for name, m in reversed(children.items()) if m is not None])
    return walk


def slot_table(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor, MemberKind]]:
    """``{name: (owning module, attribute, tensor, kind)}`` of every parameter and buffer slot."""
    w = walk_slots(model)
    return {
        w.prefixes[i] + w.attrs[i]: (w.modules[i], w.attrs[i], w.tensors[i], w.kinds[i]) for i in range(len(w.tensors))
    }
