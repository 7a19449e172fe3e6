"""Sharded tied checkpoints (issue 12): `tiekit.save_sharded` / `tiekit.load_sharded` on DCP.

The multi-process runs happen once per module (tests/dcp_worker.py): 2 gloo ranks save (FSDP2
through `tiekit.shard`, DDP, an asynchronous save), then the checkpoints load on 2 and 4 ranks
and in a plain process without a process group; each test reads its part of the findings.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from launching import ROOT, base_env, describe, free_port, run_ok
from models import ExtraStateLM, assert_unchanged, snapshot
from torch import nn

import tiekit

WORKER = str(ROOT / "tests" / "dcp_worker.py")
TIED = ["embed.weight", "head.weight"]


def _run(mode: str, world: int, out: Path) -> list[dict[str, Any]]:
    port = free_port()
    commands = [[sys.executable, WORKER, mode, str(rank), str(world), str(port), str(out)] for rank in range(world)]
    runs = run_ok(commands, env=base_env(), cwd=out)
    found = [json.loads((out / f"{mode}-{world}-rank{rank}.json").read_text()) for rank in range(world)]
    errors = {f"rank {r} {k}": v["error"] for r, f in enumerate(found) for k, v in f.items() if "error" in v}
    assert not errors, "\n".join(f"--- {k}\n{v}" for k, v in errors.items()) + describe(runs)
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """{"save": 2 ranks' findings, "load-1": a plain process's, "load-2", "load-4"}."""
    out = tmp_path_factory.mktemp("dcp")
    found = {"save": _run("save", 2, out)}
    for world in (1, 2, 4):
        found[f"load-{world}"] = _run("load", world, out)
    found["out"] = [{"path": str(out)}]
    return found


# -- bytes on disk: one copy per tie group --------------------------------------------------------


def test_one_copy_per_tie_group_on_disk_and_plain_dcp_writes_both_names(runs: dict[str, Any]) -> None:
    fsdp = runs["save"][0]["fsdp"]
    assert fsdp["dtensor"] == "DTensor" and fsdp["tied"]
    assert fsdp["tiekit_bytes"] <= fsdp["unique_bytes"] * 1.02, fsdp
    # The control: DCP's own save of the same FSDP2 state stores embed.weight and head.weight.
    embed = 4001 * 128 * 4
    assert fsdp["plain_bytes"] >= fsdp["unique_bytes"] + embed, fsdp
    assert fsdp["plain_bytes"] > 1.5 * fsdp["tiekit_bytes"]


# -- resharding: saved by 2 ranks, loaded on 1, 2, 4 -------------------------------------------------


def test_a_record_damaged_in_one_ranks_part_refuses_the_load_on_every_rank_untouched(runs: dict[str, Any]) -> None:
    """Loading on 2 ranks, only rank 1 reads the damaged record (the last of the model's in its
    shard file): its check finds it before DCP reads anything into the model, and every rank
    raises, naming the file and the key; no rank's weights changed (the FSDP2 shards gathered)."""
    for rank, found in enumerate(runs["load-2"]):
        run = found["damaged"]
        assert run["refused"] is not None, run
        assert "__1_0.distcp: key " + repr(run["key"]) in run["refused"], run
        assert "is damaged" in run["refused"] and "the model is untouched" in run["refused"], run
        assert run["changed"] == [] and run["tied"], (rank, run)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_two_rank_checkpoint_loads_on_any_world_size(runs: dict[str, Any], world: int) -> None:
    for found in runs[f"load-{world}"]:
        run = found["fsdp"]
        assert run["tied"] and run["parameters"] == 9, run  # one tensor for embed.weight and head.weight
        assert run["retied"] == [TIED] or world > 1  # a plain model is loaded tied already: re-tying is a no-op
        assert run["difference"] == 0.0, run
        assert run["extra"] == {"step": 2, "note": "fsdp"}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_optimizer_state_resumes(runs: dict[str, Any], world: int) -> None:
    reference = sum(f["fsdp"]["loss_after"] for f in runs["save"]) / 2  # the mean over equal shares
    loaded = sum(f["fsdp"]["loss_after"] for f in runs[f"load-{world}"]) / world
    assert loaded == pytest.approx(reference, rel=1e-5)
    for found in runs[f"load-{world}"]:
        run = found["fsdp"]
        assert run["optimizer_difference"] == 0.0, run
        # The step after the load matches the step the saving run took without a save/load
        # (equal shares of one batch: up to float rounding of the gradient reduction).
        assert run["difference_after_step"] < 1e-5, run
        assert run["tied_after_step"]


