"""Edges of the core API found by probing: a mixin plan cached past a change of memory, a view in
another dtype, an assign-load of a state dict whose tied names are left out or disagree."""

from __future__ import annotations

import torch
from torch import nn

import tiekit


class ViewOfWeight(tiekit.TPUMixin, nn.Module):
    """A weight and a buffer that is its transpose (a view group)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6))
        self.register_buffer("wt", self.w.detach().t())


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# -- the mixin's cached plan -------------------------------------------------------------------


def test_the_mixin_replans_when_a_view_buffer_is_no_longer_a_view() -> None:
    """``w.data = new`` registers nothing, so the cached plan still said wt is a view of w and the
    next cast rebuilt wt from w's new memory: wt silently lost its own values (probe)."""
    model = ViewOfWeight()
    model.double()
    model.float()  # the plan is cached while wt is a view of w
    with torch.no_grad():
        model.w.data = torch.randn(4, 6)
    wt = model.wt.clone()
    model.double()
    assert torch.equal(model.wt, wt.double()) and not same_memory(model.wt, model.w)


def test_the_mixin_reuses_its_plan_while_the_ties_hold() -> None:
    model = ViewOfWeight()
    plan = model.tie_plan()
    model.double()
    with torch.no_grad():
        model.w.mul_(2)  # new values in the same memory: the plan still holds
    assert model.tie_plan() is plan
    assert same_memory(model.wt, model.w) and torch.equal(model.wt, model.w.t())
