"""Optimizer state in tied checkpoints: stored once per unique parameter, under its source name.

Saving records each param group's parameter names and options, and each parameter's state
(tensors beside the weights, the rest as JSON); loading validates all of it against the live
optimizer before the model changes, and returns the step that restores it afterwards.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tiekit import devices
from tiekit.backends.torch_distributed import dtensor_local_rows, is_dtensor, shard_like
from tiekit.checkpoint.codec import decode, encode
from tiekit.checkpoint.layout import name_list
from tiekit.errors import CheckpointError, TieError
from tiekit.plan import TiePlan
from tiekit.slots import resolve

if TYPE_CHECKING:
    from tiekit.checkpoint.staging import Staged


def optimizer_record(
    optimizer: torch.optim.Optimizer, model: nn.Module, plan: TiePlan, side: dict[str, torch.Tensor]
) -> dict[str, Any]:
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), plan.source_of(name))
    packed = optimizer.state_dict()
    index_name: dict[int, str] = {}
    groups = []
    for i, (live, saved) in enumerate(zip(optimizer.param_groups, packed["param_groups"], strict=True)):
        group_names = []
        for p, index in zip(live["params"], saved["params"], strict=True):
            found = names.get(id(p))
            if found is None:
                raise CheckpointError(
                    f"cannot save the optimizer: param group {i} holds a tensor of shape {tuple(p.shape)} that is "
                    f"not a parameter of {type(model).__name__} (tiekit stores optimizer state by parameter name)"
                )
            group_names.append(found)
            index_name[index] = found
        options = {k: v for k, v in saved.items() if k != "params"}
        groups.append({"params": group_names, "options": encode(options, f"optimizer/param_groups/{i}", side)})
    state: dict[str, Any] = {}
    for index, values in packed["state"].items():
        name = index_name[index]
        if name not in state:  # tied names share one parameter, so one state
            state[name] = encode(dict(values), f"optimizer/state/{name}", side)
    return {"class": optimizer_class(optimizer).__name__, "param_groups": groups, "state": state}


def optimizer_class(optimizer: torch.optim.Optimizer) -> type:
    """The class of the optimizer that steps: inside the wrappers frameworks hand out
    (accelerate's ``AcceleratedOptimizer.optimizer``, Lightning's ``LightningOptimizer._optimizer``),
    which pass its state through. A checkpoint records it, so that the same optimizer loads with
    and without a framework, and another one (AdamW state into a wrapped SGD) is refused. A
    wrapper with state of its own (Lookahead's slow weights) is an optimizer of its own."""
    inner: Any = optimizer
    for _ in range(8):  # a wrapper of a wrapper; never a cycle
        wrapped = getattr(inner, "optimizer", None) or getattr(inner, "_optimizer", None)
        if not isinstance(wrapped, torch.optim.Optimizer) or wrapped is inner:
            break
        if getattr(inner, "state", None) is not wrapped.state:
            break
        inner = wrapped
    return type(inner)


def stage_optimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    staged: Staged,
    record: Any,
    tensors: Mapping[str, torch.Tensor],
    where: str,
) -> Callable[[], None]:
    """Validate the saved optimizer state against ``optimizer``; return the commit step."""
    if not isinstance(record, dict) or not isinstance(record.get("param_groups"), list):
        raise CheckpointError(f"{where}: corrupted optimizer record")
    kind = optimizer_class(optimizer)
    # Files written before the class was taken from inside a wrapper name the wrapper.
    if record.get("class") not in (kind.__name__, type(optimizer).__name__):
        raise CheckpointError(f"{where}: holds {record.get('class')} state, not {kind.__name__}")
    saved_groups = record["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{where}: {len(saved_groups)} optimizer param group(s) saved, "
            f"the optimizer has {len(optimizer.param_groups)}"
        )
    # Names before the commit (it may replace or re-tie tensors), mapped to the name that
    # holds each tensor afterwards.
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), staged.anchor.get(name, name))
    key_anchor = {key: name for name, key in staged.loads}
    live_groups: list[list[str]] = []
    options: list[dict[str, Any]] = []
    for i, (live, saved) in enumerate(zip(optimizer.param_groups, saved_groups, strict=True)):
        anchors = list(dict.fromkeys(names.get(id(p), "") for p in live["params"]))
        if "" in anchors:
            raise CheckpointError(
                f"{where}: optimizer param group {i} holds a tensor that is not a parameter of the model (an "
                "optimizer built before the model was wrapped, by tiekit.shard or fully_shard, holds the "
                "parameters the wrapping replaced: build it from model.parameters() after wrapping)"
            )
        saved_params = saved.get("params") if isinstance(saved, dict) else None
        if not isinstance(saved_params, list) or not all(isinstance(n, str) for n in saved_params):
            raise CheckpointError(f"{where}: corrupted optimizer param group {i} (its 'params' must be names)")
        saved_names = [str(key_anchor.get(n, n)) for n in saved_params]
        if set(saved_names) != set(anchors):
            raise CheckpointError(
                f"{where}: optimizer param group {i}: the checkpoint has state for "
                f"{name_list(sorted(saved_names))} but the optimizer holds {name_list(sorted(anchors))}"
            )
        live_groups.append(anchors)
        decoded = decode(saved.get("options", {}), tensors, where)
        if not isinstance(decoded, dict):
            raise CheckpointError(f"{where}: corrupted options of optimizer param group {i}")
        options.append(_checked_options(decoded, live, i, where))
        _check_values_torch_accepts(kind, options[-1], i, where)
    saved_state = record.get("state", {})
    if not isinstance(saved_state, dict):
        raise CheckpointError(f"{where}: corrupted optimizer state (not an object of parameter names)")
    held = {a for anchors in live_groups for a in anchors}
    state: dict[str, Any] = {}
    for name, values in saved_state.items():
        decoded = decode(values, tensors, where)
        if not isinstance(decoded, dict):
            raise CheckpointError(f"{where}: corrupted optimizer state of {name!r}")
        anchor = key_anchor.get(name, name)
        if anchor not in held:
            raise CheckpointError(f"{where}: optimizer state for {name!r}, which no param group of the optimizer holds")
        _check_state_shapes(kind, name, decoded, _shape_of(model, anchor), where)
        state[anchor] = decoded

    def restore() -> None:
        packed: dict[str, Any] = {"state": {}, "param_groups": []}
        index = 0
        for group, anchors, opts in zip(optimizer.param_groups, live_groups, options, strict=True):
            group["params"] = [resolve(model, a)[2] for a in anchors]
            ids = []
            for anchor, param in zip(anchors, group["params"], strict=True):
                if anchor in state:
                    packed["state"][index] = _laid_out_as(param, state[anchor])
                ids.append(index)
                index += 1
            packed["param_groups"].append({**opts, "params": ids})
        optimizer.state.clear()
        optimizer.load_state_dict(packed)

    return restore