@pytest.mark.parametrize("saved", ["fsdp", "ddp"])
def test_convert_of_a_two_rank_save(runs: dict[str, Any], saved: str, tmp_path: Path) -> None:
    # FSDP2: every tensor is two chunks (one per rank), assembled by DCP's reader; DDP: each
    # replicated tensor is one whole chunk, written by one of the ranks and read directly.
    from safetensors.torch import load_file

    out = Path(runs["out"][0]["path"])
    result = tiekit.convert(out / saved, tmp_path / "model.safetensors")
    stored = load_file(tmp_path / "model.safetensors")
    expected = load_file(out / f"{saved}-saved.safetensors")
    assert "head.weight" not in stored and result.stored == tuple(stored)
    assert sorted(stored) == sorted(k for k in expected if k != "head.weight")
    for key, value in stored.items():
        assert torch.equal(value, expected[key]), key


def test_a_plain_process_and_a_meta_model_load_it(runs: dict[str, Any]) -> None:
    meta = runs["load-1"][0]["meta"]
    assert meta["tied"] and meta["device"] == "cpu" and meta["difference"] == 0.0, meta


def test_ddp_wrapped_models_save_under_their_own_names(runs: dict[str, Any]) -> None:
    # Replicated tensors are written once in all (DCP de-duplicates across ranks, spreading them).
    ddp = runs["save"][0]["ddp"]
    assert ddp["bytes"] <= 1.02 * ddp["unique_bytes"], ddp
    for world in (1, 2, 4):
        for found in runs[f"load-{world}"]:
            assert found["ddp"]["tied"] and found["ddp"]["difference"] == 0.0


def test_async_save_commits_when_written_and_training_continues(runs: dict[str, Any]) -> None:
    for found in runs["save"]:
        run = found["async"]
        assert run["done"] and run["changed_meanwhile"]
        assert run["marker_id"] == run["second_id"] != run["first_id"]
        assert run["folders"] == [f"save-{run['second_id']}"]  # the previous save removed after the commit
    for world in (1, 2, 4):
        for found in runs[f"load-{world}"]:
            assert found["async"]["tied"] and found["async"]["difference"] == 0.0  # the state when it was called


def test_a_deferred_copy_torn_on_one_rank_fails_the_save_on_every_rank(runs: dict[str, Any]) -> None:
    """fit's background saves copy parameters and moments beside the next step: rank 1 wrote a
    parameter before its copies settled, so the save failed on both ranks (neither hung), the
    previous save stayed, and the next clean saves hold the values of their call (moments
    included), the moments living in the shard image from the first of them on."""
    for found in runs["save"]:
        run = found["deferred"]
        assert run["torn"] is not None and "rank 1: CheckpointError" in run["torn"], run
        assert "'embed.weight' was written in place" in run["torn"] and "rank 0" not in run["torn"], run
        assert run["marker_after_torn"] == run["first"]
        for save in ("second", "third"):
            assert run[f"{save}_marker"] == run[save] != run["first"]
            assert run[f"{save}_holds_call_values"] == [] and run[f"{save}_changed_since"], (save, run)
        # fit's way (adopt=True): the second save's copies took the moments in (its settle moved
        # them, as DTensors over this rank's image); the third wrote them from there, lent.
        assert not any(run["second_moments_in_image_at_call"]) and all(run["second_moments_in_image"]), run
        assert all(run["third_moments_in_image_at_call"]) and all(run["third_moments_in_image"]), run
        assert run["second_lent"] and run["third_lent"]
        # The third save, of the second's layout, wrote its files as DCP planned the second, without
        # planning again: the same items at the same places, the same metadata (its load above holds
        # the third call's values).
        assert run["second_recipe"] is not None and run["third_recipe"] == run["second_recipe"], run
        assert run["third_metadata"] == run["second_metadata"] and len(run["third_metadata"]) > 10
        # One rank without the recipe: DCP planned the save on both, which holds its call's values.
        assert run["mixed_planned_again"] and run["mixed_holds_call_values"] == [], run
        # A replayed save torn on rank 1 fails on both ranks as a planned one does.
        assert run["replay_torn"] is not None and "rank 1: CheckpointError" in run["replay_torn"], run
        assert "'embed.weight' was written in place" in run["replay_torn"], run
        assert run["marker_after_replay_torn"] == run["mixed"] and not run["replay_torn_recipe"]


