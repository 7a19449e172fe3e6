"""Bad sharded checkpoints (issue 12): `CheckpointError` naming the file and the key, the model
(values, tensor objects, ties) and the optimizer untouched, the files unchanged. One process."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import resource
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from models import assert_unchanged, snapshot
from torch import nn

import tiekit
from tiekit.collective import failure_message
from tiekit.dcp import MARKER_NAME


class Tied(nn.Module):
    def __init__(self, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.mlp = nn.Linear(16, 16)
        self.head = nn.Linear(16, vocab, bias=False)
        self.head.weight = self.embed.weight


def save_folder(path: Path) -> Path:
    (folder,) = path.glob("save-*")
    return folder


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters())
    model.head(model.embed(torch.tensor([1, 2]))).sum().backward()
    optimizer.step()
    tiekit.save_sharded(model, tmp_path / "ck", optimizer=optimizer)
    return tmp_path / "ck"


def files_of(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*")}


def refused(path: Path, pattern: str, model: nn.Module | None = None) -> None:
    """load_sharded raises CheckpointError matching ``pattern``; model, optimizer and files unchanged."""
    torch.manual_seed(1)
    model = model or Tied()
    model.head.weight = nn.Parameter(model.embed.weight.detach() + 1)  # untied: a load must not re-tie it
    optimizer = torch.optim.AdamW(model.parameters())
    before, state, files = snapshot(model), optimizer.state_dict(), files_of(path)
    with pytest.raises(tiekit.CheckpointError, match=pattern) as raised:
        tiekit.load_sharded(model, path, optimizer=optimizer)
    assert "replaced by a newer save" not in str(raised.value)  # nothing committed under the load: no retries
    assert_unchanged(model, before)
    assert model.head.weight is not model.embed.weight
    assert optimizer.state_dict() == state
    assert files_of(path) == files


def test_a_missing_shard_file_is_named_with_its_keys(saved: Path) -> None:
    (save_folder(saved) / "__0_0.distcp").unlink()
    refused(saved, r"save-\w+/__0_0\.distcp: missing shard file of save '\w+' \(holding 'embed\.weight', ")


def test_a_truncated_shard_is_named_with_its_keys(saved: Path) -> None:
    shard = save_folder(saved) / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    refused(saved, rf"__0_0\.distcp: {len(data) // 2} bytes, but save '\w+' wrote {len(data)} .*'embed\.weight'")


def test_a_shard_whose_records_are_corrupt_is_named_in_a_checkpoint_error(saved: Path) -> None:
    """Same size, so validation passes; DCP's reader then fails with its own CheckpointException, a
    BaseException a caller catching Exception or CheckpointError would miss: tiekit raises it as a
    CheckpointError naming the folder and the rank's error."""
    shard = save_folder(saved) / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    # The optimizer's state is read first: its first record is the one named.
    refused(saved, r"__0_0\.distcp: key 'optimizer/state/embed\.weight/step' \(bytes 9\d+ to \d+\) is damaged")


def record_of(path: Path, key: str) -> tuple[Path, int, int]:
    """The shard file holding ``key``'s one record, its offset and length."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    folder = save_folder(path)
    storage = FileSystemReader(folder).read_metadata().storage_data
    (where,) = [where for index, where in storage.items() if index.fqn == key]
    return folder / where.relative_path, where.offset, where.length


def zero_data_header(path: Path, key: str) -> Path:
    """Zero the signature of the zip local header in front of ``key``'s tensor bytes in its record
    (the header ``torch.load`` reads before the bytes), the file's size unchanged; the shard file."""
    import zipfile

    shard, offset, length = record_of(path, key)
    data = bytearray(shard.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(data[offset : offset + length]))) as archive:
        (entry,) = [info for info in archive.infolist() if "/data/" in info.filename]
    start = offset + entry.header_offset
    assert data[start : start + 4] == b"PK\x03\x04"
    data[start : start + 4] = bytes(4)
    shard.write_bytes(bytes(data))
    return shard


