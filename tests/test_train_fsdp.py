"""strategy="fsdp" (issue 11): FSDP2 over 2 gloo processes trains like DDP on the same global
batch, step by step, and hands back a plain model with its ties; spawned by fit and under torchrun.

Each run is 2 real processes (spawned by fit, or started by torchrun with a timeout)."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from launching import EXAMPLES, base_env, run_ok
from models import WeightSharingModule, gpt2, llama, t5
from test_train import DropoutNet, data, same, weights
from test_train_launchers import dataset, torchrun_one_node
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import tiekit
from tiekit.inspection import inspect_file

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, their own labels (a causal LM, or T5 rebuilding its input)."""

    def __init__(self, count: int = 32, length: int = 8, vocab: int = 96) -> None:
        self.ids = torch.randint(1, vocab, (count, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _tied_names(model: nn.Module) -> list[tuple[str, ...]]:
    return [tuple(m.name for m in group.members) for group in tiekit.find_ties(model).groups]


def test_fsdp_on_two_processes_trains_step_by_step_like_ddp_and_returns_the_callers_model_tied() -> None:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 32, generator=generator), torch.randn(64, 10, generator=generator))
    kw: dict[str, Any] = {"loss_fn": F.mse_loss, "epochs": 2, "seed": 3, "optimizer": ADAMW, "progress": False}
    kw |= {"devices": 2, "batch_size": 8}
    torch.manual_seed(3)
    model = WeightSharingModule()  # a module: the processes shard their own copies of it
    before = {k: v.clone() for k, v in model.state_dict().items()}

    sharded = tiekit.fit(model, data, strategy="fsdp", **kw)
    reference = tiekit.fit(WeightSharingModule, data, strategy="ddp", **kw)

    assert (sharded.strategy, sharded.world_size, sharded.steps) == ("fsdp", 2, 8)
    assert sharded.ties_kept and sharded.model is model and model.layer_3.weight is model.layer_1.weight
    assert not all(torch.equal(model.state_dict()[k], before[k]) for k in before)  # it trained
    torch.testing.assert_close(torch.tensor(sharded.losses), torch.tensor(reference.losses), rtol=1e-5, atol=1e-6)
    expected = reference.model.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)


