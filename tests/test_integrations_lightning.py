"""tiekit.integrations.lightning with a real lightning.pytorch Trainer: on the CPU, and on XLA:CPU."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tiekit

pl = pytest.importorskip("lightning.pytorch")
from tiekit.integrations.lightning import KeepTies, TiedCheckpointIO  # noqa: E402 - needs lightning

VOCAB, WIDTH = 16, 8


class TiedViews(pl.LightningModule):
    """A tied LM head plus a buffer that is a view (the transpose) of the tied embedding."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("embed_t", self.embed.weight.detach().t())

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        ids = batch[0]
        hidden = self.embed(ids)
        logits = self.head(hidden) + hidden @ self.embed_t
        return F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams["optimizer"] == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=0.05)
        return torch.optim.SGD(self.parameters(), lr=0.5)


def data() -> DataLoader[Any]:
    ids = torch.randint(0, VOCAB, (16, 6), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids), batch_size=8)  # two steps per epoch


def trainer(tmp_path: Path, **kwargs: Any) -> Any:
    options: dict[str, Any] = dict(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    options.update(kwargs)
    return pl.Trainer(**options)


def is_view_of_transpose(buffer: torch.Tensor, weight: torch.Tensor) -> bool:
    return buffer.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr() and buffer.stride() == (1, WIDTH)


def test_bf16_true_breaks_view_buffers_and_keep_ties_keeps_them(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = TiedViews()
    trainer(tmp_path, precision="bf16-true").fit(plain, data())
    # Lightning's cast replaced the buffer with a bf16 copy: the "view" went stale while training.
    assert plain.embed_t.dtype == torch.bfloat16
    assert not is_view_of_transpose(plain.embed_t, plain.embed.weight)
    assert not torch.equal(plain.embed_t, plain.embed.weight.detach().t())

    torch.manual_seed(0)
    model = TiedViews()
    keep = KeepTies()
    run = trainer(tmp_path, precision="bf16-true", callbacks=[keep])
    run.fit(model, data())
    assert model.embed.weight.dtype == torch.bfloat16 and model.head.weight is model.embed.weight
    assert is_view_of_transpose(model.embed_t, model.embed.weight)
    assert torch.equal(model.embed_t, model.embed.weight.detach().t())  # it followed every step
    assert keep.plan is not None and keep.plan.group_of("embed_t") is not None
    # The optimizer was built after the re-tie: it steps the one tied parameter.
    [optimizer] = run.optimizers
    assert [p for g in optimizer.param_groups for p in g["params"]] == list(model.parameters())
    # The strategy is unwrapped after the run.
    assert "setup" not in vars(run.strategy) and "model_to_device" not in vars(run.strategy)


def test_keep_ties_check_names_a_tie_undone_after_the_move(tmp_path: Path) -> None:
    class Untied(TiedViews):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            # Undone after the move and re-tie (while building the optimizer): the check at fit start fires.
            self.head.weight = nn.Parameter(torch.zeros(VOCAB, WIDTH))
            return super().configure_optimizers()

    model = Untied()
    with pytest.raises(tiekit.TieError, match=r"Before: 1 After: 2\.\n  head\.weight is not embed\.weight"):
        trainer(tmp_path, callbacks=[KeepTies()]).fit(model, data())


class UntiedInConfigureModel(TiedViews):
    def configure_model(self) -> None:
        self.head.weight = nn.Parameter(self.embed.weight.detach().clone())  # a copy: no longer tied


def test_keep_ties_refuses_a_tie_configure_model_undid(tmp_path: Path) -> None:
    # Planned after configure_model only, the broken tie would look intended (control: nothing notices).
    plain = UntiedInConfigureModel()
    trainer(tmp_path).fit(plain, data())
    assert plain.head.weight is not plain.embed.weight

    model = UntiedInConfigureModel()
    before = model.embed.weight
    with pytest.raises(
        tiekit.TieError, match=r"configure_model .* undid ties .*: head\.weight is no longer embed\.weight\. "
    ):
        trainer(tmp_path, callbacks=[KeepTies()]).fit(model, data())
    assert model.embed.weight is before  # refused before the cast and the move

    model = UntiedInConfigureModel()
    with pytest.warns(tiekit.TieWarning, match="head.weight is no longer embed.weight"):
        trainer(tmp_path, callbacks=[KeepTies(on_error="warn")]).fit(model, data())
    # A plan made before fit re-ties what configure_model undid, after the move.
    model = UntiedInConfigureModel()
    trainer(tmp_path, callbacks=[KeepTies(plan=tiekit.find_ties(model))]).fit(model, data())
    assert model.head.weight is model.embed.weight


class Renamed(pl.LightningModule):
    """TiedViews' tie under other module names: a plan made from it names modules TiedViews lacks."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.tokens.weight


def test_keep_ties_refuses_a_plan_that_does_not_fit_before_the_cast(tmp_path: Path) -> None:
    # Found only when re-tying after the move, by then Lightning had cast the module to bf16.
    model = TiedViews()
    with pytest.raises(
        tiekit.TieError, match=r"KeepTies: the plan given does not fit TiedViews \(.*'tokens\.weight'.*"
    ):
        trainer(tmp_path, precision="bf16-true", callbacks=[KeepTies(plan=tiekit.find_ties(Renamed()))]).fit(
            model, data()
        )
    assert model.embed.weight.dtype == torch.float32 and model.embed_t.dtype == torch.float32  # not cast
    assert model.head.weight is model.embed.weight and is_view_of_transpose(model.embed_t, model.embed.weight)


def test_keep_ties_refuses_declared_that_is_no_mapping() -> None:
    # A bare name was dict()'s ValueError ("dictionary update sequence element #0 ...").
    with pytest.raises(tiekit.TieError, match=r"KeepTies: declared maps tied names .*\{target: source\}.*not a str"):
        KeepTies(declared="head.weight")  # type: ignore[arg-type]


def test_keep_ties_with_a_plan_made_before_fit_restores_a_view_the_module_lost(tmp_path: Path) -> None:
    # What ddp_spawn's CPU workers receive (tests/test_lightning_ddp.py): every buffer copied, so
    # the view buffer is a separate tensor before any callback runs.
    def copied_view() -> TiedViews:
        torch.manual_seed(0)
        model = TiedViews()
        model.embed_t = model.embed.weight.detach().t().clone()
        return model

    lost = copied_view()
    trainer(tmp_path, callbacks=[KeepTies()]).fit(lost, data())
    assert not is_view_of_transpose(lost.embed_t, lost.embed.weight)  # planned too late: a copy it stays

    torch.manual_seed(0)
    plan = tiekit.find_ties(TiedViews())  # made from the module as built, before anything copied it
    model = copied_view()
    keep = KeepTies(plan=plan)
    trainer(tmp_path, callbacks=[keep]).fit(model, data())
    assert keep.plan is plan and model.head.weight is model.embed.weight
    assert is_view_of_transpose(model.embed_t, model.embed.weight)
    assert torch.equal(model.embed_t, model.embed.weight.detach().t())  # it followed every step

    with pytest.raises(tiekit.TiekitError, match="declared ties to find_ties"):
        KeepTies(plan=plan, declared={"head.weight": "embed.weight"})


class GPT2Module(pl.LightningModule):
    """The usual pattern: a transformers model held as self.model (declaring lm_head.weight -> wte.weight)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=1, n_embd=8, n_head=2, vocab_size=VOCAB, n_positions=8, bos_token_id=0, eos_token_id=0
        )
        self.model = GPT2LMHeadModel(config)
        # What a plain .to(xla) before the Trainer leaves: two equal copies.
        self.model.lm_head.weight = nn.Parameter(self.model.transformer.wte.weight.detach().clone())

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def test_keep_ties_reties_a_declared_tie_of_a_submodel_a_plain_move_broke(tmp_path: Path) -> None:
    """KeepTies planned with find_ties alone, which reads no declaration (and those of the root
    only), so the GPT-2 trained untied and TiedCheckpointIO stored both copies (probe); tiekit.move
    re-ties such a tie."""
    plain = GPT2Module()
    trainer(tmp_path, max_steps=2).fit(plain, data())
    lm = plain.model
    assert lm.lm_head.weight is not lm.transformer.wte.weight  # the control: trained apart
    assert not torch.equal(lm.lm_head.weight, lm.transformer.wte.weight)

    module = GPT2Module()
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt")
    run = trainer(
        tmp_path,
        max_steps=2,
        enable_checkpointing=True,
        callbacks=[KeepTies(), checkpoints],
        plugins=[TiedCheckpointIO()],
    )
    run.fit(module, data())
    lm = module.model
    assert lm.lm_head.weight is lm.transformer.wte.weight and len(list(module.parameters())) == 16
    with safe_open(checkpoints.best_model_path, "pt") as f:
        stored = set(f.keys())
    assert "model.transformer.wte.weight" in stored and "model.lm_head.weight" not in stored


class Evaluated(TiedViews):
    def validation_step(self, batch: Any, index: int) -> None:
        self.log("val_loss", self.training_step(batch, index))


def test_keep_ties_refuses_a_stage_whose_module_lost_a_tie_since_the_last(tmp_path: Path) -> None:
    """Each stage planned from the module as it then was: a tie broken between fit and validate
    (load_state_dict(assign=True)) was two tensors to the plan, no error, and validation ran untied (probe)."""

    def untie(module: TiedViews) -> None:
        module.load_state_dict({k: v.clone() for k, v in module.state_dict().items()}, assign=True)

    module, keep = Evaluated(), KeepTies()
    run = trainer(tmp_path, callbacks=[keep])
    run.fit(module, data())
    untie(module)
    assert module.head.weight is not module.embed.weight  # the control: assign=True unties
    with pytest.raises(
        tiekit.TieError,
        match=r"KeepTies: at the start of validate, Evaluated no longer holds ties .*: head\.weight is not "
        r"embed\.weight; embed_t is not a view of embed\.weight\. ",
    ):
        run.validate(module, data(), verbose=False)
    tiekit.retie(module, keep.plan)  # tied again as the message says: the stage runs
    run.validate(module, data(), verbose=False)
    assert module.head.weight is module.embed.weight

    del module.head  # a tied name gone is an error too
    with pytest.raises(tiekit.TieError, match=r"no longer holds ties .*'head\.weight': no module at 'head'"):
        run.validate(module, data(), verbose=False)

    # Not errors: a rebuilt part (its module replaced), another module, a warning when asked for.
    module = Evaluated()
    run.fit(module, data())
    module.head = nn.Linear(WIDTH, VOCAB, bias=False)
    run.validate(module, data(), verbose=False)
    assert module.head.weight is not module.embed.weight and keep.plan.group_of("head.weight") is None
    run.validate(Evaluated(), data(), verbose=False)
    module, keep = Evaluated(), KeepTies(on_error="warn")
    run = trainer(tmp_path, callbacks=[keep])
    run.fit(module, data())
    untie(module)
    with pytest.warns(tiekit.TieWarning, match=r"at the start of validate, .*head\.weight is not embed\.weight"):
        run.validate(module, data(), verbose=False)


def test_keep_ties_refuses_bad_arguments_when_made() -> None:
    """A misspelt on_error or a plan that is no TiePlan failed only at the Trainer's setup (or its
    last check, after training), as torch's TypeError or a ValueError from deep inside."""
    with pytest.raises(tiekit.TieError, match=r"KeepTies: on_error must be 'raise' or 'warn', not 'ignore'"):
        KeepTies(on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(tiekit.TiekitError, match=r"KeepTies: plan must be a tiekit.TiePlan \(.*\), not a dict"):
        KeepTies(plan={"groups": []})  # type: ignore[arg-type]


def test_checkpoint_io_writes_tied_safetensors_and_resumes_exactly(tmp_path: Path) -> None:
    # Without tiekit: safetensors refuses a state dict whose tensors share memory.
    with pytest.raises(RuntimeError, match="share memory"):
        weights = {k: v for k, v in TiedViews().state_dict().items() if k != "embed_t"}
        save_file(weights, tmp_path / "plain.safetensors")

    torch.manual_seed(1)
    reference = TiedViews("adamw")
    trainer(tmp_path / "ref", max_steps=-1, max_epochs=2).fit(reference, data())

    torch.manual_seed(1)
    first = TiedViews("adamw")
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, save_on_train_epoch_end=True)
    trainer(
        tmp_path,
        max_steps=-1,
        max_epochs=1,
        plugins=[TiedCheckpointIO()],
        callbacks=[checkpoint],
        enable_checkpointing=True,
    ).fit(first, data())
    path = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"

    with safe_open(path, "pt") as f:  # a safetensors file, whatever its name: no pickle inside
        keys = set(f.keys())
        metadata = f.metadata()
    assert "embed.weight" in keys and "head.weight" not in keys and "embed_t" not in keys
    plan = tiekit.TiePlan.from_json(metadata["tiekit.plan"])
    assert set(plan.group_of("head.weight").names) == {"embed.weight", "head.weight", "embed_t"}  # type: ignore[union-attr]
    record = json.loads(metadata["tiekit.checkpoint"])
    assert record["extra"]["global_step"] == 2 and record["extra"]["hyper_parameters"] == {"optimizer": "adamw"}

    loaded = TiedCheckpointIO().load_checkpoint(path)
    assert loaded["global_step"] == 2 and loaded["hyper_parameters"] == {"optimizer": "adamw"}
    state = loaded["state_dict"]
    assert set(state) == set(first.state_dict())
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()  # tied again in the dict
    assert torch.equal(state["embed_t"], state["embed.weight"].t())
    [opt_state] = loaded["optimizer_states"]
    assert set(opt_state["state"]) == {0} and opt_state["param_groups"][0]["betas"] == (0.9, 0.999)

    # Resume from the tied file: the same weights, bit for bit, as two uninterrupted epochs.
    torch.manual_seed(2)
    resumed = TiedViews("adamw")
    resume = trainer(tmp_path / "resume", max_steps=-1, max_epochs=2, plugins=[TiedCheckpointIO()])
    resume.fit(resumed, data(), ckpt_path=path)
    assert resume.global_step == 4
    assert resumed.head.weight is resumed.embed.weight
    for name, tensor in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name

    # tiekit.load_model reads the same file into a module in any state.
    with torch.device("meta"):
        fresh = TiedViews("adamw")
    result = tiekit.load_model(fresh, path)
    assert result.plan_origin == "tiekit" and fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, state["embed.weight"])

    TiedCheckpointIO().remove_checkpoint(path)
    assert not path.exists()