def zero_inside_record(path: Path, key: str) -> Path:
    """Zero 64 bytes near the end of ``key``'s record (its zip directory) in its shard file, the
    file's size unchanged; the shard file."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    folder = save_folder(path)
    storage = FileSystemReader(folder).read_metadata().storage_data
    (where,) = [where for index, where in storage.items() if index.fqn == key]
    shard = folder / where.relative_path
    data = bytearray(shard.read_bytes())
    start = where.offset + where.length - 80
    data[start : start + 64] = bytes(64)
    shard.write_bytes(bytes(data))
    return shard


def test_a_damaged_optimizer_record_is_named_by_its_shard_file_and_key(saved: Path) -> None:
    """Bytes zeroed inside one record of the optimizer's state, the file's size unchanged: DCP's
    reader (into new tensors) fails naming neither (``PytorchStreamReader failed reading zip
    archive``); tiekit reads each record of the keys being read until one fails, and names its
    file and key, with DCP's error as the cause."""
    key = "optimizer/state/embed.weight/exp_avg"
    shard = zero_inside_record(saved, key)
    refused(saved, rf"{shard.parent.name}/__0_0\.distcp: key {re.escape(repr(key))} \(bytes \d+ to \d+\) is damaged")
    with pytest.raises(tiekit.CheckpointError) as raised:
        model = Tied()
        tiekit.load_sharded(model, saved, optimizer=torch.optim.AdamW(model.parameters()))
    assert "DCP could not read its shard files" in str(raised.value.__cause__)  # DCP's own error, kept


@pytest.mark.parametrize("key", ["embed.weight", "mlp.weight", "mlp.bias"])
@pytest.mark.parametrize("where", ["directory", "data header"])
def test_a_damaged_model_record_is_found_before_any_weight_is_read(saved: Path, key: str, where: str) -> None:
    """A record of the model's weights damaged in place (its zip directory, or the local header in
    front of its tensor's bytes, which ``torch.load`` reads first), whichever record it is: the
    load names the file and key and leaves every weight as it was. DCP reads record after record
    into the model's own tensors, so without the check before it a damaged later record left the
    earlier ones loaded (the test below shows DCP doing so)."""
    shard = zero_inside_record(saved, key) if where == "directory" else zero_data_header(saved, key)
    refused(
        saved,
        rf"{shard.parent.name}/__0_0\.distcp: key {re.escape(repr(key))} \(bytes \d+ to \d+\) is damaged, its "
        r"record does not read \(.+\); the model is untouched",
    )