def test_a_replicated_tensor_changing_between_background_saves_is_planned_again(runs: dict[str, Any]) -> None:
    """2 ranks, an ``extra`` tensor one rank writes: grown, then of another dtype, then unchanged
    twice. The saves that change it are planned by DCP again, the unchanged ones replayed; each
    loads with its value (a replay of a changed one would not)."""
    for found in runs["save"]:
        run = found["replicated_extras"]
        assert run["loaded"] == [True] * 5, run
        assert run["replayed"] == [False, False, False, True, True], run


def test_errors_are_raised_on_every_rank(runs: dict[str, Any]) -> None:
    for found in runs["save"]:
        errors = found["errors"]
        assert "save_sharded needs the same folder on every rank" in errors["different_paths"]
        assert "rank-path-0" in errors["different_paths"] and "rank-path-1" in errors["different_paths"]
        assert "load_sharded needs the same folder on every rank (rank 0: " in errors["load_different_paths"]
        assert (
            "/paths-a; rank 1: " in errors["load_different_paths"] and "replaced" not in errors["load_different_paths"]
        )
        assert errors["linked"] == "saved and loaded"
        assert "/fsdp/save-" in errors["another_model"]  # the save folder read
        assert (
            "does not match FSDPSequential: missing '0.weight', '0.bias'; unexpected 'embed.weight'"
            in (errors["another_model"])
        )
        assert "failed on" not in errors["another_model"]  # the same error on both ranks: raised as it is
    # Rank 1 wrote where rank 0 cannot see (another host's local disk): rank 0 refuses to commit.
    refused = "the ranks' shard files are not all here: __1_0.distcp (missing; written by rank 1, holding "
    for rank, found in enumerate(runs["save"]):
        not_shared = found["errors"]["not_shared"]
        assert refused in not_shared["blocking"] and "Nothing was committed" in not_shared["blocking"]
        if rank == 1:  # rank 0's own error, named on the rank that wrote its part
            assert "failed on 1 of 2 rank(s): rank 0: CheckpointError" in not_shared["blocking"]
        # In the background only rank 0, which commits, finds out (rank 1's part is written).
        assert (refused in not_shared["async"]) if rank == 0 else not_shared["async"] is None
        assert not_shared["marker"] == not_shared["first"] and not_shared["loads"]
        assert not_shared["save_folders"] == [f"save-{not_shared['first']}"]  # the refused saves' folders gone
    # Rank 1's write fails (its file cut short): every rank raises and removes its part of the folder.
    for found in runs["save"]:
        fails = found["errors"]["write_fails"]
        for mode in ("blocking", "async"):
            assert "rank 1: OSError: [Errno 27] File too large" in fails[mode], fails[mode]
        assert fails["save_folders"] == [f"save-{fails['first']}"]
        assert fails["marker"] == fails["first"] and fails["loads"]


def test_hsdp_on_a_two_dimensional_mesh_loads_saves_each_shard_once_and_keeps_the_tie(runs: dict[str, Any]) -> None:
    for found in runs["load-4"]:
        run = found["hsdp"]
        assert run["placements"] == "(Replicate(), Shard(dim=0))" and run["tied"] and run["difference"] == 0.0
        assert run["bytes"] <= run["unique_bytes"] * 1.02, run  # the replicas' identical shards written once
        assert run["reloaded_tied"] and run["reloaded_difference"] == 0.0
    # The 4 ranks' save loads in this plain process too, tie restored.
    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT / "examples"))
    import shard_fsdp2

    out = Path(runs["out"][0]["path"])
    plain = shard_fsdp2.TiedLM(4001, 128)
    plain.head.weight = nn.Parameter(plain.head.weight.detach().clone())  # broken, as a move leaves it
    tiekit.load_sharded(plain, out / "hsdp")
    assert plain.head.weight is plain.embed.weight
    saved = load_file(out / "hsdp-saved.safetensors")
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in saved.items())