def test_keep_ties_refuses_tied_checkpoint_io_inside_async_checkpoint_io(tmp_path: Path) -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    def run(folder: str, callbacks: list[Any]) -> Any:
        checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / folder, every_n_train_steps=2, save_top_k=-1)
        plugins = [AsyncCheckpointIO(TiedCheckpointIO())]
        callbacks = [*callbacks, checkpoint]
        return trainer(tmp_path, max_steps=2, plugins=plugins, callbacks=callbacks, enable_checkpointing=True)

    # Control (probe): AsyncCheckpointIO clones each tensor on its own, so the tie reaches the plugin as
    # separate tensors: the file stores every name, its plan records no tie (the copies are equal,
    # so tiekit.load_model takes them back tied, but the file holds the embedding three times).
    run("plain", []).fit(TiedViews(), data())
    [path] = (tmp_path / "plain").iterdir()
    with safe_open(path, "pt") as f:
        assert {"embed.weight", "head.weight", "embed_t"} <= set(f.keys())
        assert tiekit.TiePlan.from_json(f.metadata()["tiekit.plan"]).groups == ()

    # With KeepTies: refused when the run starts, before any step; nothing trained, nothing written.
    model = TiedViews()
    before = model.embed.weight.detach().clone()
    refused = run("refused", [KeepTies()])
    refusal = r"TiedCheckpointIO inside Lightning's AsyncCheckpointIO .*plugins=\[TiedCheckpointIO\(\)\]"
    with pytest.raises(tiekit.TiekitError, match=refusal):
        refused.fit(model, data())
    assert refused.global_step == 0 and not (tmp_path / "refused").exists()
    assert torch.equal(model.embed.weight, before) and model.head.weight is model.embed.weight


