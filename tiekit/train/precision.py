"""Training precisions: what the weights are cast to, and what runs under autocast.

``"bf16-true"`` casts the model (through `tiekit.move`, so ties hold) and the floating inputs to
bfloat16; ``"bf16-mixed"`` keeps float32 weights and runs forward and loss under
``torch.autocast(<device type>, dtype=torch.bfloat16)`` (``"xla"`` on XLA devices). The
deprecated ``XLA_USE_BF16`` is never used.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tiekit.errors import TiekitError, user_stacklevel

PRECISIONS = ("32-true", "bf16-true", "bf16-mixed", "16-true")


@dataclass(frozen=True)
class Precision:
    """A resolved precision: ``param_dtype`` for the weights (None: unchanged), ``autocast_dtype``
    for autocast (None: no autocast)."""

    name: str
    param_dtype: torch.dtype | None
    autocast_dtype: torch.dtype | None

    def autocast(self, device: torch.device, *, cache: bool = True) -> contextlib.AbstractContextManager[Any]:
        """The autocast context of the forward pass on ``device`` (a no-op without autocast);
        ``cache=False`` casts a weight again at every use instead of caching the cast."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype, cache_enabled=cache)

    def cast_batch(self, batch: Any) -> Any:
        """The batch with its floating tensors in ``param_dtype`` (ids and masks untouched)."""
        if self.param_dtype is None:
            return batch
        return _cast(batch, self.param_dtype)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, Mapping):
        return {k: _cast(v, dtype) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def resolve_precision(name: str, half_dtype: torch.dtype, device_type: str) -> Precision:
    """The `Precision` called ``name`` on a ``device_type`` ("xla", "cpu", "cuda") device whose
    16-bit floating point is ``half_dtype`` (the backend's answer).

    ``"16-true"`` (the seeds' 16-bit precision) is ``half_dtype`` weights: float16, or bfloat16
    where the device computes 16 bits so (XLA, as on TPUs), with a note saying so.
    """
    check_precision(name)
    if name == "32-true":
        return Precision(name, None, None)
    if name == "bf16-true":
        return Precision(name, torch.bfloat16, None)
    if name == "bf16-mixed":
        return Precision(name, None, torch.bfloat16)
    if half_dtype == torch.bfloat16:
        warnings.warn(
            f'precision="16-true" on {device_type.upper()} trains in bfloat16 ("bf16-true"): {device_type.upper()} '
            "devices compute 16-bit floating point as bfloat16; pass precision='bf16-true' to silence this note",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        return Precision("bf16-true", torch.bfloat16, None)
    return Precision(name, torch.float16, None)


def check_precision(name: str) -> None:
    """Raise `TiekitError` unless ``name`` is a precision tiekit knows."""
    if name not in PRECISIONS:
        raise TiekitError(f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}")