def seeded_by_rank() -> WeightSharingModule:
    """A model factory seeding each rank its own way (as scripts do for dropout), so the ranks'
    initial weights differ."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0  # 0: fit's own result
    torch.manual_seed(1000 * rank)
    return WeightSharingModule()


def test_fsdp_starts_every_rank_from_rank_0s_weights_as_ddp_does() -> None:
    # FSDP2 shards each process's own values: before, a model initialised differently on each rank
    # trained as a mixture of them (rank 0's rows of one weight, rank 1's of another), where DDP
    # starts every rank from rank 0's.
    torch.manual_seed(0)
    rank_0, rank_1 = (
        WeightSharingModule().state_dict(),
        (torch.manual_seed(1000), WeightSharingModule())[1].state_dict(),
    )
    assert not any(torch.equal(rank_0[k], rank_1[k]) for k in rank_0)  # a mixture would show
    kw: dict[str, Any] = {"loss_fn": F.mse_loss, "max_steps": 1, "progress": False, "devices": 2, "batch_size": 8}
    sgd_standing_still = functools.partial(torch.optim.SGD, lr=0.0)
    result = tiekit.fit(seeded_by_rank, dataset(64), strategy="fsdp", optimizer=sgd_standing_still, **kw)
    assert result.ties_kept and result.model.layer_3.weight is result.model.layer_1.weight
    for name, value in result.model.state_dict().items():
        assert torch.equal(value, rank_0[name]), name


@pytest.mark.parametrize(
    ("build", "precision"),
    [
        # 20-30 s each: on one stack only (the newest torch, whose FSDP2 changes most); the pinned
        # XLA stack's FSDP2 is covered by the lighter tests of this file and tests/test_sharding.py.
        pytest.param(gpt2, "bf16-mixed", id="gpt2", marks=pytest.mark.newest_torch_only),
        pytest.param(llama, "32-true", id="llama", marks=pytest.mark.newest_torch_only),
        pytest.param(t5, "bf16-true", id="t5", marks=pytest.mark.newest_torch_only),
    ],
)
def test_hf_models_train_under_fsdp_like_ddp_in_every_precision(build: Any, precision: str) -> None:
    kw: dict[str, Any] = {"max_steps": 4, "seed": 1, "optimizer": ADAMW, "progress": False, "precision": precision}
    kw |= {"devices": 2, "batch_size": 4}
    sharded = tiekit.fit(build, Tokens(), strategy="fsdp", **kw)
    reference = tiekit.fit(build, Tokens(), strategy="ddp", **kw)

    assert sharded.ties_kept and sharded.steps == 4
    fresh = build()
    assert _tied_names(sharded.model) == _tied_names(fresh) != []  # a plain model, ties and all
    assert sum(p.numel() for p in sharded.model.parameters()) == sum(p.numel() for p in fresh.parameters())
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if precision == "32-true" else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(torch.tensor(sharded.losses), torch.tensor(reference.losses), **tolerance)
    assert sharded.losses[-1] < sharded.losses[0]


class FailsOnRank1(Tokens):
    """Rank 1 cannot read its 19th sample (step 5 of 4-sample batches); rank 0 reads every one."""

    read = 0

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if torch.distributed.get_rank() == 1:
            FailsOnRank1.read += 1
            if FailsOnRank1.read > 18:
                raise ValueError("rank 1 cannot read this sample")
        return super().__getitem__(i)


@pytest.mark.newest_torch_only  # fit's own logic, the same on both stacks: one run keeps CI short
@pytest.mark.timeout(240)
def test_a_rank_that_fails_while_a_background_save_is_under_way_stops_the_run(tmp_path: Path) -> None:
    """With checkpoint_async (the default) and a save every step, rank 1's failure hung both ranks
    for good (probe scale51): its exit joined its background writer, which waited in DCP's
    collective for rank 0's, which waited for rank 0's training thread, which waited in FSDP's
    all-gather for rank 1. The failed rank's exit waits for its writes only a few seconds."""
    kw: dict[str, Any] = {"max_steps": 12, "batch_size": 4, "progress": False, "checkpoint_every": 1}
    with pytest.raises(tiekit.TiekitError) as raised:
        tiekit.fit(gpt2, FailsOnRank1(), strategy="fsdp", devices=2, checkpoint_dir=tmp_path, **kw)
    message = str(raised.value)
    assert message.startswith("replica 1 (process ") and "ValueError: rank 1 cannot read this sample" in message
    last = message.rpartition('resume="last" would go on from: ')[2]
    assert (Path(last) / "tiekit-dcp.json").exists(), message  # the last committed save, whole
    assert inspect_file(last).plan.groups  # a checkpoint that records its tie


@pytest.mark.newest_torch_only
def test_fsdp_under_torchrun_matches_ddp_checkpoints_and_resumes_bit_identically(tmp_path: Path) -> None:
    options: dict[str, Any] = {"max_steps": 6}
    folder = tmp_path / "checkpoints"
    saving = {"checkpoint_dir": str(folder), "checkpoint_every": 3}
    fsdp = torchrun_one_node(tmp_path, "fsdp", {**options, **saving, "strategy": "fsdp"})
    resumed = torchrun_one_node(
        tmp_path, "resumed", {**options, "strategy": "fsdp", "resume": str(folder / "step-00000003")}
    )
    for straight, again in zip(fsdp, resumed, strict=True):
        assert "error" not in again, again
        for name, value in straight["weights"].items():
            assert torch.equal(torch.tensor(again["weights"][name]), torch.tensor(value)), name

    plain = WeightSharingModule()
    plain.layer_3.weight = nn.Parameter(plain.layer_3.weight.detach().clone())  # broken, as after a move
    tiekit.load_sharded(plain, folder / "step-00000006")
    assert plain.layer_3.weight is plain.layer_1.weight
    for name, value in plain.state_dict().items():
        assert torch.equal(value, torch.tensor(fsdp[0]["weights"][name])), name

    ddp = torchrun_one_node(tmp_path, "ddp", {**options, "strategy": "ddp"})
    for sharded, reference in zip(fsdp, ddp, strict=True):
        assert "error" not in sharded, sharded
        assert (sharded["strategy"], sharded["steps"], sharded["world"]) == ("fsdp", 6, 2)
        assert sharded["ties"]  # each rank's fit returned a plain model with its tie
        torch.testing.assert_close(torch.tensor(sharded["loss_values"]), torch.tensor(reference["loss_values"]))
        for name, value in sharded["weights"].items():
            torch.testing.assert_close(torch.tensor(value), torch.tensor(reference["weights"][name]))