def test_keep_ties_refuses_wrapped_tied_checkpoint_io_under_model_parallel_strategy(tmp_path: Path) -> None:
    # The bare plugin is refused under this strategy (tests/test_lightning_fsdp2.py); wrapped in
    # AsyncCheckpointIO it was not (probe). One process is enough: the refusal comes before any step.
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from lightning.pytorch.strategies import ModelParallelStrategy

    class Configured(TiedViews):
        def configure_model(self) -> None:
            pass  # the strategy requires the hook; one process has nothing to shard

    run = trainer(
        tmp_path, strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), callbacks=[KeepTies()]
    )
    run.strategy.checkpoint_io = AsyncCheckpointIO(TiedCheckpointIO())
    environment = dict(os.environ)
    try:
        with pytest.raises(tiekit.TiekitError, match="TiedCheckpointIO does not work under ModelParallelStrategy"):
            run.fit(Configured(), data())
    finally:
        if torch.distributed.is_initialized():  # the strategy's one-process group, left open by Lightning
            torch.distributed.destroy_process_group()
        # Lightning set WORLD_SIZE, LOCAL_RANK and the rendezvous address in this process: processes
        # later tests launch would take themselves for ranks of this run, and wait for the others.
        os.environ.clear()
        os.environ.update(environment)
    assert run.global_step == 0