@pytest.mark.parametrize("into", ["cpu", "meta"])
@pytest.mark.parametrize("where", ["directory", "data header", "truncated"])
def test_a_damaged_record_of_a_streamed_tensor_is_refused_before_the_model_changes(
    saved: Path, monkeypatch: pytest.MonkeyPatch, into: str, where: str
) -> None:
    """The embedding (3,200 bytes) larger than a staging buffer (here 1 KiB) is streamed from its
    shard file into the model's tensor or a meta model's new one, at the offset its record's data
    header gives: a record damaged there (or its file cut short) is refused like any, naming the
    file and key, before anything is read into the model (a good load streams it: shown first)."""
    import tiekit.dcp.loading
    from tiekit.checkpoint import streaming

    monkeypatch.setattr(tiekit.dcp.loading, "STAGING_BYTES", 1024)
    monkeypatch.setattr(streaming, "STAGING_BYTES", 1024)
    located: list[str] = []
    real = tiekit.dcp.loading.locate_rows
    monkeypatch.setattr(tiekit.dcp.loading, "locate_rows", lambda *a: (r := real(*a), located.extend(r[0]))[0])
    tiekit.load_sharded(Tied(), saved)
    assert located == ["embed.weight"]  # streamed, not read by DCP
    key = "embed.weight"
    if where == "truncated":
        shard, offset, length = record_of(saved, key)
        shard.write_bytes(shard.read_bytes()[: offset + length // 2])
        pattern = r"__0_0\.distcp: \d+ bytes, but save '\w+' wrote \d+ .*'embed\.weight'"
    else:
        shard = zero_inside_record(saved, key) if where == "directory" else zero_data_header(saved, key)
        pattern = r"__0_0\.distcp: key 'embed\.weight' \(bytes \d+ to \d+\) is damaged, its record does not read"
    if into == "cpu":
        refused(saved, pattern)
        return
    with torch.device("meta"):
        model = Tied()
    files = files_of(saved)
    with pytest.raises(tiekit.CheckpointError, match=pattern):
        tiekit.load_sharded(model, saved)
    assert all(t.is_meta for t in model.state_dict().values()) and model.head.weight is model.embed.weight
    assert files_of(saved) == files


def test_a_shard_file_replaced_after_it_was_located_is_refused_before_the_model_changes(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedding is streamed into the CPU model from the offsets found in its shard file, which
    hold for that file only: a save replacing the file between the locating and the reading is a
    `CheckpointError` naming it, raised before DCP reads the other tensors into the model, which
    stays as it was (values and tie)."""
    import tiekit.dcp.loading
    from tiekit.checkpoint import streaming

    monkeypatch.setattr(tiekit.dcp.loading, "STAGING_BYTES", 1024)
    monkeypatch.setattr(streaming, "STAGING_BYTES", 1024)
    real = tiekit.dcp.loading.locate_rows
    replaced: list[str] = []

    def replacing(*args: Any) -> Any:
        located, identities = real(*args)
        for path, entry, _ in located["embed.weight"]:
            data = bytearray(Path(path).read_bytes())
            data[entry.start : entry.start + 64] = bytes(64)  # same size, other values: only its identity tells
            Path(path + ".new").write_bytes(data)
            os.replace(path + ".new", path)
            replaced.append(path)
        return located, identities

    monkeypatch.setattr(tiekit.dcp.loading, "locate_rows", replacing)
    torch.manual_seed(1)
    model = Tied()
    before = snapshot(model)
    with pytest.raises(tiekit.CheckpointError, match=r"__0_0\.distcp: changed on disk") as raised:
        tiekit.load_sharded(model, saved)
    assert replaced and replaced[0] in str(raised.value)
    assert_unchanged(model, before)  # the linear layer too, which DCP would have read first
    assert model.head.weight is model.embed.weight


def test_the_record_check_without_skip_data_reads_fake_tensors(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a torch without ``torch.serialization.skip_data`` (before 2.5) the check reads each
    record under ``FakeTensorMode``: a good checkpoint loads, a damaged record is still refused."""
    monkeypatch.delattr(torch.serialization, "skip_data")
    model = Tied()
    tiekit.load_sharded(model, saved)
    assert model.head.weight is model.embed.weight
    zero_data_header(saved, "mlp.weight")
    refused(saved, r"key 'mlp\.weight' \(bytes \d+ to \d+\) is damaged, its record does not read")


def test_an_io_error_in_the_record_check_names_the_file_not_damage(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that fails in the check (EIO, injected at the shard file's read) is the file's
    failure, not a damaged record: the error says so, the model untouched."""
    import errno

    from tiekit.dcp import chunks

    def failing(self: object, buffer: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(chunks.FileSlice, "readinto", failing)
    refused(saved, r"__0_0\.distcp: unreadable \(Input/output error\) at key '[\w.]+'; the model is untouched")


def test_dcp_alone_leaves_the_records_before_a_damaged_one_loaded(saved: Path) -> None:
    """The control: DCP's own load of the same damage (a later record's zip directory) fails after it
    copied the earlier records into the model."""
    from torch.distributed.checkpoint import FileSystemReader, load

    zero_inside_record(saved, "mlp.weight")
    torch.manual_seed(1)
    model = Tied()
    before = model.embed.weight.detach().clone()
    state = {"embed.weight": model.embed.weight.detach(), "mlp.weight": model.mlp.weight.detach()}
    with pytest.raises(BaseException, match="zip archive"):  # DCP's CheckpointException is one
        load(state, storage_reader=FileSystemReader(save_folder(saved)), no_dist=True)
    assert not torch.equal(model.embed.weight, before)  # the record before the damaged one: loaded


def test_a_shard_file_gone_after_the_checks_is_named_gone_not_damaged(saved: Path) -> None:
    """The file checks passed, then the file went (a newer save's writer deleted the old save)
    before DCP read it: the record search, run on DCP's failure, said "damaged ... its bytes were
    changed in place" of a file that was not there."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from tiekit.dcp.damage import damaged_record

    folder = save_folder(saved)
    metadata = FileSystemReader(folder).read_metadata()
    assert damaged_record(folder, metadata, {"embed.weight"}) is None  # every record reads
    (folder / "__0_0.distcp").unlink()
    found = damaged_record(folder, metadata, {"embed.weight"})
    assert found is not None
    assert str(found).startswith(f"{folder / '__0_0.distcp'}: gone while the load read the checkpoint")
    assert "'embed.weight'" in str(found) and "damaged" not in str(found)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_failed_dcp_write_is_a_checkpoint_error_and_keeps_the_previous_save(
    saved: Path, monkeypatch: pytest.MonkeyPatch, blocking: bool
) -> None:
    """A write DCP fails (a full disk, injected into its writer) comes out as a CheckpointError
    naming the save folder and the rank's error, not DCP's BaseException; the previous save is
    still the one the marker names."""
    from tiekit.dcp.writer import DurableWriter  # the writer save_sharded uses

    before = json.loads((saved / MARKER_NAME).read_text())

    def full_disk(self: DurableWriter, *args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DurableWriter, "write_data", full_disk)
    pattern = r"ck/save-\w+: DCP could not write its shard files: rank 0: OSError: \[Errno 28\] No space left"
    with pytest.raises(tiekit.CheckpointError, match=pattern):
        tiekit.save_sharded(Tied(), saved, blocking=blocking).wait(timeout=60)
    assert json.loads((saved / MARKER_NAME).read_text()) == before
    assert sorted(p.name for p in saved.iterdir()) == [before["folder"], MARKER_NAME]  # its own folder gone
    assert tiekit.load_sharded(Tied(), saved).save_id == before["save_id"]


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_save_whose_planner_left_a_tensor_out_is_not_committed(
    saved: Path, monkeypatch: pytest.MonkeyPatch, blocking: bool
) -> None:
    """A planner that writes none of a tensor without an error (torch_xla 2.9's SPMDSavePlanner did
    so for a tensor replicated over part of a 2-D mesh; here DCP's default planner with that key's
    items dropped): the save is refused at its commit, naming the key, and the previous save stays."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    before = json.loads((saved / MARKER_NAME).read_text())
    planned = DefaultSavePlanner.create_local_plan

    def leaving_out_mlp_weight(self: DefaultSavePlanner) -> object:
        plan = planned(self)
        return dataclasses.replace(plan, items=[i for i in plan.items if i.index.fqn != "mlp.weight"])

    monkeypatch.setattr(DefaultSavePlanner, "create_local_plan", leaving_out_mlp_weight)
    with pytest.raises(
        tiekit.CheckpointError, match=r"does not cover 'mlp\.weight' \(not stored\).*Nothing was committed"
    ):
        tiekit.save_sharded(Tied(), saved, blocking=blocking).wait(timeout=60)
    assert json.loads((saved / MARKER_NAME).read_text()) == before
    assert sorted(p.name for p in saved.iterdir()) == [before["folder"], MARKER_NAME]  # its own folder gone


@pytest.mark.parametrize("blocking", [True, False])
def test_a_shard_file_removed_during_the_save_is_named_removed_not_unshared(
    saved: Path, monkeypatch: pytest.MonkeyPatch, blocking: bool
) -> None:
    """Found by a probe: a save folder deleted by another process while a save ran was refused as
    if the ranks did not share storage ("every rank must save into one folder all of them see"),
    though the file missing is one the committing rank wrote itself."""
    from tiekit.dcp import saving

    before = json.loads((saved / MARKER_NAME).read_text())
    committing = saving.write_marker

    def after_a_removal(root: Path, folder: Path, *args: object) -> None:
        (folder / "__0_0.distcp").unlink()  # another process deleting in the folder
        committing(root, folder, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(saving, "write_marker", after_a_removal)
    said = (
        r"__0_0\.distcp \(missing; written by rank 0, .*; files this rank wrote are gone, so something removed "
        r"them while the save was under way .*Nothing was committed"
    )
    with pytest.raises(tiekit.CheckpointError, match=said) as raised:
        tiekit.save_sharded(Tied(), saved, blocking=blocking).wait(timeout=60)
    assert "shared filesystem" not in str(raised.value)
    assert json.loads((saved / MARKER_NAME).read_text()) == before


@contextlib.contextmanager
def files_limited_to(size: int) -> Iterator[None]:
    """This process may write no file past ``size`` bytes (RLIMIT_FSIZE: the kernel refuses the
    write with EFBIG, as a full disk does with ENOSPC, even for root)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_save_that_fails_while_writing_removes_its_partial_folder(saved: Path, blocking: bool) -> None:
    """A save whose shard file the filesystem cut short used to leave its save-<id>/ folder, holding
    the space a retry needs on a full disk until the next commit. Now it goes; the previous save's
    folder stays and loads."""
    before = json.loads((saved / MARKER_NAME).read_text())
    with files_limited_to(64 * 1024), pytest.raises(tiekit.CheckpointError, match=r"\[Errno 27\] File too large"):
        tiekit.save_sharded(Tied(vocab=4000), saved, blocking=blocking).wait(timeout=60)  # 256 kB embedding
    assert sorted(p.name for p in saved.iterdir()) == [before["folder"], MARKER_NAME]
    assert tiekit.load_sharded(Tied(), saved).save_id == before["save_id"]


def test_dcp_metadata_of_another_model_is_refused_before_unpickling(saved: Path, tmp_path: Path) -> None:
    tiekit.save_sharded(nn.Linear(3, 3), tmp_path / "other")
    shutil.copy(save_folder(tmp_path / "other") / ".metadata", save_folder(saved) / ".metadata")
    refused(saved, r"save-\w+/\.metadata: not the DCP metadata of save .* key 'metadata_sha256'")


def test_dcp_metadata_a_newer_torch_wrote_names_that_torch_when_this_one_cannot_read_it(saved: Path) -> None:
    """A save by torch 2.14 holding a dtype torch 2.9 lacks (bcomplex32) read as damaged on 2.9:
    "unreadable DCP metadata: Can't get attribute 'bcomplex32'" (probe). Here the metadata names
    an attribute no torch has, and the marker says another torch wrote it."""
    metadata = save_folder(saved) / ".metadata"
    metadata.write_bytes(b"ctorch\nbcomplex99\n.")  # a pickle of torch.bcomplex99
    marker = json.loads((saved / MARKER_NAME).read_text())
    marker["metadata_sha256"] = hashlib.sha256(metadata.read_bytes()).hexdigest()
    marker["files"][".metadata"] = metadata.stat().st_size
    (saved / MARKER_NAME).write_text(json.dumps({**marker, "torch": torch.__version__}))
    refused(saved, r"\.metadata: unreadable DCP metadata: .*'bcomplex99'[^(]*$")  # this torch wrote it: not said
    (saved / MARKER_NAME).write_text(json.dumps({**marker, "torch": "2.99.0"}))
    refused(
        saved,
        r"\.metadata: unreadable DCP metadata: .*'bcomplex99'.* \(the save was written by torch 2\.99\.0; "
        + re.escape(f"this is torch {torch.__version__}"),
    )


def test_a_save_folder_or_its_dcp_metadata_gone_is_named_without_retrying(saved: Path, tmp_path: Path) -> None:
    """The marker names a save whose files are gone though nothing replaced it: the load reports
    that, once (it used to read it again, as if a newer save had been committed under it, and say so)."""
    damaged = tmp_path / "damaged"
    shutil.copytree(saved, damaged)
    (save_folder(damaged) / ".metadata").unlink()
    refused(damaged, r"save-\w+/\.metadata: missing \(the DCP metadata of save")
    shutil.rmtree(save_folder(damaged))
    refused(damaged, r"damaged/tiekit-dcp\.json: the save folder .*/damaged/save-\w+ it names is missing")


def test_a_checkpoint_of_another_model_names_the_keys(tmp_path: Path) -> None:
    tiekit.save_sharded(Tied(vocab=60), tmp_path / "bigger")
    refused(tmp_path / "bigger", r"save-\w+: shape mismatch for 'embed.weight': the file has \(60, 16\)")
    tiekit.save_sharded(nn.Sequential(nn.Linear(3, 3)), tmp_path / "seq")
    refused(tmp_path / "seq", r"save-\w+: does not match Tied: missing 'embed\.weight', .*unexpected '0\.weight'")


def edit_marker(path: Path, change: Callable[[dict], None]) -> None:
    marker = json.loads((path / MARKER_NAME).read_text())
    change(marker)
    (path / MARKER_NAME).write_text(json.dumps(marker))


def test_a_plan_that_does_not_match_the_stored_tensors(saved: Path) -> None:
    edit_marker(saved, lambda m: m["plan"]["groups"][0].update(shape=[49, 16]))
    refused(saved, r"tiekit-dcp\.json: key 'plan' says 'embed\.weight' is \(49, 16\) float32, .* stores \(50, 16\)")


def test_a_plan_naming_a_key_that_is_not_stored(saved: Path) -> None:
    def rename(marker: dict) -> None:
        group = marker["plan"]["groups"][0]
        group["source"] = group["members"][0]["name"] = "ghost.weight"

    edit_marker(saved, rename)
    refused(saved, r"key 'plan' names 'ghost\.weight' \(source of head\.weight\), which the checkpoint does not")


def test_a_plan_tying_a_stored_key_of_another_shape_is_named_damaged(saved: Path) -> None:
    """It was reported as the two keys' "different values, but the model ties them" (probe)."""
    edit_marker(saved, lambda m: m["plan"]["groups"][0]["members"][1].update(name="mlp.weight"))
    said = (
        "tiekit-dcp.json: key 'plan' ties 'mlp.weight' to 'embed.weight' ((50, 16) float32), but the checkpoint "
        "stores 'mlp.weight' as (16, 16) float32: a tensor cannot be both; the plan is damaged"
    )
    refused(saved, re.escape(said))


def test_a_marker_without_its_version_is_named_damaged(saved: Path) -> None:
    """It said "format version None is newer than this tiekit reads; upgrade tiekit" (probe)."""
    edit_marker(saved, lambda m: m.pop("version"))
    refused(saved, r"tiekit-dcp\.json: damaged marker: key 'version' is missing$")
    edit_marker(saved, lambda m: m.update(version="1"))
    refused(saved, r"tiekit-dcp\.json: damaged marker: key 'version' is '1', not a format version$")


def test_a_model_whose_ties_disagree_with_the_checkpoint(tmp_path: Path) -> None:
    untied = Tied()
    untied.head.weight = nn.Parameter(untied.embed.weight.detach() * 2)  # stored as two tensors
    tiekit.save_sharded(untied, tmp_path / "untied")
    model = Tied()  # ties them
    before = snapshot(model)
    with pytest.raises(
        tiekit.CheckpointError, match=r"stores 'head\.weight' and 'embed\.weight' with different values"
    ):
        tiekit.load_sharded(model, tmp_path / "untied")
    assert_unchanged(model, before)


def test_different_copies_tied_by_the_markers_plan_blame_the_plan_not_the_model(tmp_path: Path) -> None:
    """A save storing head.weight and embed.weight apart, its marker's plan edited to tie them:
    load_sharded refused into a model without the tie, saying "..., but the model ties them; load
    into a model built without this tie" (probe; convert named the plan). Now the message names
    tiekit-dcp.json's plan as the side that ties them, and says whether the model does too."""
    untied = Tied()
    untied.head.weight = nn.Parameter(untied.embed.weight.detach() * 2)
    tiekit.save_sharded(untied, tmp_path / "ck")

    def tie(marker: dict) -> None:
        member = {"name": "embed.weight", "kind": "parameter"}
        group = {"source": "embed.weight", "kind": "parameter", "shape": [50, 16], "dtype": "float32"}
        marker["plan"]["groups"] = [{**group, "members": [member, {**member, "name": "head.weight"}]}]
        marker["plan"]["unique_count"] -= 1

    edit_marker(tmp_path / "ck", tie)
    said = (
        f"{save_folder(tmp_path / 'ck')}: stores 'head.weight' and 'embed.weight' with different values, but the "
        f"checkpoint's tie plan ({tmp_path / 'ck' / MARKER_NAME}, key 'plan') ties them, {{}}: the plan does not "
        "describe what was saved (edited or damaged). Restore the plan as the save wrote it, or save the checkpoint "
        "again"
    )
    refused(tmp_path / "ck", re.escape(said.format("and the model does not")) + "$")
    model = Tied()
    before = snapshot(model)
    with pytest.raises(tiekit.CheckpointError) as raised:
        tiekit.load_sharded(model, tmp_path / "ck")
    assert str(raised.value) == said.format("as the model does")
    assert_unchanged(model, before)


def test_a_folder_without_a_marker_is_not_a_checkpoint(saved: Path) -> None:
    folder = save_folder(saved)
    refused(folder, r"save-\w+: a save folder inside a checkpoint; load its parent")
    (saved / MARKER_NAME).unlink()
    refused(saved, r"ck: no tiekit-dcp\.json \(not a committed sharded checkpoint\)")


def test_an_optimizer_for_a_checkpoint_without_one(tmp_path: Path) -> None:
    tiekit.save_sharded(Tied(), tmp_path / "weights")
    refused(tmp_path / "weights", r"tiekit-dcp\.json: key 'optimizer': this checkpoint holds no optimizer state")


def test_unstorable_extra_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(tiekit.CheckpointError, match=r"cannot store 'extra/value/fn': a builtin_function_or_method"):
        tiekit.save_sharded(Tied(), tmp_path / "ck", extra={"fn": print})
    assert not list((tmp_path / "ck").glob("save-*")) and not (tmp_path / "ck" / MARKER_NAME).exists()
    # A complex128 buffer: the limit is safetensors' dtypes, kept so that every checkpoint converts.
    model = Tied()
    model.register_buffer("z", torch.ones(2, dtype=torch.complex128))
    said = r"'z' is a torch.strided torch.complex128 tensor, which safetensors cannot store \(tiekit's sharded"
    with pytest.raises(tiekit.CheckpointError, match=said):
        tiekit.save_sharded(model, tmp_path / "ck")
    assert not list((tmp_path / "ck").glob("save-*")) and not (tmp_path / "ck" / MARKER_NAME).exists()


def test_arguments_of_the_wrong_type_are_named_before_anything_is_written(tmp_path: Path) -> None:
    """Swapped paths failed as pathlib's TypeError, a model as the optimizer of save_sharded as an
    AttributeError that left the new folder behind, convert's plan="x" as an AttributeError (probe)."""
    model = Tied()
    with pytest.raises(tiekit.CheckpointError, match=re.escape("tiekit.save_sharded(model, path): path must be")):
        tiekit.save_sharded(tmp_path / "ck", model)  # type: ignore[arg-type]
    said = "tiekit.save_sharded(model, path, optimizer=...): optimizer must be a torch.optim.Optimizer or None"
    with pytest.raises(tiekit.CheckpointError, match=re.escape(said)):
        tiekit.save_sharded(model, tmp_path / "ck", optimizer=model)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
    tiekit.save_sharded(model, tmp_path / "ck")
    with pytest.raises(tiekit.CheckpointError, match=re.escape("tiekit.load_sharded(model, path): path must be")):
        tiekit.load_sharded(tmp_path / "ck", model)  # type: ignore[arg-type]
    before, files = snapshot(model), files_of(tmp_path)
    with pytest.raises(tiekit.CheckpointError, match=re.escape("tiekit.load_sharded(model, path, optimizer=...)")):
        tiekit.load_sharded(model, tmp_path / "ck", optimizer=model)  # type: ignore[arg-type]
    said = "tiekit.convert(src, dst, plan=...): plan must be a tiekit.TiePlan, a model or None, not a str"
    with pytest.raises(tiekit.CheckpointError, match=re.escape(said)):
        tiekit.convert(tmp_path / "ck", tmp_path / "out.safetensors", plan="x")  # type: ignore[arg-type]
    with pytest.raises(tiekit.CheckpointError, match=re.escape("tiekit.convert(src, dst): dst must be")):
        tiekit.convert(tmp_path / "ck", None)  # type: ignore[arg-type]
    assert_unchanged(model, before)
    assert files_of(tmp_path) == files


def test_a_failure_alike_on_several_ranks_is_reported_once_with_their_ranks() -> None:
    # DCP hands every rank the failures of all ranks, so ranks that report what they caught
    # (fit's finish_saves, save_sharded) would repeat that text once per rank.
    dcp = "CheckpointError: save_sharded of /runs/ckpt/step-4 failed: rank 1: 'embed.weight' was written in place"
    message = failure_message("a background checkpoint save", [dcp, dcp, None, "OSError: No space left on device"])
    assert message == (
        f"a background checkpoint save failed on 3 of 4 rank(s): ranks 0, 1: {dcp}; "
        "rank 3: OSError: No space left on device"
    )
    assert message.count(dcp) == 1
    assert failure_message("save", ["OSError: x"]) == "save failed: rank 0: OSError: x"  # one process
    shared = failure_message("collective_save_model", [None, "OSError: x"], ["/a.safetensors", "/b.safetensors"])
    assert shared == "collective_save_model failed on 1 of 2 rank(s): rank 1 (/b.safetensors): OSError: x"


def test_a_torch_whose_dcp_lacks_no_dist_is_refused_by_name(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every DCP call of tiekit passes ``no_dist``, which torch 2.4 to 2.6 lack (a probe on 2.4.1
    and 2.6.0 got DCP's raw ``TypeError`` from every sharded save, load and convert). The tested
    torch has it; a torch without it is a `CheckpointError` naming its version, before DCP writes
    or reads anything: no checkpoint committed, the model and the files untouched."""
    from tiekit.dcp import state

    assert state.dcp_takes_no_dist()  # the torch under test
    monkeypatch.setattr(state, "dcp_takes_no_dist", lambda: False)
    with pytest.raises(tiekit.CheckpointError, match=rf"this torch \({re.escape(torch.__version__)}\) lacks"):
        tiekit.save_sharded(Tied(), tmp_path / "new")
    assert not (tmp_path / "new" / MARKER_NAME).exists()
    assert not list((tmp_path / "new").glob("save-*/*.distcp"))
    refused(saved, r"no_dist, which this torch .* lacks \(torch 2\.4 to 2\.6 do")