def sharded_state_rows(record: Any, model: nn.Module, staged: Staged) -> dict[str, tuple[torch.Tensor, int, int]]:
    """Before anything is read: the stored optimizer state tensors that belong to a sharded
    (FSDP2) parameter whose shard on this rank is whole rows, as ``{stored key: (parameter,
    first row, row count)}``, so that each rank reads its own rows of them only. What does not
    fit this (a corrupted record, another shape) is left out, read whole, and judged later."""
    state = record.get("state") if isinstance(record, dict) else None
    if not isinstance(state, dict):
        return {}
    key_anchor = {key: name for name, key in staged.loads}
    out: dict[str, tuple[torch.Tensor, int, int]] = {}
    for name, values in state.items():
        try:
            param = resolve(model, str(key_anchor.get(name, name)))[2]
        except TieError:
            continue
        rows = dtensor_local_rows(param) if is_dtensor(param) else None
        if rows is None or not isinstance(values, dict):
            continue
        for value in values.values():
            stored = value.get("__tensor__") if isinstance(value, dict) else None
            if isinstance(stored, str):
                out[stored] = (param, *rows)
    return out


def _laid_out_as(param: torch.Tensor, values: dict[str, Any]) -> dict[str, Any]:
    """A sharded (FSDP2) parameter's state as DTensors sharded as it is (each rank keeping its
    shard; local): torch's ``load_state_dict`` would keep them whole, and the next step fails
    mixing the two. An XLA SPMD-sharded parameter's state sharded as it is (`_spmd_sharded_as`).
    State already read as this rank's rows, and other state, as it is."""
    if devices.spmd_sharding(param) is not None:
        return {key: _spmd_sharded_as(param, key, value) for key, value in values.items()}
    if not is_dtensor(param):
        return values
    return {
        key: shard_like(param, value)
        if isinstance(value, torch.Tensor) and not is_dtensor(value) and value.shape == param.shape
        else value
        for key, value in values.items()
    }


def _spmd_sharded_as(param: torch.Tensor, key: str, value: Any) -> Any:
    """A state tensor of the parameter's shape on its device and sharded as it is under XLA SPMD,
    each device receiving only its shard: what an SPMD step gives it. torch's ``load_state_dict``
    would move it unannotated, whole on every device until the next step. Cast first as that
    casts it (to a floating-point parameter's dtype), so that its own ``.to`` keeps this tensor.
    Other values (``step``, which torch leaves where it is) as they are."""
    if key == "step" or not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return value
    if param.is_floating_point():
        value = value.to(param.dtype)
    return devices.to_device_sharded_as(value, param)


# torch.optim optimizers whose per-parameter state tensors all have the parameter's shape (or
# are scalars, like "step"); others (Adafactor's factored moments, LBFGS) keep other shapes.
_PARAMETER_SHAPED = frozenset(
    {"SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop"}
    | {"SparseAdam"}
)


def _shape_of(model: nn.Module, name: str) -> tuple[int, ...]:
    return tuple(resolve(model, name)[2].shape)