def test_checkpoint_io_records_identity_ties_as_identity_and_real_views_as_views(tmp_path: Path) -> None:
    # Lightning's state_dict holds a detached tensor per name: head.weight and embed.weight are
    # two objects over one memory, as are the view buffers. The file must record head.weight as
    # the same tensor as embed.weight (an identity tie), and only the real views as views.
    model = TiedViews()
    model.register_buffer("embed_cols", model.embed.weight.detach()[:, 2:5])  # a slice: a real view
    state = model.state_dict()
    assert state["head.weight"] is not state["embed.weight"]
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()
    path = tmp_path / "step.ckpt"
    TiedCheckpointIO().save_checkpoint({"state_dict": state, "global_step": 1}, path)

    with safe_open(path, "pt") as f:
        assert set(f.keys()) == {"embed.weight"}
        plan = tiekit.TiePlan.from_json(f.metadata()["tiekit.plan"])
    [group] = plan.groups
    views = {m.name: m.view for m in group.members}
    assert views["head.weight"] is None  # not a "view" covering the whole source
    assert views["embed_t"] is not None and views["embed_t"].stride == (1, WIDTH)
    assert views["embed_cols"] is not None and views["embed_cols"].size == (VOCAB, 3)
    assert views["embed_cols"].offset == 2

    # Loaded into a module whose tie is broken: the same Parameter object again, views as views.
    broken = TiedViews()
    broken.register_buffer("embed_cols", torch.zeros(VOCAB, 3))
    broken.head.weight = nn.Parameter(torch.zeros(VOCAB, WIDTH))
    tiekit.load_model(broken, path)
    assert broken.head.weight is broken.embed.weight and len(list(broken.parameters())) == 1
    assert is_view_of_transpose(broken.embed_t, broken.embed.weight)
    assert broken.embed_cols.data_ptr() == broken.embed.weight.data_ptr() + 2 * broken.embed.weight.element_size()
    assert torch.equal(broken.embed.weight, model.embed.weight)
    assert torch.equal(broken.embed_cols, model.embed.weight[:, 2:5])

    # And back into Lightning's dict: every name, the identity tie one tensor object again (as
    # the docstring says; it was a detached copy per name over one memory), views as views.
    for map_location in (None, "cpu"):
        loaded = TiedCheckpointIO().load_checkpoint(path, map_location=map_location)["state_dict"]
        assert set(loaded) == set(state) and loaded["embed_cols"].shape == (VOCAB, 3)
        assert loaded["head.weight"] is loaded["embed.weight"]
        assert is_view_of_transpose(loaded["embed_t"], loaded["embed.weight"])
        embed = loaded["embed.weight"]
        assert loaded["embed_cols"].data_ptr() == embed.data_ptr() + 2 * embed.element_size()


