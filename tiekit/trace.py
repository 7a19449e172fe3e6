"""Optional usage analysis for `find_ties(trace=True)`: which graph nodes read each tie group.

Graphs name a tied tensor by whichever of its names they met first (fx resolves through the
de-duplicated ``named_parameters()``; export lifts one placeholder per name but routes every
use to one of them), so every name is resolved back to a tensor *by identity* on the live
model and only then mapped to its group.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from tiekit.plan import CrossModuleUse, TiePlan, TieUse
from tiekit.slots import walk_slots


def trace_uses(model: nn.Module, plan: TiePlan, example_inputs: tuple[Any, ...] | None) -> TiePlan:
    """Return ``plan`` with per-group ``uses``, ``cross_module`` reads and ``trace_status`` filled in.

    Uses ``torch.fx.symbolic_trace``, or ``torch.export.export(strict=False)`` when
    ``example_inputs`` are given. A model that cannot be traced yields a plan whose
    ``trace_status`` says why; it never raises the tracer's own exception.
    """
    reads: list[tuple[str, str, str, str]] = []  # (op, target, reader module, tensor name)
    try:
        if example_inputs is None:
            status = "traced with torch.fx.symbolic_trace"
            reads = _fx_reads(model)
        else:
            status = "traced with torch.export.export(strict=False)"
            reads = _export_reads(model, example_inputs)
    except Exception as exc:  # noqa: BLE001 - any tracer failure means "not traceable", by design
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return dataclasses.replace(plan, trace_status=f"not traceable: {type(exc).__name__}: {reason}"[:500])

    owner_paths = _owner_paths(model)
    canonical = _canonical_names(model)
    uses: dict[str, list[TieUse]] = {}
    cross: list[CrossModuleUse] = []
    for op, target, reader, name in reads:
        first = canonical.get(name, name)
        group = plan.group_of(first)
        if group is not None:
            use = TieUse(op, target, reader)
            bucket = uses.setdefault(group.source, [])
            if use not in bucket:
                bucket.append(use)
        owners = owner_paths.get(first, ())
        if op != "call_module" and reader not in owners:
            shown = group.source if group is not None else first
            entry = CrossModuleUse(shown, reader)
            if entry not in cross:
                cross.append(entry)
    groups = tuple(dataclasses.replace(g, uses=tuple(uses.get(g.source, ()))) for g in plan.groups)
    return dataclasses.replace(plan, groups=groups, cross_module=tuple(cross), trace_status=status)


def _fx_reads(model: nn.Module) -> list[tuple[str, str, str, str]]:
    graph_module = torch.fx.symbolic_trace(model)
    reads = []
    for node in graph_module.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        reader = list(stack.values())[-1][0] if stack else ""
        if node.op == "get_attr":
            reads.append(("get_attr", str(node.target), reader, str(node.target)))
        elif node.op == "call_module":
            module = model.get_submodule(str(node.target))
            prefix = f"{node.target}." if node.target else ""
            for attr, t in [*module._parameters.items(), *module._buffers.items()]:
                if t is not None:
                    reads.append(("call_module", str(node.target), str(node.target), prefix + attr))
    return reads


def _export_reads(model: nn.Module, example_inputs: tuple[Any, ...]) -> list[tuple[str, str, str, str]]:
    exported = torch.export.export(model, example_inputs, strict=False)
    signature = exported.graph_signature
    lifted = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    reads = []
    for node in exported.graph.nodes:
        if node.op != "call_function":
            continue
        stack = node.meta.get("nn_module_stack") or {}
        reader = list(stack.values())[-1][0] if stack else ""
        for arg in node.all_input_nodes:
            if arg.op == "placeholder" and arg.name in lifted:
                reads.append(("call_function", str(node.target), reader, lifted[arg.name]))
    return reads


def _canonical_names(model: nn.Module) -> dict[str, str]:
    """Every name -> the first name of the same tensor object (identity, not names)."""
    first_of: dict[int, str] = {}
    canonical: dict[str, str] = {}
    walk = walk_slots(model)
    for i, t in enumerate(walk.tensors):
        canonical[walk.name(i)] = first_of.setdefault(id(t), walk.name(i))
    return canonical


def _owner_paths(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """First name of each tensor -> paths of every module that registers it."""
    canonical = _canonical_names(model)
    owners: dict[str, list[str]] = {}
    for name, first in canonical.items():
        owners.setdefault(first, []).append(name.rpartition(".")[0])
    return {k: tuple(v) for k, v in owners.items()}
