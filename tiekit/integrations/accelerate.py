"""accelerate: ``prepare_tied`` is ``accelerator.prepare`` for models with tied weights.

``accelerator.prepare(model)`` moves the model with ``model.to(accelerator.device)``; on an XLA
device that gives every tied name its own copy (accelerate's TPU guide asks you to call
``model.tie_weights()`` afterwards, which only transformers models have and which knows no
buffers or views). ``prepare_tied`` moves the model itself first, keeping ties
(`tiekit.move`), so that ``prepare``'s own move changes nothing and a DDP wrapper is built over
the tied parameters; then it re-ties and verifies the unwrapped model once more. Optimizers
passed along (built before the move) are re-bound to the moved parameters by name.

Under FSDP (and DeepSpeed, Megatron-LM) accelerate places the parameters itself: the model is
re-tied where it is, and accelerate's FSDP2 settings that would split or break a tie are refused
before ``prepare`` changes the model (`_refuse_fsdp2_settings`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tiekit.declared_groups import checked_declared
from tiekit.errors import TieError, TiekitError
from tiekit.moving import move, moving_plan, rebind_optimizer
from tiekit.plan import TiePlan
from tiekit.retie import OnError, checked_on_error, fitting_plan, retie, verify
from tiekit.sharding.units import innermost_unit, within

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
    ``objects``. The ties are planned as `tiekit.move` plans them (`tiekit.moving.moving_plan`):
    those the model holds, every ``TPUMixin.tied_weights`` in it, and those it (or a submodule)
    otherwise declares whose tensors are equal in value (a tie a plain ``.to`` broke), which are
    tied again. Collective where ``accelerator.prepare`` is (DDP's parameter broadcast, FSDP2's
    sharding): every rank calls it. ``declared`` adds ``{target: source}`` ties the model declares
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
    self_placing = accelerator.distributed_type.name in _SELF_PLACING
    names = {id(p): n for n, p in base.named_parameters()}
    if accelerator.device_placement and not self_placing:
        move(base, accelerator.device, plan=plan, on_error=on_error)
    else:
        # prepare does not move the model: the move's re-tie (a declared tie a plain .to broke) is
        # made here, in place, so that FSDP or DDP wraps the tied parameter and not two copies.
        plan = fitting_plan(base, plan, counted=on_error == "raise")
        if accelerator.distributed_type.name == "FSDP":
            _refuse_fsdp2_settings(accelerator, base, plan)
        retie(base, plan)
        verify(base, plan, on_error=on_error)
    for optimizer in objects:
        if isinstance(optimizer, torch.optim.Optimizer):
            rebind_optimizer(optimizer, base, names)
    prepared = accelerator.prepare(model, *objects)
    inner = accelerator.unwrap_model(prepared[0] if objects else prepared, keep_torch_compile=False)
    try:
        retie(inner, plan)
        verify(inner, plan, on_error=on_error)
    except TieError as exc:
        if accelerator.distributed_type.name != "FSDP":
            raise
        raise TieError(
            f"{exc}\nprepare_tied: accelerate's FSDP preparation (already done: the model is wrapped and "
            "sharded in place) split or broke this tie. With accelerate, change its FSDP plugin instead: an "
            "auto_wrap_policy / min_num_params that keeps the modules of one tie in one unit (the default "
            "policy or TRANSFORMER_BASED_WRAP do for transformers' tied embeddings), and "
            "cpu_ram_efficient_loading=False for a model whose tie_weights() does not restore this tie."
        ) from exc
    return prepared


def _refuse_fsdp2_settings(accelerator: Any, model: nn.Module, plan: TiePlan) -> None:
    """`TieError` naming the accelerate FSDP2 setting that would split or break a tie of ``plan``,
    predicted from the plugin and the model as accelerate's ``fsdp2_prepare_model`` would act
    (accelerate 1.x), raised before ``prepare`` changes the model in place. Local."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or getattr(plugin, "fsdp_version", 1) != 2:
        return
    ties = [[m.name for m in g.members if m.kind == "parameter" and m.view is None] for g in plan.groups]
    ties = [names for names in ties if len(names) > 1]
    if not ties:
        return
    if getattr(plugin, "cpu_ram_efficient_loading", False) and not hasattr(model, "tie_weights"):
        # accelerate moves the model to meta (one tensor per name) and re-ties only through tie_weights().
        raise TieError(
            f"prepare_tied: accelerate's FSDP plugin has cpu_ram_efficient_loading=True, which moves the model "
            f"to the meta device and re-ties it only through model.tie_weights(), which {type(model).__name__} "
            f"does not have: the tie of {', '.join(ties[0])} would break. Set cpu_ram_efficient_loading=False "
            "(FSDP_CPU_RAM_EFFICIENT_LOADING=false) or give the model a tie_weights() that restores it; "
            "nothing was changed"
        )
    units = _auto_wrap_units(plugin, model, ties)
    for names in ties:
        owners = {name: _unit_of(name.rpartition(".")[0], units) for name in names}
        if len(set(owners.values())) > 1:
            listed = ", ".join(f"{n} (unit {u or '<root>'!r})" for n, u in owners.items())
            policy = getattr(plugin.auto_wrap_policy, "__name__", repr(plugin.auto_wrap_policy))
            raise TieError(
                f"prepare_tied: accelerate's FSDP plugin (auto_wrap_policy={policy}, "
                f"min_num_params={plugin.min_num_params}) would put the tied {listed} in different units, each "
                "training its own copy. Choose an auto_wrap_policy / min_num_params that keeps them in one unit "
                "(the default policy, or TRANSFORMER_BASED_WRAP for transformers models); nothing was changed"
            )


def _auto_wrap_units(plugin: Any, model: nn.Module, ties: list[list[str]]) -> dict[str, str]:
    """{module path: its unit's label} for the modules accelerate's ``fsdp2_prepare_model`` shards
    on their own: those its auto-wrap policy picks, the input embedding when untied, and the
    tied embeddings' tail group. Empty when accelerate's helpers are not there to ask."""
    try:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy, get_module_children_bottom_up

        plugin = copy.copy(plugin)  # set_auto_wrap_policy resolves the policy on the plugin itself
        plugin.set_auto_wrap_policy(model)
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
        paths = {id(m): n for n, m in model.named_modules()}
        wrapped = [m for m in get_module_children_bottom_up(model)[:-1] if policy is not None and policy(m)]
        inputs = getattr(model, "get_input_embeddings", lambda: None)()
        outputs = getattr(model, "get_output_embeddings", lambda: None)()
    except (ImportError, AttributeError, TypeError, ValueError):  # older accelerate; a policy it refuses itself
        return {}
    units = {paths[id(m)]: paths[id(m)] for m in wrapped if id(m) in paths}
    inner = [m for m in (inputs, outputs) if isinstance(m, nn.Module) and id(m) in paths]
    # Tied as accelerate will see them: after the re-tie prepare_tied makes first (a tie of the plan).
    weights = {f"{paths[id(m)]}.weight".lstrip(".") for m in inner}
    tied = len(inner) == 2 and (len(weights) == 1 or any(weights <= set(names) for names in ties))
    for m in inner:
        path = paths[id(m)]
        if not any(within(path, unit) for unit in units):
            units[path] = "tail" if tied or m is outputs else path
    return units


def _unit_of(path: str, units: Mapping[str, str]) -> str:
    """The unit managing the parameters of module ``path``: its deepest unit, else the root ("")."""
    unit = innermost_unit(path, units.__contains__)
    return units.get("", "") if unit is None else units[unit]


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