@pytest.mark.xla
def test_checkpoint_io_map_location_xla_keeps_tied_names_one_tensor_and_views_views(
    tmp_path: Path, xla_device: torch.device
) -> None:
    model = TiedViews()
    state = model.state_dict()
    # Without tiekit: each name of Lightning's state dict copied to the device on its own is its
    # own copy there, and an in-place edit of the embedding reaches neither the head nor the view.
    apart = {name: tensor.to(xla_device) for name, tensor in state.items()}
    with torch.no_grad():
        apart["embed.weight"].add_(1.0)
    assert not torch.equal(apart["head.weight"].cpu(), apart["embed.weight"].cpu())
    assert not torch.equal(apart["embed_t"].cpu(), apart["embed.weight"].cpu().t())

    path = tmp_path / "step.ckpt"
    TiedCheckpointIO().save_checkpoint({"state_dict": state, "opt": {"step": torch.tensor(2.0)}}, path)
    loaded = TiedCheckpointIO().load_checkpoint(path, map_location=xla_device)
    tensors = loaded["state_dict"]
    assert {t.device.type for t in tensors.values()} == {"xla"} and loaded["opt"]["step"].device.type == "xla"
    assert tensors["head.weight"] is tensors["embed.weight"]
    with torch.no_grad():
        tensors["embed.weight"].add_(1.0)
    assert torch.equal(tensors["embed.weight"].cpu(), model.embed.weight.detach() + 1.0)
    assert torch.equal(tensors["embed_t"].cpu(), tensors["embed.weight"].cpu().t())  # the view followed


