"""accelerate: ``prepare_tied`` is ``accelerator.prepare`` for models with tied weights.

``accelerator.prepare(model)`` moves the model with ``model.to(accelerator.device)``; on an XLA
device that gives every tied name its own copy (accelerate's TPU guide asks you to call
``model.tie_weights()`` afterwards, which only transformers models have and which knows no
buffers or views). ``prepare_tied`` moves the model itself first, keeping ties
(`tiekit.move`), so that ``prepare``'s own move changes nothing and a DDP wrapper is built over
the tied parameters; then it re-ties and verifies the unwrapped model once more. Optimizers
passed along (built before the move) are re-bound to the moved parameters by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tiekit.declared_groups import checked_declared
from tiekit.errors import TiekitError
from tiekit.moving import move, moving_plan, rebind_optimizer
from tiekit.retie import OnError, checked_on_error, retie, verify

__all__ = ["prepare_tied"]

# Strategies that shard or place parameters themselves: accelerate does not call `.to` for them.
_SELF_PLACING = {"FSDP", "DEEPSPEED", "MEGATRON_LM"}


def prepare_tied(
    accelerator: Any,
    model: nn.Module,
    *objects: Any,
    declared: Mapping[str, str] | None = None,
    on_error: OnError = "raise",
) -> Any:
    """``accelerator.prepare(model, *objects)``, with the model's ties kept and verified.

    Returns what ``prepare`` returns: the prepared model alone, or a tuple with the prepared
    ``objects`` in order. Call it before building the optimizer, or pass the optimizer in
    ``objects``. The ties are planned as `tiekit.move` plans them: those the model holds, and
    those it (or a submodule) declares whose tensors are equal in value (a tie a plain ``.to``
    broke), which are tied again. ``declared`` adds ``{target: source}`` ties the model declares
    but does not hold yet. A tie that cannot be restored raises `tiekit.TieError` (a `tiekit.TieWarning`
    with ``on_error="warn"``). Arguments of the wrong kind are a `tiekit.TiekitError`, raised
    before anything moves.
    """
    _refuse_bad_arguments(accelerator, model, declared)
    checked_on_error(on_error, "prepare_tied")
    # The plan names tensors as the model prepare hands back unwrapped: without a torch.compile
    # wrapper, whose names carry "_orig_mod." (a model compiled before prepare).
    base = accelerator.unwrap_model(model, keep_torch_compile=False)
    if base is not model and declared:
        declared = {_unprefixed(t): _unprefixed(s) for t, s in declared.items()}
    # As tiekit.move plans: a tie the model declares and a plain .to broke (equal copies) is tied again.
    plan = moving_plan(base, declared)
    if accelerator.device_placement and accelerator.distributed_type.name not in _SELF_PLACING:
        names = {id(p): n for n, p in base.named_parameters()}
        move(base, accelerator.device, plan=plan, on_error=on_error)
        for optimizer in objects:
            if isinstance(optimizer, torch.optim.Optimizer):
                rebind_optimizer(optimizer, base, names)
    prepared = accelerator.prepare(model, *objects)
    inner = accelerator.unwrap_model(prepared[0] if objects else prepared, keep_torch_compile=False)
    retie(inner, plan)
    verify(inner, plan, on_error=on_error)
    return prepared


def _refuse_bad_arguments(accelerator: Any, model: Any, declared: Any) -> None:
    """`TiekitError` naming the argument of the wrong kind (accelerate's and torch's own errors,
    an AttributeError deep inside, name neither)."""
    # What prepare_tied uses of it: an object standing in for an Accelerator (a proxy) will do.
    used = ("prepare", "unwrap_model", "device", "device_placement", "distributed_type")
    if not all(hasattr(accelerator, name) for name in used):
        swapped = " (the accelerator comes first: prepare_tied(accelerator, model, *objects))"
        raise TiekitError(
            f"prepare_tied: accelerator must be an accelerate.Accelerator, not a {type(accelerator).__name__}"
            + (swapped if isinstance(accelerator, nn.Module) else "")
        )
    if not isinstance(model, nn.Module):
        raise TiekitError(f"prepare_tied: model must be a torch.nn.Module, not a {type(model).__name__}")
    checked_declared(declared, "prepare_tied")


def _unprefixed(name: str) -> str:
    return name.removeprefix("_orig_mod.")