def _check_state_shapes(kind: type, name: str, values: Mapping[str, Any], shape: tuple[int, ...], where: str) -> None:
    """A state tensor that cannot belong to a parameter of ``shape`` is refused at load, not at
    the first ``step``: one with the parameter's element count in another shape always, and for
    torch.optim's parameter-shaped optimizers (``kind``: `optimizer_class`) any non-scalar one of
    another shape."""
    numel = math.prod(shape)
    strict = kind.__module__.startswith("torch.optim") and kind.__name__ in _PARAMETER_SHAPED
    for key, value in values.items():
        if strict and not _state_value_fits(key, value):
            # torch would take it and fail at the first step (None.lerp_, float(None)...).
            raise CheckpointError(
                f"{where}: optimizer state {key!r} of {name!r} is {value!r}, where {kind.__name__} keeps a tensor"
            )
        if strict and key == "step" and not _counts(value):
            # Adam's bias correction divides by 1 - beta ** step: a step of -1 failed at the first step.
            raise CheckpointError(f"{where}: optimizer state 'step' of {name!r} is {value!r}, not a count of steps")
        if not isinstance(value, torch.Tensor) or tuple(value.shape) == shape:
            continue
        if value.dim() == 0 and (not strict or key in _SCALAR_STATE):
            continue
        if value.numel() == numel or strict:
            raise CheckpointError(
                f"{where}: optimizer state {key!r} of {name!r} has shape {tuple(value.shape)}, the parameter {shape}"
            )


# The scalar state of torch.optim's parameter-shaped optimizers (ASGD keeps eta and mu so): any
# other state of theirs has the parameter's shape, also a 0-dim one (which failed at the first step).
_SCALAR_STATE = frozenset({"step", "eta", "mu"})


def _counts(step: Any) -> bool:
    """Whether ``step`` (a number or a one-element tensor) is a finite count, at least 0."""
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.is_complex():
            return False
        step = step.item()
    return isinstance(step, int | float) and not isinstance(step, bool) and math.isfinite(step) and step >= 0


def _state_value_fits(key: str, value: Any) -> bool:
    """A per-parameter state value torch.optim's parameter-shaped optimizers can step with: a
    tensor; a number for ``step`` (older torch saved it so); None for SGD's empty momentum buffer."""
    if isinstance(value, torch.Tensor):
        return True
    if key == "step":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return key == "momentum_buffer" and value is None


# How this process computes, not what training reached: the live optimizer's values are kept
# (a checkpoint from a GPU run with capturable=True must resume on the CPU).
_IMPLEMENTATION_OPTIONS = frozenset({"foreach", "fused", "differentiable", "capturable"})


def _checked_options(saved: dict[str, Any], live: Mapping[str, Any], group: int, where: str) -> dict[str, Any]:
    """The saved options of param group ``group``, checked against the live group's: numbers where
    it has numbers (tuples of the same length), the same value for flags that shape the state
    (``amsgrad``, ``nesterov``...), the live value for implementation choices and missing keys."""
    out = dict(saved)
    for key, now in live.items():
        if key == "params":
            continue
        if key in _IMPLEMENTATION_OPTIONS or key not in saved:
            out[key] = now
            continue
        if not _same_kind(saved[key], now):
            raise CheckpointError(
                f"{where}: optimizer param group {group}: option {key!r} is {saved[key]!r} in the checkpoint, "
                f"which does not fit this optimizer's {now!r}"
            )
        if isinstance(now, bool) and saved[key] != now:
            raise CheckpointError(
                f"{where}: optimizer param group {group}: the checkpoint's optimizer was built with {key}="
                f"{saved[key]!r}, this one with {key}={now!r}; build it as when saving"
            )
    return out


def _check_values_torch_accepts(cls: type, options: dict[str, Any], group: int, where: str) -> None:
    """A torch.optim optimizer checks its options when built (``betas`` in [0, 1), ``lr`` >= 0...)
    but not when they come through ``load_state_dict``: betas of (0, 2) loaded, and the first
    step failed in torch's arithmetic. So one is built with the saved options, on a stand-in
    parameter, and its ``ValueError`` becomes a `CheckpointError`. Other optimizers are left to
    themselves: building one may have effects. ``cls``: `optimizer_class`."""
    if not cls.__module__.startswith("torch.optim"):
        return
    accepted = inspect.signature(cls).parameters
    # The implementation choices are the live optimizer's (fused=True wants the run's device, not
    # the stand-in's), so only the options a checkpoint carries are checked.
    given = {k: v for k, v in options.items() if k in accepted and k not in _IMPLEMENTATION_OPTIONS | {"params"}}
    try:
        cls([torch.zeros(1, requires_grad=True)], **given)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(
            f"{where}: optimizer param group {group}: {cls.__name__} refuses the saved options: {exc}"
        ) from exc


def _same_kind(saved: Any, live: Any) -> bool:
    if isinstance(live, bool) or live is None or isinstance(live, str):
        return type(saved) is type(live)
    if isinstance(live, int | float):
        return isinstance(saved, int | float) and not isinstance(saved, bool)
    if isinstance(live, tuple | list):
        return (
            isinstance(saved, tuple | list)
            and len(saved) == len(live)
            and all(_same_kind(a, b) for a, b in zip(saved, live, strict=True))
        )
    if isinstance(live, torch.Tensor):
        return isinstance(saved, torch.Tensor | int | float) and not isinstance(saved, bool)
    return True