def test_ranks_check_that_they_hold_the_same_model_before_sharding(runs: dict[str, Any]) -> None:
    for found in runs["save"]:
        refused = found["errors"]["same_model"]["refused"]
        assert refused.startswith("the ranks hold different models: rank 0 ties embed.weight = head.weight, rank 1")


def test_a_save_of_ranks_whose_models_differ_is_refused_on_every_rank(runs: dict[str, Any]) -> None:
    for found in runs["save"]:
        run = found["errors"]["disagreeing"]
        differ = "the ranks hold different models (or optimizer states, or extra tensors), so no checkpoint describes"
        untied = "rank 0 ties embed.weight = head.weight, rank 1 does not (moved or loaded without tiekit there?)"
        for case in ("untied", "untied_async", "new"):
            assert differ in run[case] and untied in run[case], run
            assert "rank 1 holds 'head.weight', rank 0 does not" in run[case]
            assert "Nothing was written; the previous checkpoint stays the one loaded" in run[case]
        assert "/disagreeing-new: save " in run["new"] and not run["new_folder_exists"]  # nothing left behind
        shape = "key 'embed.weight' is (4002, 128) float32 on rank 1, (4001, 128) float32 on rank 0. Nothing"
        assert differ in run["shape"] and shape in run["shape"], run["shape"]  # the only difference
        assert run["marker"] == run["first"] and run["loads_first"]
        assert "load_sharded was given an optimizer on rank(s) 0 only" in run["optimizer_on_one_rank"]
        assert run["declared_equal"] == {"tied": True}, run["declared_equal"]
        assert differ in run["declared_changed"]["refused"], run["declared_changed"]
        # The control: without the check the ranks commit the untied model: rank 1's head.weight
        # is stored (only rank 1 holds it) under a plan that ties it to the embedding, so the copy
        # rank 1 trained is dropped, silently, at every load.
        assert run["control_save"] != run["first"]
        assert {"embed.weight", "head.weight"} <= set(run["control_stored"]), run["control_stored"]
        assert run["control_plan"] == [["embed.weight", "head.weight"]]


# -- a single process, no process group ---------------------------------------------------------------


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(300, 64)
        self.mlp = nn.Linear(64, 64)
        self.head = nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mlp(self.embed(ids))))


def test_single_process_roundtrip_with_optimizer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Small()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 300, (4, 8))

    def train_step(m: nn.Module, opt: torch.optim.Optimizer) -> None:
        m(ids).sum().backward()
        opt.step()
        opt.zero_grad()

    train_step(model, optimizer)
    handle = tiekit.save_sharded(model, tmp_path / "ck", optimizer=optimizer, extra={"rng": torch.tensor([1, 2])})
    assert handle.done()
    marker = json.loads((tmp_path / "ck" / "tiekit-dcp.json").read_text())
    assert sorted(k for k in marker["tensors"] if not k.startswith("optimizer/")) == [
        "embed.weight",
        "extra/value/rng",
        "mlp.bias",
        "mlp.weight",
    ]
    assert marker["plan"]["groups"][0]["source"] == "embed.weight"
    assert "optimizer/state/embed.weight/exp_avg" in marker["tensors"]  # stored once, under the source name

    torch.manual_seed(1)
    fresh = Small()
    fresh.head.weight = nn.Parameter(fresh.embed.weight.detach() + 1)  # untied, other values
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    result = tiekit.load_sharded(fresh, tmp_path / "ck", optimizer=fresh_optimizer)
    assert isinstance(result, tiekit.LoadResult) and torch.equal(result.extra["rng"], torch.tensor([1, 2]))
    assert fresh.head.weight is fresh.embed.weight
    assert len(list(fresh.parameters())) == 3
    train_step(model, optimizer)
    held = {id(p) for g in fresh_optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for p in fresh.parameters()}  # rebound to the re-tied parameters
    train_step(fresh, fresh_optimizer)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("meta", [False, True], ids=["real", "meta"])