def test_checkpoint_io_round_trips_lightning_entries_and_refuses_pickle(tmp_path: Path) -> None:
    shared = torch.arange(6.0).reshape(2, 3)
    checkpoint = {
        "state_dict": {"a.weight": shared, "b.weight": shared, "c": torch.ones(2)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"params": [0], "lr": 0.1}]}],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}}},
        "hyper_parameters": {"dtype": torch.bfloat16, "device": torch.device("cpu"), "sizes": (1, 2), "none": None},
        "best": float("inf"),
    }
    io = TiedCheckpointIO()
    io.save_checkpoint(checkpoint, tmp_path / "x.ckpt")
    loaded = io.load_checkpoint(tmp_path / "x.ckpt", map_location="cpu")
    assert loaded["hyper_parameters"] == checkpoint["hyper_parameters"]
    assert loaded["loops"] == checkpoint["loops"] and loaded["best"] == float("inf")
    assert torch.equal(loaded["optimizer_states"][0]["state"][0]["step"], torch.tensor(3.0))
    assert loaded["state_dict"]["a.weight"].data_ptr() == loaded["state_dict"]["b.weight"].data_ptr()
    with safe_open(tmp_path / "x.ckpt", "pt") as f:
        assert "b.weight" not in set(f.keys())

    checkpoint["hyper_parameters"] = {"args": argparse.Namespace(lr=0.1)}
    with pytest.raises(tiekit.CheckpointError, match=r"hyper_parameters/args.*Namespace.*allow_pickle"):
        io.save_checkpoint(checkpoint, tmp_path / "y.ckpt")
    assert not (tmp_path / "y.ckpt").exists()
    TiedCheckpointIO(allow_pickle=True).save_checkpoint(checkpoint, tmp_path / "y.ckpt")
    with pytest.raises(tiekit.CheckpointError, match="pickled value"):
        io.load_checkpoint(tmp_path / "y.ckpt")
    # A string from a config file is truthy: allow_pickle="false" unpickled the file.
    with pytest.raises(tiekit.TiekitError, match=r"TiedCheckpointIO: allow_pickle must be True or False, not 'false'"):
        TiedCheckpointIO(allow_pickle="false")  # type: ignore[arg-type]
    again = TiedCheckpointIO(allow_pickle=True).load_checkpoint(tmp_path / "y.ckpt")
    assert again["hyper_parameters"]["args"] == argparse.Namespace(lr=0.1)
    with pytest.raises(tiekit.TiekitError, match="storage_options"):
        io.save_checkpoint(checkpoint, tmp_path / "z.ckpt", storage_options={"compress": True})
    assert not (tmp_path / "z.ckpt").exists()
    # A device string torch does not know was torch's RuntimeError; a number was a TypeError.
    with pytest.raises(tiekit.TiekitError, match=r"map_location 'gpu' is not a device"):
        io.load_checkpoint(tmp_path / "x.ckpt", map_location="gpu")
    with pytest.raises(tiekit.TiekitError, match=r"map_location must be a device or a string, not 3"):
        io.load_checkpoint(tmp_path / "x.ckpt", map_location=3)
    # A device this machine lacks was named a failed conversion of a model (adversarial probe).
    absent = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(tiekit.CheckpointError, match=rf"x\.ckpt: map_location: cannot load onto device '{absent}'"):
        io.load_checkpoint(tmp_path / "x.ckpt", map_location=absent)


class Scale(nn.Module):
    """A submodule with extra state (``get_extra_state``), as quantisation and FP8 modules keep metadata."""

    def __init__(self, extra: Any) -> None:
        super().__init__()
        self.extra = extra
        self.restored: Any = None

    def get_extra_state(self) -> Any:
        return self.extra

    def set_extra_state(self, state: Any) -> None:
        self.restored = state


class Opaque:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque)


class WithExtraState(TiedViews):
    def __init__(self, extra: Any = None) -> None:
        super().__init__()
        self.mid = Scale(extra)


