"""TPUMixin inside a LightningModule, as the seeds' WeightSharingModule was written."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tiekit

pl = pytest.importorskip("lightning.pytorch")


class LightningWeightSharing(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer_1 = nn.Linear(32, 10, bias=False)
        self.layer_2 = nn.Linear(10, 32, bias=False)
        self.layer_3 = nn.Linear(32, 10, bias=False)
        self.layer_3.weight = self.layer_1.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_3(self.layer_2(self.layer_1(x)))


class MixinLightningWeightSharing(tiekit.TPUMixin, LightningWeightSharing):
    pass


def test_lightning_module_with_mixin_keeps_ties_through_to_empty_and_casts() -> None:
    with torch.device("meta"):
        plain = LightningWeightSharing()
        model = MixinLightningWeightSharing()
    plain.to_empty(device="cpu")
    assert plain.layer_1.weight is not plain.layer_3.weight
    model.to_empty(device="cpu")
    model.to(torch.bfloat16)  # LightningModule overrides .to(); the mixin sits below it in _apply
    assert model.layer_1.weight is model.layer_3.weight
    assert model.dtype == torch.bfloat16 and len(list(model.parameters())) == 2


@pytest.mark.xla
def test_lightning_module_with_mixin_on_xla(xla_device: torch.device) -> None:
    plain = LightningWeightSharing().to(xla_device)
    assert plain.layer_1.weight is not plain.layer_3.weight
    model = MixinLightningWeightSharing().to(xla_device)
    assert model.layer_1.weight is model.layer_3.weight
    assert model.device.type == "xla" and len(list(model.parameters())) == 2
