"""Parameters written in place by a forward pass, which FSDP2 loses without a word.

Inside an FSDP2 unit's forward the parameters it manages are unsharded copies, gathered from
every rank's shard and freed after the forward or backward pass; nothing copies them back. A
forward pass that writes a parameter in place (a constraint applied under ``torch.no_grad()``,
say) therefore changes that copy only: the same model trains differently under
``fit(strategy="fsdp")`` than in one process or under DDP, where the write lands. (A write to a
parameter still sharded, from outside its unit, lands in the shard and is not the concern here.)

`tiekit.shard` calls `refuse_forward_writes`: it watches the first forward pass of every unit and
raises a `TiekitError` naming the parameters such a pass wrote (every in-place write bumps a tensor's version counter;
a write through ``.data`` does not, and is not seen).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tiekit.errors import TiekitError


def refuse_forward_writes(model: nn.Module) -> None:
    """Local: make the next forward pass of ``model`` (sharded with FSDP2) raise `TiekitError` if it
    writes a gathered (unsharded) parameter in place; then stop watching. Call it after sharding:
    the watch runs between FSDP2's gather before each unit's forward and its release after it."""
    from torch.distributed.tensor import DTensor

    from tiekit.sharding.wrap import fsdp2

    FSDPModule = fsdp2()[0]

    names = {id(m): prefix for prefix, m in model.named_modules(remove_duplicate=False)}
    handles: list[Any] = []
    watched: dict[int, list[tuple[str, Any, int]]] = {}
    depth = [0]

    def before(module: nn.Module, args: Any) -> None:
        depth[0] = 1 if module is model else depth[0] + 1  # a pass that raised left its count behind
        prefix = names.get(id(module), "")
        watched[id(module)] = [
            (f"{prefix}.{name}" if prefix else name, p, p._version)
            for name, p in module.named_parameters()
            if not isinstance(p, DTensor)  # gathered now; a unit inside it gathers its own later
        ]

    def after(module: nn.Module, args: Any, output: Any) -> None:
        written = sorted({name for name, p, version in watched.pop(id(module), []) if p._version != version})
        depth[0] -= 1
        if depth[0] == 0 or written:  # the outermost unit's forward is over: one pass watched
            for handle in handles:
                handle.remove()
        if written:
            shown = ", ".join(repr(n) for n in written)
            raise TiekitError(
                f"the forward pass wrote {shown} in place: under FSDP2 a forward pass sees a gathered copy "
                "of each parameter, freed after it, so the write would be lost and the model would train "
                "differently than in one process or under DDP. Change the parameters outside the forward "
                "pass (after the optimizer step), or train with DDP (fit: strategy='ddp')"
            )

    for module in model.modules():
        if isinstance(module, FSDPModule):
            handles.append(module.register_forward_pre_hook(before))  # after FSDP2's gather
            handles.append(module.register_forward_hook(after, prepend=True))  # before its release