def test_checkpoint_io_stores_and_restores_extra_state(tmp_path: Path) -> None:
    # The state dict holds 'mid._extra_state' (a dict, or a tensor) beside the tensors: it was refused
    # whole ("'state_dict' must map names to tensors", allow_pickle or not), naming no key.
    for name, extra in {"dict": {"scale": 1.5, "axes": [0, 1]}, "tensor": torch.tensor([1.5, 2.0])}.items():
        checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / name, save_top_k=-1)
        trainer(
            tmp_path, max_steps=2, plugins=[TiedCheckpointIO()], callbacks=[checkpoint], enable_checkpointing=True
        ).fit(WithExtraState(extra), data())
        path = tmp_path / name / "epoch=0-step=2.ckpt"
        resumed = WithExtraState(None)
        resume = trainer(tmp_path / f"resume_{name}", max_steps=4, plugins=[TiedCheckpointIO()])
        resume.fit(resumed, data(), ckpt_path=path)
        assert resume.global_step == 4 and resumed.head.weight is resumed.embed.weight
        restored = resumed.mid.restored
        assert torch.equal(restored, extra) if isinstance(extra, torch.Tensor) else restored == extra, name

    # A value JSON cannot hold is refused naming the entry, and pickled with allow_pickle=True.
    model = WithExtraState(Opaque())
    state = {"state_dict": model.state_dict(), "global_step": 1}
    with pytest.raises(tiekit.CheckpointError, match=r"'state_dict/mid\._extra_state': a Opaque.*allow_pickle"):
        TiedCheckpointIO().save_checkpoint(state, tmp_path / "opaque.ckpt")
    assert not (tmp_path / "opaque.ckpt").exists()
    TiedCheckpointIO(allow_pickle=True).save_checkpoint(state, tmp_path / "opaque.ckpt")
    loaded = TiedCheckpointIO(allow_pickle=True).load_checkpoint(tmp_path / "opaque.ckpt")
    assert set(loaded["state_dict"]) == set(state["state_dict"]) and "tiekit_state_dict_values" not in loaded
    assert loaded["state_dict"]["mid._extra_state"] == Opaque() and loaded["global_step"] == 1
    # One pickle cannot hold (a local class) was pickle's AttributeError, naming no entry.
    unpicklable = {"state_dict": {**state["state_dict"], "mid._extra_state": type("Local", (), {})()}}
    with pytest.raises(tiekit.CheckpointError, match=r"'state_dict/mid\._extra_state': pickling its Local failed"):
        TiedCheckpointIO(allow_pickle=True).save_checkpoint(unpicklable, tmp_path / "local.ckpt")
    assert not (tmp_path / "local.ckpt").exists()


def test_checkpoint_io_refuses_url_paths_writing_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A URL became a relative local path: ModelCheckpoint(dirpath="memory://ckpts") recorded
    # 'memory://ckpts/epoch=0-step=2.ckpt' while the file went to ./memory:/ckpts/, silently.
    monkeypatch.chdir(tmp_path)

    def run(callbacks: list[Any]) -> Any:
        checkpoint = pl.callbacks.ModelCheckpoint(dirpath="memory://tiekit-test/ckpts")
        options = dict(max_steps=2, plugins=[TiedCheckpointIO()], enable_checkpointing=True)
        return trainer(tmp_path, callbacks=[*callbacks, checkpoint], **options)

    alone = run([])
    with pytest.raises(tiekit.TiekitError, match=r"local files only; got the URL 'memory://tiekit-test/ckpts/epoch"):
        alone.fit(TiedViews(), data())
    assert not list(tmp_path.rglob("*.ckpt")) and not (tmp_path / "memory:").exists()
    # KeepTies sees the callback's folder: refused when fit starts, before any step.
    early = run([KeepTies()])
    with pytest.raises(tiekit.TiekitError, match=r"got the URL 'memory://tiekit-test/ckpts'"):
        early.fit(TiedViews(), data())
    assert early.global_step == 0

    io = TiedCheckpointIO()
    checkpoint = {"state_dict": {"w": torch.ones(2)}}
    for url in ("s3://bucket/x.ckpt", "gs://bucket/x.ckpt", "file:///tmp/x.ckpt", "simplecache::s3://bucket/x.ckpt"):
        with pytest.raises(tiekit.TiekitError, match="local files only"):
            io.save_checkpoint(checkpoint, url)
        with pytest.raises(tiekit.TiekitError, match="local files only"):
            io.load_checkpoint(url)
        with pytest.raises(tiekit.TiekitError, match="local files only"):
            io.remove_checkpoint(url)
    assert not [p for p in tmp_path.iterdir() if ":" in p.name]