def test_the_sharded_fit_example_runs_on_two_processes() -> None:
    env = base_env()
    env.pop("PJRT_DEVICE", None)
    runs = run_ok([[sys.executable, str(EXAMPLES / "fit_sharded.py")]], env=env, cwd=EXAMPLES)
    output = runs[0].output
    assert "fsdp on 2 devices" in output and "head.weight is embed.weight: True" in output, output


@pytest.mark.newest_torch_only
def test_fsdp_checkpoints_are_sharded_folders_that_resume_bit_identically(tmp_path: Path) -> None:
    # 2 processes x 4 samples: 5 steps per epoch; stop at 7 (mid-epoch), resume to 13.
    kw: dict[str, Any] = {"strategy": "fsdp", "devices": 2, "batch_size": 4, "seed": 1}
    kw |= {"optimizer": ADAMW, "progress": False}
    straight = tiekit.fit(DropoutNet, data(), max_steps=13, **kw)
    first = tiekit.fit(DropoutNet, data(), max_steps=7, checkpoint_dir=tmp_path, checkpoint_every=5, **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005", "step-00000007"]
    assert first.checkpoint == tmp_path / "step-00000007" and tiekit.dcp.is_sharded_checkpoint(first.checkpoint)

    # The control: the weights and optimizer state alone (no data position, no RNG states) do not
    # continue the run.
    naive = DropoutNet()
    optimizer = ADAMW(naive.parameters())
    tiekit.load_sharded(naive, first.checkpoint, optimizer=optimizer)
    restarted = tiekit.fit(naive, data(), max_steps=6, **kw)
    assert not same(weights(restarted.model), weights(straight.model))

    resumed = tiekit.fit(
        DropoutNet,
        data(),
        max_steps=13,
        checkpoint_dir=tmp_path,
        checkpoint_every=5,
        checkpoint_keep=1,
        resume="last",
        **kw,
    )
    # This run wrote 10 and 13 and, continuing the folder (resume="last"), kept the newest of all.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000013"]

    assert resumed.steps == 13 and resumed.losses == straight.losses[7:]
    assert same(weights(resumed.model), weights(straight.model))
    assert resumed.model.c.weight is resumed.model.a.weight


def test_an_fsdp_checkpoint_loads_into_a_plain_model_with_its_tie(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"strategy": "fsdp", "devices": 2, "batch_size": 4, "optimizer": ADAMW, "progress": False}
    result = tiekit.fit(DropoutNet, data(), max_steps=3, checkpoint_dir=tmp_path, **kw)
    assert result.checkpoint == tmp_path / "step-00000003"
    stored = json.loads((result.checkpoint / tiekit.dcp.MARKER_NAME).read_text())["tensors"]
    assert "a.weight" in stored and "c.weight" not in stored  # one copy of the tie group

    plain = DropoutNet()
    plain.c.weight = nn.Parameter(torch.zeros_like(plain.c.weight))  # the tie broken, as a move leaves it
    loaded = tiekit.load_sharded(plain, result.checkpoint)  # one process, no process group
    assert plain.c.weight is plain.a.weight and loaded.extra["step"] == 3
    assert same(weights(plain), weights(result.model))


@pytest.mark.newest_torch_only  # fit's own refusal, the same on both stacks: run once
def test_resume_naming_a_folder_that_is_no_checkpoint_says_what_it_is_on_every_rank(tmp_path: Path) -> None:
    """Found by a probe: on 2 ranks, resume= naming the checkpoint_dir or a save folder inside a
    checkpoint (folders every rank sees) was blamed on node-local storage ("so the ranks would
    resume at different steps ... put checkpoint_dir on storage every node shares"), with a
    FileNotFoundError for a path that exists."""
    kw: dict[str, Any] = {"strategy": "fsdp", "devices": 2, "batch_size": 4, "optimizer": ADAMW, "progress": False}
    saved = tiekit.fit(DropoutNet, data(), max_steps=2, checkpoint_dir=tmp_path / "run", **kw)
    assert saved.checkpoint is not None
    save = next(saved.checkpoint.glob("save-*"))
    cases = [
        (tmp_path / "run", "a checkpoint_dir holding 1 checkpoint(s), the newest step-00000002; pass resume= one of"),
        (save, f"one save inside the sharded checkpoint {saved.checkpoint}; pass that folder"),
    ]
    for path, said in cases:
        with pytest.raises(tiekit.TiekitError) as raised:
            tiekit.fit(DropoutNet, data(), max_steps=4, resume=path, **kw)
        message = str(raised.value)
        assert f"resume: {path} is a folder, not a checkpoint: {said}" in message, message
        assert "node" not in message and "FileNotFoundError" not in message
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-00000002"]  # nothing written


def test_an_fsdp_resume_trains_with_the_options_the_optimizer_was_given(tmp_path: Path) -> None:
    """As on one process (test_train): the factory's lr=0.0 holds after the sharded load, where the
    checkpoint's lr replaced it before (the weights moved on both ranks). The replicas' warning
    reaches the caller, once (a spawned replica's warnings went to its stderr only)."""
    kw: dict[str, Any] = {"strategy": "fsdp", "devices": 2, "batch_size": 4, "progress": False}
    first = tiekit.fit(DropoutNet, data(), max_steps=2, optimizer=ADAMW, checkpoint_dir=tmp_path, **kw)
    assert first.checkpoint is not None
    standing = functools.partial(torch.optim.AdamW, lr=0.0)
    said = r"with the options the optimizer was built with: lr=0\.0 \(the checkpoint's: 0\.01\)"
    with pytest.warns(UserWarning, match=said) as given:
        still = tiekit.fit(DropoutNet, data(), max_steps=4, optimizer=standing, resume=first.checkpoint, **kw)
    assert len([w for w in given if "the options the optimizer was built with" in str(w.message)]) == 1
    assert still.steps == 4 and same(weights(still.model), weights(first.model))
    assert still.model.c.weight is still.model.a.weight


def test_a_sharded_run_refuses_to_resume_from_a_single_file(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"batch_size": 4, "optimizer": ADAMW, "progress": False}
    saved = tiekit.fit(DropoutNet, data(), max_steps=2, devices="cpu", checkpoint_dir=tmp_path, **kw)
    assert saved.checkpoint is not None
    with pytest.raises(tiekit.TiekitError, match="resumes from a sharded checkpoint folder"):
        tiekit.fit(DropoutNet, data(), max_steps=4, strategy="fsdp", devices=2, resume=saved.checkpoint, **kw)


class HalvesInForward(WeightSharingModule):
    """A forward pass that writes a parameter in place (a constraint applied under no_grad)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.layer_2.weight.mul_(0.5)
        return super().forward(x)


def test_fsdp_refuses_a_model_whose_forward_writes_a_gathered_parameter() -> None:
    """Under FSDP2 the write would land in the gathered copy and be lost (measured before this
    check: the weight trained as if never halved, largest entry 0.34 against 0.02 in one process),
    so the first step says so on every rank instead of training another model."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 32, generator=generator), torch.randn(32, 10, generator=generator))
    kw: dict[str, Any] = {"loss_fn": F.mse_loss, "optimizer": ADAMW, "max_steps": 4, "batch_size": 4, "progress": False}
    torch.manual_seed(0)
    built = HalvesInForward().layer_2.weight.detach().abs().max().item()
    one = tiekit.fit(HalvesInForward, data, devices="cpu", **kw)  # the control: in one process the write lands
    assert one.model.layer_2.weight.abs().max().item() < built / 4
    with pytest.raises(tiekit.TiekitError, match=r"the forward pass wrote 'layer_2\.weight' in place: under FSDP2"):
        tiekit.fit(HalvesInForward, data, strategy="fsdp", devices=2, **kw)


class UntiedOnRankOne(WeightSharingModule):
    """Built untied on rank 1 only (as a move without tiekit leaves it), and wider there."""

    def __init__(self, wider: bool = False) -> None:
        super().__init__()
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
            self.layer_3.weight = nn.Parameter(self.layer_3.weight.detach().clone())
            if wider:
                self.layer_2 = nn.Linear(10, 33, bias=False)


def test_ranks_that_build_different_models_are_refused_before_training() -> None:
    """Under FSDP2 rank 1's extra parameter made gloo abort both processes in their first
    collective ("Received data size doesn't match expected size"), before this check (fit makes
    it for every strategy of several ranks, before the model is placed)."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 32, generator=generator), torch.randn(16, 10, generator=generator))
    kw: dict[str, Any] = {"loss_fn": F.mse_loss, "max_steps": 2, "batch_size": 4, "progress": False}
    with pytest.raises(tiekit.TiekitError) as caught:
        tiekit.fit(functools.partial(UntiedOnRankOne, wider=True), data, strategy="fsdp", devices=2, **kw)
    message = str(caught.value)
    assert "the ranks hold different models: " in message and "The model factory must build the same model" in message
    assert "rank 0 ties layer_1.weight = layer_3.weight, rank 1 does not" in message
    assert "key 'layer_2.weight' is (33, 10) float32 on rank 1, (32, 10) float32 on rank 0" in message
