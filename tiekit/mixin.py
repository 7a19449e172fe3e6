"""`TPUMixin`: ties survive every ``_apply`` conversion and ``load_state_dict(assign=True)``.

``class Net(TPUMixin, nn.Module)``: ``.to(xla)``, ``.to(dtype)``, ``.cuda()``, ``.bfloat16()``,
``.half()`` and ``.to_empty(device=...)`` all go through ``nn.Module._apply``; the mixin plans
before it, re-ties after it and verifies the parameter count, once, at the outermost module.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn

from tiekit.analyze import find_ties
from tiekit.plan import TiePlan
from tiekit.retie import retie, verify

# torch_xla.launch runs one replica per thread in a single process, so "already inside a
# tiekit conversion" must be per thread, not a module attribute or a global.
_state = threading.local()


@contextmanager
def _outermost() -> Iterator[bool]:
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield depth == 0
    finally:
        _state.depth = depth


class TPUMixin:
    """Keep tied weights tied through device moves, dtype casts, ``to_empty`` and assign-loads.

    Declare ties the model is built without (or built on meta without) as
    ``tied_weights = {"target.name": "source.name"}``; they are applied by
    ``self.tie_weights()`` and after every conversion. Detected and declared ties are merged;
    a conflict raises `tiekit.TieError`.
    """

    tied_weights: ClassVar[Mapping[str, str]] = {}

    def tie_plan(self) -> TiePlan:
        """The current plan of this module: detected ties merged with ``tied_weights``."""
        assert isinstance(self, nn.Module)
        return find_ties(self, declared=self.tied_weights)

    def tie_weights(self, *args: Any, **kwargs: Any) -> None:
        """Apply the declared ``tied_weights`` now (and a parent class's ``tie_weights``, if any)."""
        assert isinstance(self, nn.Module)
        if self.tied_weights:
            retie(self, self.tie_plan())
        parent = getattr(super(), "tie_weights", None)
        if parent is not None:
            parent(*args, **kwargs)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        with _outermost() as outermost:
            if not outermost:
                return super()._apply(fn, recurse)  # type: ignore[misc]
            plan = self.tie_plan()
            result = super()._apply(fn, recurse)  # type: ignore[misc]
            assert isinstance(self, nn.Module)
            retie(self, plan)
            verify(self, plan)
            return result

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``; with ``assign=True`` the ties are restored afterwards."""
        with _outermost() as outermost:
            if not (assign and outermost):
                return super().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]
            plan = self.tie_plan()
            result = super().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]
            assert isinstance(self, nn.Module)
            retie(self, plan)
            verify(self, plan)
            return result