def test_checkpoint_io_reads_files_of_the_earlier_encoding(tmp_path: Path) -> None:
    """Before the codec was shared, a pickled value was a tensor inside the marker object."""
    checkpoint = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"args": argparse.Namespace(lr=0.1)}}
    TiedCheckpointIO(allow_pickle=True).save_checkpoint(checkpoint, tmp_path / "new.ckpt")
    with safe_open(tmp_path / "new.ckpt", "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    text = metadata["tiekit.checkpoint"]
    key = "extra/value/hyper_parameters/args"
    assert f'{{"__pickle__":"{key}"}}' in text
    metadata["tiekit.checkpoint"] = text.replace(
        f'{{"__pickle__":"{key}"}}', f'{{"__pickle__":{{"__tensor__":"{key}"}}}}'
    )
    save_file(tensors, tmp_path / "old.ckpt", metadata=metadata)
    loaded = TiedCheckpointIO(allow_pickle=True).load_checkpoint(tmp_path / "old.ckpt")
    assert loaded["hyper_parameters"]["args"] == argparse.Namespace(lr=0.1)


def test_checkpoint_io_durable_false_skips_only_the_fsyncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:  # counts, then syncs for real
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    checkpoint = {"state_dict": {"w": torch.ones(3)}, "epoch": 1}
    with pytest.raises(tiekit.TiekitError, match=r"TiedCheckpointIO: durable must be True or False, not 'false'"):
        TiedCheckpointIO(durable="false")  # type: ignore[arg-type]
    TiedCheckpointIO(durable=False).save_checkpoint(checkpoint, tmp_path / "fast.ckpt")
    assert synced == []
    TiedCheckpointIO().save_checkpoint(checkpoint, tmp_path / "durable.ckpt")
    assert len(synced) >= 2  # the file, then its folder
    for name in ("fast.ckpt", "durable.ckpt"):
        loaded = TiedCheckpointIO().load_checkpoint(tmp_path / name)
        assert loaded["epoch"] == 1 and torch.equal(loaded["state_dict"]["w"], torch.ones(3))


@pytest.mark.xla
def test_lightning_xla_strategy_breaks_ties_and_keep_ties_keeps_them(tmp_path: Path) -> None:
    import torch_xla
    from lightning.pytorch.accelerators import XLAAccelerator
    from lightning.pytorch.strategies import SingleDeviceXLAStrategy

    class XLACPUAccelerator(XLAAccelerator):
        # Lightning counts TPU chips to decide whether XLA is available; XLA:CPU has none.
        # Everything else (the strategy's cast, move, set_shared_parameters, teardown) is Lightning's own.
        @staticmethod
        def is_available() -> bool:
            return True

        @staticmethod
        def parse_devices(devices: Any) -> int:
            return 1

        @staticmethod
        def get_parallel_devices(devices: Any) -> list[torch.device]:
            return [torch_xla.device()]

    def xla_trainer(**kwargs: Any) -> Any:
        strategy = SingleDeviceXLAStrategy(device=torch_xla.device())
        return trainer(tmp_path, accelerator=XLACPUAccelerator(), strategy=strategy, max_steps=2, **kwargs)

    seen: dict[str, Any] = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            w, t = module.embed.weight, module.embed_t
            seen["device"] = w.device.type
            seen["view"] = tiekit.devices.storage_key(t) == tiekit.devices.storage_key(w)

    torch.manual_seed(0)
    plain = TiedViews()
    xla_trainer(callbacks=[Probe()]).fit(plain, data())
    assert seen == {"device": "xla", "view": False}  # set_shared_parameters keeps parameters, not buffers
    # Teardown's .cpu() broke the parameter tie too, and nothing re-tied it.
    assert plain.head.weight is not plain.embed.weight and len(list(plain.parameters())) == 2

    torch.manual_seed(0)
    model = TiedViews()
    initial = model.embed.weight.detach().clone()
    xla_trainer(callbacks=[Probe(), KeepTies()]).fit(model, data())
    assert seen == {"device": "xla", "view": True}
    assert model.embed.weight.device.type == "cpu"
    assert model.head.weight is model.embed.weight and len(list(model.parameters())) == 1
    assert is_view_of_transpose(model.embed_t, model.embed.weight)
    assert torch.equal(model.embed_t, model.embed.weight.detach().t())
    assert not torch.equal(model.embed.weight, initial)  # it trained on the device, then came back tied
