"""The module inside the wrappers torch puts around a model, whose names checkpoints use."""

from __future__ import annotations

from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The module whose names the checkpoint uses: DDP's ``module``, torch.compile's ``_orig_mod``.
    FSDP2 models are wrapped in place (same names) and stay as they are."""
    while True:
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module) and type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
            model = inner
            continue
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        return model
