"""The devices and dtypes of a model's tensors, and putting them back: the module passed to `fit`
comes back from a run that fails as it went in.

A run of one process trains the module you passed in place: it moves it to the device, casts it
to the precision's dtype, and (``"spmd_fsdp"``) shards it. A run that succeeds hands it back on
the CPU (`tiekit.backends.base.Backend.unplace`); one that failed (an optimizer factory that
returned None, a resume checkpoint it could not load, an error in your loss_fn) left it on the
XLA device, sharded, where the next CPU forward failed ("Expected XLA tensor"). `PutBack` puts
it back where it was.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tiekit.moving import move
from tiekit.plan import TiePlan
from tiekit.retie import retie
from tiekit.slots import slot_table


def named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer by each of its names."""
    return [(name, slot[2]) for name, slot in slot_table(model).items()]


def floating_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """Every floating-point parameter's and buffer's dtype, by name."""
    return {name: t.dtype for name, t in named_tensors(model) if t.is_floating_point()}


def restore_dtypes(model: nn.Module, dtypes: dict[str, torch.dtype], plan: TiePlan) -> None:
    """Cast back the tensors of a model of mixed dtypes that the cast to the model's first
    dtype gave another one (a float64 scale in a float32 model), keeping their ties and views."""
    wrong = [(t, dtypes[name]) for name, t in named_tensors(model) if name in dtypes and t.dtype != dtypes[name]]
    if not wrong:
        return
    with torch.no_grad():
        for tensor, dtype in wrong:
            if tensor.dtype != dtype:  # a tied tensor's second name: cast already
                tensor.data = tensor.data.to(dtype)
    retie(model, plan)  # a buffer viewing a tensor cast here follows it again


def _where(model: nn.Module) -> dict[str, tuple[torch.device, torch.dtype]]:
    return {name: (t.device, t.dtype) for name, t in named_tensors(model)}


class PutBack:
    """The module passed to `fit` (``passed``; a factory has none), put back where it was if the
    run fails: on its device, in its dtypes and training modes, ties kept. Its weights are those
    the run left (the ones it came with when the run failed before its first optimizer step, but
    for buffers a forward updates, such as BatchNorm's statistics); on XLA its
    parameters are new `torch.nn.Parameter` objects, as after a run that succeeds."""

    def __init__(self, passed: nn.Module | Callable[[], nn.Module]) -> None:
        self.passed = passed
        self.model: nn.Module | None = None
        self.plan: TiePlan | None = None
        self.where: dict[str, tuple[torch.device, torch.dtype]] = {}
        self.training: list[bool] = []
        self.alone = True

    def remember(self, model: nn.Module, plan: TiePlan, *, alone: bool = True) -> None:
        """Where ``model``, about to be placed, is now, if it is the module passed to fit (not
        fit's copy of it, nor one from a factory). ``alone``: this process can move it off the
        device without the run's other processes (`tiekit.backends.base.Backend.unplaces_alone`)."""
        if model is self.passed:
            self.model, self.plan, self.alone = model, plan, alone
            self.where = _where(model)
            self.training = [m.training for m in model.modules()]

    def after_failure(self, failure: BaseException) -> None:
        """Put the module back if the run moved or cast it, and its training modes back (the
        run set them to training). ``failure``, which fit raises, stays the error raised: one
        putting the module back fails with is added to its notes."""
        model, plan = self.model, self.plan
        if model is None or plan is None:
            return
        for module, training in zip(model.modules(), self.training, strict=False):
            module.training = training
        if _where(model) == self.where:
            return
        if not self.alone:  # a collective: this process alone would wait for the others
            failure.add_note("tiekit: the model passed to fit stays on the device: moving it off takes every host")
            return
        devices = {device for device, _ in self.where.values()}
        # A model spread over several devices (which fit placed on one) comes back on the CPU, as
        # a run that succeeds returns it.
        device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        try:
            move(model, device, plan=plan)
            restore_dtypes(model, {name: dtype for name, (_, dtype) in self.where.items()}, plan)
        except Exception as exc:  # noqa: BLE001 - added to the failure fit raises, which stays the first
            failure.add_note(
                f"tiekit: putting the model passed to fit back on {device} after this failure failed too: "
                f"{type(exc).__name__}: {exc}"
            )