def test_single_process_tensor_extra_state_reaches_set_extra_state(tmp_path: Path, meta: bool) -> None:
    """save_sharded stored 'mid._extra_state' beside the weights, and load_sharded refused its own
    save as unexpected. Now set_extra_state gets the stored tensor (its dtype, on the CPU), as torch's
    load_state_dict hands it over; the tie is restored beside it."""
    model = ExtraStateLM()
    model.mid.amax = torch.tensor([1.0, 2.5, -3.0, 4.0], dtype=torch.float64)
    tiekit.save_sharded(model, tmp_path / "ck")
    if meta:
        with torch.device("meta"):
            fresh = ExtraStateLM()
    else:
        fresh = ExtraStateLM()
    result = tiekit.load_sharded(fresh, tmp_path / "ck")
    assert result.missing == () and result.unexpected == ()
    (given,) = fresh.mid.given
    assert isinstance(given, torch.Tensor) and torch.equal(given, model.mid.amax)
    assert given.dtype == torch.float64 and given.device.type == "cpu"
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, model.embed.weight)

    plain = ExtraStateLM()
    plain.mid = nn.Module()
    plain.mid.linear = nn.Linear(8, 8)
    with pytest.raises(tiekit.CheckpointError, match=r"does not match ExtraStateLM: unexpected 'mid\._extra_state'$"):
        tiekit.load_sharded(plain, tmp_path / "ck")


