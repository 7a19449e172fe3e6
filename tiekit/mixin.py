"""`TPUMixin`: ties survive every ``_apply`` conversion and ``load_state_dict(assign=True)``.

``class Net(TPUMixin, nn.Module)``: ``.to(xla)``, ``.to(dtype)``, ``.cuda()``, ``.bfloat16()``,
``.half()`` and ``.to_empty(device=...)`` all go through ``nn.Module._apply``; the mixin plans
before it, re-ties after it and verifies the parameter count, once, at the outermost module.
``load_state_dict`` reaches every module through ``_load_from_state_dict``, wherever the load
starts; the mixin checks there and re-ties in a load_state_dict post hook.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn

from tiekit.analyze import find_ties
from tiekit.errors import TieError
from tiekit.mixin_loading import before_load, enclosing_mixin_loads, finish_interrupted_load
from tiekit.mixin_plans import confirm_kept_plan, keep_plan, kept_plan
from tiekit.mixin_plans import forget_plans as forget_plans  # documented as tiekit.mixin.forget_plans
from tiekit.moving import once_per_tensor, retied_if_interrupted
from tiekit.plan import TiePlan
from tiekit.retie import fitting_plan, retie, verify
from tiekit.sharding.check import refuse_conversion_after_first_forward

# torch_xla.launch runs one replica per thread in a single process, so "already inside a
# tiekit conversion" must be per thread, not a module attribute or a global.
_state = threading.local()


@contextmanager
def outermost_conversion() -> Iterator[bool]:
    """Yields True in the outermost of nested ``_apply`` calls of this thread: only that one
    plans and re-ties (inner calls run inside it)."""
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield depth == 0
    finally:
        _state.depth = depth


class TPUMixin:
    """Keep tied weights tied through device moves, dtype casts, ``to_empty`` and assign-loads.

    After ``load_state_dict(..., assign=True)``, of this module or of any module holding it (a
    container, ``torch.compile``), each tie holds the tensor the state dict gives under its
    source's name, or else under a name tied to the source by identity; the tied names it
    leaves out (a de-duplicated file) follow that tensor, its values and dtype. Names of one tie
    whose entries differ (dtype, shape, values), a view given without its source, and a source
    given non-contiguous where the tie has views, are refused with a `TieError` before anything
    of this module is loaded.

    Declare ties the model is built without (or built on meta without) as
    ``tied_weights = {"target.name": "source.name"}``; they are applied by
    ``self.tie_weights()`` and after every conversion. Detected and declared ties are merged;
    a conflict raises `tiekit.TieError`. A mixin model holding other mixin models applies their
    ``tied_weights`` too (where two declare one target, the outer's holds): only the outermost
    plans a conversion.
    """

    tied_weights: ClassVar[Mapping[str, str]] = {}

    def tie_plan(self) -> TiePlan:
        """The current plan of this module: detected ties merged with ``tied_weights``.

        Kept between conversions while nothing registered in this model changes (a parameter,
        buffer or submodule) and the model still holds the plan's ties (`tiekit.retie.still_holds`:
        a source given new memory with ``w.data = ...`` has no views any more); code that writes
        into ``module._parameters`` or ``module._modules`` directly (``ModuleList.insert``), or
        makes tensors share memory with ``.data =``, should call ``tie_plan`` only after
        ``tiekit.mixin.forget_plans()`` (`tiekit.mixin_plans`).
        """
        assert isinstance(self, nn.Module)
        finish_interrupted_load(self)  # a load left half done: its plan still knows the ties
        plan = kept_plan(self, self.tied_weights)
        if plan is None:
            plan = find_ties(self, declared=declared_in_mixins(self))
            keep_plan(self, plan, self.tied_weights)
        return plan

    def tie_weights(self, *args: Any, **kwargs: Any) -> None:
        """Apply the declared ``tied_weights`` now (and a parent class's ``tie_weights``, if any)."""
        assert isinstance(self, nn.Module)
        if declared_in_mixins(self):
            retie(self, self.tie_plan())
        parent = getattr(super(), "tie_weights", None)
        if parent is not None:
            parent(*args, **kwargs)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        with outermost_conversion() as outermost:
            if not outermost:
                return super()._apply(fn, recurse)  # type: ignore[misc]
            assert isinstance(self, nn.Module)
            plan = fitting_plan(self, self.tie_plan())  # refused before anything converts
            refuse_conversion_after_first_forward(self, fn)  # an FSDP2 dtype fixed at its first forward
            with retied_if_interrupted(self, plan):
                result = super()._apply(once_per_tensor(fn), recurse)  # type: ignore[misc]
            assert isinstance(self, nn.Module)
            retie(self, plan)
            verify(self, plan)
            confirm_kept_plan(self)  # new tensors, the same ties: a plan made now could miss XLA's views
            return result

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, the ties restored also when it raises half way (see the
        class docstring; a load through a container is restored at the next load or move)."""
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]
        except BaseException:
            assert isinstance(self, nn.Module)
            finish_interrupted_load(self)
            raise

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """torch's per-module load step, which runs however the load reaches this module (its own
        ``load_state_dict``, or a container's: ``nn.Sequential``, ``torch.compile``, DDP).

        Before torch loads anything of this module's subtree, an assign-load is checked
        (`tiekit.mixin_loading.before_load`); a load_state_dict post hook restores the ties once
        the subtree is loaded and takes the tied names the load filled out of the missing keys,
        before torch's strict check.
        """
        assert isinstance(self, nn.Module)
        if not enclosing_mixin_loads(missing_keys):
            assign = bool(local_metadata.get("assign_to_params_buffers", False))
            before_load(self, self.tie_plan(), state_dict, prefix, missing_keys, assign=assign)
        super()._load_from_state_dict(  # type: ignore[misc]
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


def declared_in_mixins(model: nn.Module) -> dict[str, str]:
    """The ``tied_weights`` of ``model`` and of every `TPUMixin` inside it, named from ``model``;
    where two declare one target, the outer's holds. Names that are no strings pass as they are,
    for `find_ties` to refuse."""
    declared: dict[Any, Any] = {}
    seen: set[int] = set()
    # named_modules' order (pre-order, a module met twice counted once), walked by hand: about
    # 0.2 ms for 500 modules where named_modules took 0.3 (a plan is made often: every tie_weights).
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        path, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if isinstance(module, TPUMixin) and module.tied_weights:
            prefix = f"{path}." if path else ""
            for target, source in tied_weights_of(module).items():
                declared.setdefault(_named(prefix, target), _named(prefix, source))
        if module._modules:
            children = reversed(module._modules.items())
            stack.extend((f"{path}.{name}" if path else name, child) for name, child in children if child is not None)
    return declared


def mixin_ties_outside(model: nn.Module, plan: TiePlan) -> list[tuple[str, str]]:
    """The ``(target, source)`` ties the `TPUMixin` ``tied_weights`` in ``model`` declare
    (`declared_in_mixins`) that ``plan`` does not tie: a plan given to a move, or a save's plan of
    a model that never applied them. Local."""
    return [
        (target, source)
        for target, source in declared_in_mixins(model).items()
        if isinstance(target, str) and isinstance(source, str) and plan.source_of(target) != plan.source_of(source)
    ]


def tied_weights_of(module: TPUMixin) -> Mapping[str, str]:
    """``module.tied_weights``; `TieError` naming its class unless it is a mapping (a list of pairs)."""
    declared = module.tied_weights
    if not isinstance(declared, Mapping):
        raise TieError(
            f"{type(module).__name__}.tied_weights maps tied names to their sources ({{target: source}}), "
            f"not a {type(declared).__name__}"
        )
    return declared


def _named(prefix: str, name: object) -> object:
    return prefix + name if isinstance(name, str) else name
