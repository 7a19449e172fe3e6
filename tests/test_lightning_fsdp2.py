"""Lightning's ModelParallelStrategy (FSDP2) with a tied model: two real gloo processes started by
Lightning, ``examples/lightning_fsdp2.py``'s module, run with a deadline (`launching.run_together`).

One run of the script below trains four Trainers in turn: ``tiekit.shard`` in ``configure_model``
from seeded weights (compared here with one process training the same global batches) and from
the meta device (the example itself); then the tied pair split into two ``fully_shard`` units,
without ``KeepTies`` (the control: the tie is broken when training starts, and nothing says so)
and with it (refused before the first step, the units named); then `TiedCheckpointIO` with this
strategy (refused by ``KeepTies``).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from launching import BIN, EXAMPLES, base_env, run_ok
from packaging.version import Version
from torch.utils.data import DistributedSampler

import tiekit

pytest.importorskip("lightning.pytorch")

pytestmark = pytest.mark.slow

STEPS = 4

SCRIPT = f"""
import sys
from pathlib import Path

sys.path.insert(0, sys.argv[1])
from torch.distributed.fsdp import fully_shard

import lightning.pytorch as pl
import tiekit
from lightning_fsdp2 import Module, TiesHeld, data, train, trainer
from tiekit.integrations.lightning import KeepTies, TiedCheckpointIO


class SplitModule(Module):
    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for part in (self.model.embed, self.model.head, self.model):  # the tied pair in two units
            fully_shard(part, mesh=mesh)


class BuiltInConfigure(Module):  # the model built in configure_model, Lightning's way for large models

    def __init__(self):
        pl.LightningModule.__init__(self)

    def configure_model(self):
        from lightning_fsdp2 import TiedLM

        self.model = TiedLM()
        SplitModule.configure_model(self)


def fit_and_tell(run, module_class, label):
    with run.init_module(empty_init=True):
        module = module_class()
    try:
        run.fit(module, data())
    except Exception as exc:
        print(f"rank {{run.global_rank}}: {{label}}: {{type(exc).__name__}}: {{exc}}", flush=True)
    else:
        print(f"rank {{run.global_rank}}: {{label}}: trained", flush=True)


def split_run(callbacks, module_class=SplitModule, label=""):
    fit_and_tell(trainer({STEPS}, callbacks), module_class, f"{{label}}{{len(callbacks)}} callbacks")


def tied_io_run():
    run = trainer({STEPS}, [KeepTies()])
    run.strategy.checkpoint_io = TiedCheckpointIO()  # bypassed by this strategy: refused
    fit_and_tell(run, Module, "tied io")


if __name__ == "__main__":
    out = Path(sys.argv[2])
    train(out / "seeded", steps={STEPS}, empty_init=False)
    train(out / "meta", steps={STEPS})
    split_run([TiesHeld()])
    split_run([KeepTies(), TiesHeld()])
    split_run([KeepTies(), TiesHeld()], BuiltInConfigure, "built in configure_model: ")
    tied_io_run()
"""


def example() -> ModuleType:
    """``examples/lightning_fsdp2.py``, imported in this process."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module("lightning_fsdp2")
    finally:
        sys.path.remove(str(EXAMPLES))


def reference() -> torch.nn.Module:
    """The seeded model trained in one process on the global batches (both ranks' halves)."""
    BATCH, data = example().BATCH, example().data
    torch.manual_seed(0)
    model = example().TiedLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    # Lightning trains each rank on a DistributedSampler(shuffle=True, seed=0) of the loader's
    # data; FSDP averages the two ranks' gradients: one step over both ranks' batches together.
    dataset = data().dataset
    ids, targets = dataset.tensors
    orders = [list(DistributedSampler(dataset, num_replicas=2, rank=r, shuffle=True, seed=0)) for r in range(2)]
    for step in range(STEPS):
        rows = [i for order in orders for i in order[BATCH * step : BATCH * (step + 1)]]
        loss = torch.nn.functional.cross_entropy(model(ids[rows]).flatten(0, 1), targets[rows].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def test_model_parallel_strategy_keeps_ties_and_refuses_split_units(tmp_path: Path) -> None:
    (tmp_path / "run.py").write_text(SCRIPT)
    out = tmp_path / "out"
    [run] = run_ok([[str(BIN / "python"), "run.py", str(EXAMPLES), str(out)]], env=base_env(), cwd=tmp_path)
    text = run.output
    for rank in range(2):
        # tiekit.shard, seeded and from meta: tied through configure_model, materialization, training.
        assert text.count(f"rank {rank}: training starts, tied True, 5 parameters") == 2, text[-6000:]
        assert text.count(f"rank {rank}: training ends, tied True, 5 parameters") == 2, text[-6000:]
        # validate after fit calls configure_model again: tiekit.shard leaves the model as it is.
        assert text.count(f"rank {rank}: validated, loss ") == 2, text[-6000:]
        # Control: the tie split over two units is two parameters when training starts, unannounced.
        assert f"rank {rank}: training starts, tied False, 6 parameters" in text, text[-6000:]
        # KeepTies refuses the same layout before the first step, naming the units.
        refused = f"rank {rank}: 2 callbacks: TieError: tiekit: FSDP would shard and update tied weights"
        assert refused in text, text[-6000:]
        # The same with the model built in configure_model: KeepTies had no tie to check (its plan,
        # made before, was empty) and the split tie trained on torch 2.9 (probe).
        refused = f"rank {rank}: built in configure_model: 2 callbacks: TieError: tiekit: FSDP would shard and update"
        assert refused in text, text[-6000:]
    assert "model.embed.weight (unit 'model.embed'), model.head.weight (unit 'model.head')" in text
    assert "2 callbacks: trained" not in text
    # TiedCheckpointIO under this strategy stored both names of the tie and could not be resumed
    # from (the strategy loads with torch.load): refused before training (probe).
    for rank in range(2):
        assert f"rank {rank}: tied io: TiekitError: TiedCheckpointIO does not work under ModelParallelStrategy" in text
    if Version(torch.__version__).release < (2, 13):  # torch 2.13 and later refuse split units at the first forward
        assert "rank 0: 1 callbacks: trained" in text, text[-6000:]

    # The sharded folders hold the tied weight once and load into a plain model, tied.
    expected = reference()
    seeded = example().TiedLM()
    result = tiekit.load_sharded(seeded, out / "seeded")
    assert result.missing == () and result.unexpected == ()
    assert [g.names for g in result.retied] == [("embed.weight", "head.weight")]
    assert seeded.head.weight is seeded.embed.weight
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(seeded.state_dict()[name], value, msg=name)
    torch.manual_seed(0)
    untrained = example().TiedLM()
    assert not torch.allclose(seeded.embed.weight, untrained.embed.weight)
    meta = example().TiedLM()
    tiekit.load_sharded(meta, out / "meta")
    assert meta.head.weight is meta.embed.weight
    assert torch.isfinite(meta.embed.weight).all()