def test_single_process_non_tensor_extra_state_is_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(tiekit.CheckpointError, match=r"'mid\._extra_state' is a dict, not a tensor: Scaled\."):
        tiekit.save_sharded(ExtraStateLM("dict"), tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_a_tied_name_the_model_lacks_refuses_the_load(tmp_path: Path) -> None:
    """The checkpoint stores head.weight once, under embed.weight, and its plan names it: a model
    without the head loaded it with nothing unexpected (probe); torch's load_state_dict refuses it."""

    class Headless(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(300, 64)
            self.mlp = nn.Linear(64, 64)

    tiekit.save_sharded(Small(), tmp_path / "ck")
    model = Headless()
    before = snapshot(model)
    with pytest.raises(tiekit.CheckpointError, match=r"save-\w+: does not match Headless: unexpected 'head.weight'$"):
        tiekit.load_sharded(model, tmp_path / "ck")
    assert_unchanged(model, before)


def test_without_tiekit_a_plain_dcp_load_into_an_untied_model_keeps_it_untied(tmp_path: Path) -> None:
    """The control for re-tying: DCP fills both names, as two tensors, and the tie stays broken."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    model = Small()
    save(model.state_dict(), storage_writer=FileSystemWriter(tmp_path / "plain"), no_dist=True)
    fresh = Small()
    fresh.head.weight = nn.Parameter(torch.zeros(300, 64))
    state = fresh.state_dict()
    load(state, storage_reader=FileSystemReader(tmp_path / "plain"), no_dist=True)
    assert fresh.head.weight is not fresh.embed.weight
    tiekit.save_sharded(model, tmp_path / "tied")
    tiekit.load_sharded(fresh, tmp_path / "tied")
    assert fresh.head.weight is fresh.embed.weight


# -- large tensors stream into CPU and meta models -------------------------------------------------


@pytest.fixture
def small_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging buffers of 32 KiB (and down to 1 KiB, not 1 MiB, in proportion to the load): Small's
    embedding (76,800 bytes), not its other tensors, is larger than one, as a 1000 MiB embedding is
    than 16 MiB; it crosses in pieces of 1,200 bytes."""
    import tiekit.dcp.loading
    from tiekit.checkpoint import streaming

    monkeypatch.setattr(tiekit.dcp.loading, "STAGING_BYTES", 1 << 15)
    monkeypatch.setattr(streaming, "STAGING_BYTES", 1 << 15)
    monkeypatch.setattr(streaming, "_SMALLEST_STAGING", 1024)


def streamed_keys(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys load_sharded locates in the shard files to stream (the real `locate_rows` runs)."""
    import tiekit.dcp.loading

    seen: list[str] = []
    real = tiekit.dcp.loading.locate_rows

    def spying(*args: Any) -> Any:
        located, identities = real(*args)
        seen.extend(located)
        return located, identities

    monkeypatch.setattr(tiekit.dcp.loading, "locate_rows", spying)
    return seen


@pytest.mark.parametrize("into", ["cpu", "meta", "cpu-bfloat16", "meta-bfloat16", "cpu-without-skip_data"])
def test_a_large_tensor_streams_into_a_cpu_or_meta_model_with_its_values_and_tie(
    tmp_path: Path, small_staging: None, monkeypatch: pytest.MonkeyPatch, into: str
) -> None:
    """The embedding, larger than a staging buffer, is read from its shard file into the model's
    own tensor (a CPU model) or its new one (a meta model), in pieces cast through a staging buffer
    when the model's dtype is not the file's; the rest through DCP. Values equal the saved ones,
    the tie is one tensor. On a torch without ``skip_data`` (before 2.5) the records are located
    under ``FakeTensorMode``."""
    torch.manual_seed(0)
    saved = Small()
    tiekit.save_sharded(saved, tmp_path / "ck")
    dtype = torch.bfloat16 if into.endswith("bfloat16") else torch.float32
    if into.endswith("without-skip_data"):
        monkeypatch.delattr(torch.serialization, "skip_data")
    torch.manual_seed(1)
    with torch.device("meta" if into.startswith("meta") else "cpu"):
        model = Small().to(dtype)
    model.head.weight = nn.Parameter(torch.zeros_like(model.embed.weight))  # untied: the load re-ties it
    streamed = streamed_keys(monkeypatch)
    tiekit.load_sharded(model, tmp_path / "ck")
    assert streamed == ["embed.weight"]  # the tensor larger than a staging buffer, and only it
    assert model.head.weight is model.embed.weight and len(list(model.parameters())) == 3
    for name, value in saved.state_dict().items():
        loaded = model.state_dict()[name]
        assert loaded.device.type == "cpu" and loaded.dtype == dtype, name
        assert torch.equal(loaded, value.to(dtype)), name


@pytest.mark.parametrize("into", ["cpu", "meta"])
def test_a_large_tensor_of_the_files_dtype_is_read_straight_into_the_models_memory(
    tmp_path: Path, small_staging: None, monkeypatch: pytest.MonkeyPatch, into: str
) -> None:
    """The embedding's bytes go from the shard file straight into the CPU model's tensor (or a meta
    model's new one): every read of them lands in that tensor's memory, none in a staging buffer
    copied from after (the copy that made a 1000 MiB load 2x slower than ``dcp.load``)."""
    import tiekit.checkpoint.reads

    torch.manual_seed(0)
    saved = Small()
    tiekit.save_sharded(saved, tmp_path / "ck")
    with torch.device("meta" if into == "meta" else "cpu"):
        model = Small()
    landed: list[tuple[int, int]] = []  # (address, bytes) of each read of the embedding's bytes
    real = tiekit.checkpoint.reads._read_chunk

    def recording(fd: int, view: memoryview, offset: int, entry: Any, path: str) -> None:
        if entry.name == "embed.weight":
            landed.append((torch.frombuffer(view, dtype=torch.uint8).data_ptr(), len(view)))
        real(fd, view, offset, entry, path)

    monkeypatch.setattr(tiekit.checkpoint.reads, "_read_chunk", recording)
    tiekit.load_sharded(model, tmp_path / "ck")
    weight = model.embed.weight
    assert model.head.weight is weight and torch.equal(weight, saved.embed.weight)
    start, size = weight.data_ptr(), weight.numel() * weight.element_size()
    assert sum(n for _, n in landed) == size, landed  # every byte read once
    assert all(start <= at and at + n <= start + size for at, n in landed), (landed, start, size)


def test_a_load_read_straight_into_a_cpu_model_is_an_in_place_change_to_autograd(
    tmp_path: Path, small_staging: None
) -> None:
    """A graph that saved the embedding before the load (read straight into its memory, not by a
    ``copy_``) refuses to backpropagate after it, as after any in-place change, rather than
    computing gradients from the loaded values."""
    tiekit.save_sharded(Small(), tmp_path / "ck")
    model = Small()
    loss = (model.embed.weight * model.embed.weight).sum()  # saves the weight for backward
    tiekit.load_sharded(model, tmp_path / "ck")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_load_into_a_cpu_or_meta_model_holds_a_staging_buffer_not_the_large_tensor(tmp_path: Path) -> None:
    """Peak RSS growth of a load of a 128 MiB tied embedding, in fresh processes, in units of it
    (measured by ``benchmarks/bench_load_sharded.py``'s own script): into a CPU model, about
    nothing (read straight into the model's memory); into a meta model, the new tensor once.
    The control, plain ``dcp.load`` into the CPU model, reads the record whole before copying
    it: the embedding again. The values are checked by the streaming tests above."""
    spec = importlib.util.spec_from_file_location("bench_load_sharded", ROOT / "benchmarks" / "bench_load_sharded.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    path = tmp_path / "ck"
    bench.peak(path, "save", 128)
    grown = {into: bench.peak(path, into, 128)[0] for into in ("cpu", "meta", "dcp.load")}
    assert grown["dcp.load"] >= 0.9, grown  # the control: DCP holds the record whole
    assert grown["cpu"] <= 0.2, grown
    assert grown["meta"] <= 1.2, grown


GROUPS_AFTER_DESTROY = """
import gc, sys, weakref
import torch, torch.distributed as dist
from torch import nn

out, order, rank, ports = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
if order == "tiekit-first":
    import tiekit
alive = []
for round, port in enumerate(ports):  # a second default group, as a second fit under one launcher makes
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    import tiekit  # the first import here when order is "group-first"
    model = nn.Sequential(nn.Embedding(30, 8), nn.Linear(8, 30, bias=False))
    model[1].weight = model[0].weight
    tiekit.save_sharded(model, f"{out}/ck{round}", blocking=False).wait()
    refs = [weakref.ref(g) for g in dist.distributed_c10d._world.pg_map]  # the save's own group too
    dist.destroy_process_group()
    gc.collect()
    alive.append([len(refs), sum(r() is not None for r in refs)])
print(alive)
"""


def groups_alive_after_destroy(tmp_path: Path, order: str) -> list[list[int]]:
    """[groups made, groups still alive after destroy_process_group] for two rounds of
    init, background sharded save, destroy in two fresh processes (rank 0's count; with one rank
    a save needs no group of its own: DCP coordinates nothing)."""
    ports = [str(free_port()), str(free_port())]
    commands = [
        [sys.executable, "-c", GROUPS_AFTER_DESTROY, str(tmp_path / order), order, str(r), *ports] for r in (0, 1)
    ]
    runs = run_ok(commands, env=base_env(), cwd=tmp_path)
    alive: list[list[int]] = json.loads(runs[0].output.strip().splitlines()[-1])
    assert json.loads(runs[1].output.strip().splitlines()[-1]) == alive
    return alive


def test_a_sharded_save_leaves_no_process_group_alive_after_destroy(tmp_path: Path) -> None:
    """Background sharded saves run their collectives on a gloo group of their own, made once per
    default group: a new default group gets a new one (never a destroyed one found at a recycled
    address), and once the default group is destroyed both are freed (a group alive until
    interpreter exit is destroyed there, where gloo can abort the process). tiekit before kept
    every such group in a dict keyed by id() ([2, 1] in the second round), and torch itself kept
    the first default group in torch.distributed.nn.functional's default arguments, evaluated
    when DCP first imports it: the control, tiekit imported only after the group was made,
    shows torch keeping the first round's two groups; `import tiekit` first imports that module
    while no group exists."""
    assert groups_alive_after_destroy(tmp_path, "tiekit-first") == [[2, 0], [2, 0]]
    first, second = groups_alive_after_destroy(tmp_path, "group-first")
    assert first == [2, 2] and second == [2, 0]
