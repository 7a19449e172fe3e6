"""strategy="ddp": two gloo processes on the CPU train like one process with the global batch."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from models import WeightSharingModule
from torch.utils.data import TensorDataset

import tiekit


def test_two_gloo_processes_match_one_process_with_the_global_batch(capfd: pytest.CaptureFixture[str]) -> None:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 32, generator=generator), torch.randn(64, 10, generator=generator))
    kw = {"loss_fn": F.mse_loss, "epochs": 2, "seed": 3, "optimizer": functools.partial(torch.optim.AdamW, lr=1e-2)}
    torch.manual_seed(3)
    model = WeightSharingModule()  # a module, not a factory: it reaches the processes pickled
    before = {k: v.clone() for k, v in model.state_dict().items()}

    val = TensorDataset(torch.randn(22, 32, generator=generator), torch.randn(22, 10, generator=generator))
    kw["val_data"] = val
    result = tiekit.fit(model, data, strategy="ddp", devices=2, batch_size=8, **kw)  # type: ignore[arg-type]
    bars = capfd.readouterr().err.count("0/8 [")
    reference = tiekit.fit(WeightSharingModule, data, devices="cpu", batch_size=16, progress=False, **kw)  # type: ignore[arg-type]

    assert (result.strategy, result.world_size, result.steps) == ("ddp", 2, 8)
    assert len(result.replica_digests) == 2 and result.replicas_identical
    assert result.ties_kept and result.model is model
    assert model.layer_3.weight is model.layer_1.weight
    trained, expected = model.state_dict(), reference.model.state_dict()
    assert not all(torch.equal(trained[k], before[k]) for k in before)
    for name in expected:
        torch.testing.assert_close(trained[name], expected[name], rtol=1e-5, atol=1e-6)
    assert bars == 1  # one progress bar: the master's
    # Validation over both processes' shares (11 + 11 samples, batches of 8 and 3) is the mean over all 22.
    assert len(result.val_losses) == 2
    assert result.val_losses == pytest.approx(reference.val_losses, rel=1e-5)


def test_what_spawned_processes_cannot_unpickle_is_a_clear_error() -> None:
    data = TensorDataset(torch.randn(16, 32), torch.randn(16, 10))
    with pytest.raises(tiekit.TiekitError, match=r"strategy='ddp' starts new processes.*no lambdas or local functions"):
        tiekit.fit(
            WeightSharingModule,
            data,
            loss_fn=lambda out, target: F.mse_loss(out, target),
            strategy="ddp",
            devices=2,
            batch_size=4,
            progress=False,
        )
