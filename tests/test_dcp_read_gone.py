"""`inspect --check-values` and `convert` of a sharded folder whose files go away while they read
it: a newer save committed meanwhile (a trainer saving beside an evaluator) is read instead, as
`load_sharded` does; files gone otherwise are a `CheckpointError` naming the file, never a raw
``FileNotFoundError``. And a convert's source failing while the destination is written is named
itself, not blamed on the destination."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tiekit
from tiekit.dcp import layout, stream
from tiekit.dcp.layout import committed_save_id
from tiekit.inspection import inspect_file

# What convert reads through (inspect too).
converting = importlib.import_module("tiekit.dcp.convert_source")

#: The reader's steps another process may act just before: the marker's check of DCP's metadata,
#: DCP's metadata read, the shard files read.
READ_STEPS = ["layout.file_sha256", "dcp_read", "read_rows"]


def tied(seed: int) -> nn.Module:
    """A tied model with two tensors of one shape (which ``check_values`` reads to compare)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(40, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 40, bias=False))
    model[3].weight = model[0].weight
    return model


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    tiekit.save_sharded(tied(0), tmp_path / "ck")
    return tmp_path / "ck"


def before_first(monkeypatch: pytest.MonkeyPatch, step: str, act: Callable[[], None]) -> None:
    """``act()`` (what another process does) runs once, just before the reader's first call of
    ``step`` (a function of `tiekit.dcp.convert_source`, which inspect uses too; ``layout.<name>``: of
    `tiekit.dcp.layout`)."""
    module, name = (layout, step.removeprefix("layout.")) if step.startswith("layout.") else (converting, step)
    real = getattr(module, name)
    calls: list[int] = []

    def first_acting(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            act()
        return real(*args)

    monkeypatch.setattr(module, name, first_acting)


@pytest.mark.parametrize("step", READ_STEPS)
def test_inspect_check_values_of_a_folder_saved_over_meanwhile_reads_the_new_save(
    folder: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    first = committed_save_id(folder)
    before_first(monkeypatch, step, lambda: tiekit.save_sharded(tied(1), folder))
    report = inspect_file(folder, check_values=True)  # raised FileNotFoundError of the old save's files
    assert report.metadata["save_id"] == committed_save_id(folder) != first
    assert report.identical == ()


@pytest.mark.parametrize("step", READ_STEPS)
def test_convert_of_a_folder_saved_over_meanwhile_converts_the_new_save(
    folder: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    before_first(monkeypatch, step, lambda: tiekit.save_sharded(tied(1), folder))
    tiekit.convert(folder, folder.parent / "model.safetensors")
    model = tied(2)
    tiekit.load_model(model, folder.parent / "model.safetensors")
    for (name, got), want in zip(model.state_dict().items(), tied(1).state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def remove(folder: Path, pattern: str) -> Callable[[], None]:
    """Removes the committed save's files matching ``pattern`` (a deleted or unreachable source)."""

    def act() -> None:
        for file in folder.glob(f"save-*/{pattern}"):
            file.unlink()

    return act


GONE = [
    ("layout.file_sha256", ".metadata", r"save-\w+/\.metadata: cannot be read \(the DCP metadata of save '\w+'\)"),
    ("dcp_read", ".metadata", r"save-\w+/\.metadata: missing \(the DCP metadata of "),
    ("read_rows", "*.distcp", r"save-\w+/__\d+_\d+\.distcp: missing shard file, holding key '"),
]


@pytest.mark.parametrize(("step", "pattern", "said"), GONE, ids=["checked metadata", "metadata", "shard"])
def test_inspect_check_values_names_a_file_removed_while_it_reads(
    folder: Path, monkeypatch: pytest.MonkeyPatch, step: str, pattern: str, said: str
) -> None:
    before_first(monkeypatch, step, remove(folder, pattern))
    with pytest.raises(tiekit.CheckpointError, match=re.escape(str(folder)) + "/" + said):
        inspect_file(folder, check_values=True)


@pytest.mark.parametrize(("step", "pattern", "said"), GONE, ids=["checked metadata", "metadata", "shard"])
def test_convert_names_a_source_file_removed_while_it_reads(
    folder: Path, monkeypatch: pytest.MonkeyPatch, step: str, pattern: str, said: str
) -> None:
    """The shard files' read error was "<dst>: cannot write: No such file or directory"."""
    before_first(monkeypatch, step, remove(folder, pattern))
    dst = folder.parent / "out" / "model.safetensors"
    with pytest.raises(tiekit.CheckpointError, match=re.escape(str(folder)) + "/" + said):
        tiekit.convert(folder, dst)
    assert sorted(p.name for p in folder.parent.iterdir()) == ["ck"]  # nothing left at the destination


def test_convert_names_a_source_file_removed_after_the_first_batch(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One tensor per batch; the shard files go after the first was written into the destination."""
    real = converting.dcp_read

    def dcp_read(save: Path) -> Callable[[list[str]], dict]:
        read = real(save)
        calls: list[int] = []

        def batch(keys: list[str]) -> dict:
            calls.append(1)
            if len(calls) == 2:
                remove(folder, "*.distcp")()
            return read(keys)

        return batch

    monkeypatch.setattr(converting, "dcp_read", dcp_read)
    monkeypatch.setattr(importlib.import_module("tiekit.dcp.convert"), "READ_BATCH_BYTES", 1)
    with pytest.raises(tiekit.CheckpointError) as raised:
        tiekit.convert(folder, folder.parent / "out.safetensors")
    assert re.match(re.escape(str(folder)) + r"/save-\w+/__\d+_\d+\.distcp: missing shard file", str(raised.value))
    assert sorted(p.name for p in folder.parent.iterdir()) == ["ck"]


def test_a_refused_merge_in_a_convert_to_a_sharded_folder_is_the_sources_error(tmp_path: Path) -> None:
    """It was "<dst>/save-<id>: DCP could not write its shard files: rank 0: CheckpointError: <src>:
    refusing to merge ...", naming a folder the failed convert had removed."""
    from safetensors.torch import save_file

    broken = {"0.weight": torch.zeros(40, 16), "3.weight": torch.ones(40, 16)}  # a tie broken and trained
    save_file(broken, tmp_path / "broken.safetensors")
    said = re.escape(f"{tmp_path / 'broken.safetensors'}: refusing to merge tied keys '3.weight' and '0.weight'")
    with pytest.raises(tiekit.CheckpointError, match=f"^{said}"):
        tiekit.convert(tmp_path / "broken.safetensors", tmp_path / "new" / "ck", plan=tied(0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.safetensors"]


@pytest.mark.parametrize("destination", ["safetensors", "dcp"])
def test_a_tensor_source_failing_while_it_is_written_is_named_not_the_destination(
    tmp_path: Path, destination: str
) -> None:
    """The second tensor to write is read from a file that is gone: the writers said
    "<dst>: cannot write: No such file or directory" (safetensors) or DCP could not write (DCP)."""
    gone = tmp_path / "gone.pt"
    specs = [("a", (2,), torch.float32), ("b", (2,), torch.float32)]

    def read(key: str) -> torch.Tensor:
        return torch.zeros(2) if key == "a" else torch.load(gone)

    said = f"^{re.escape(str(gone))}: cannot read the tensor to write: No such file or directory"
    with pytest.raises(tiekit.CheckpointError, match=said):
        if destination == "safetensors":
            stream.write_safetensors(tmp_path / "out.safetensors", specs, None, ((k, read(k)) for k, _, _ in specs))
        else:
            stream.write_dcp(tmp_path / "out", specs, read)
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("destination", ["safetensors", "dcp"])
def test_an_io_error_reading_the_source_that_names_no_file_names_the_source(tmp_path: Path, destination: str) -> None:
    """An I/O error with no file name (EIO reading a mapped file; injected here at the source's
    read) said "the source: cannot read the tensor to write", naming nothing."""
    import errno

    source_path = tmp_path / "src"
    specs = [("a", (2,), torch.float32)]

    def failing(keys: list[str]) -> dict[str, torch.Tensor]:
        raise OSError(errno.EIO, "Input/output error")

    source = converting.ConvertSource(str(source_path), specs, None, failing)
    writing = importlib.import_module("tiekit.dcp.convert")
    said = f"^{re.escape(str(source_path))}: cannot read the tensor to write: Input/output error"
    with pytest.raises(tiekit.CheckpointError, match=said):
        if destination == "safetensors":
            writing._to_safetensors(source, specs, None, {}, tmp_path / "out.safetensors", None)
        else:
            writing._to_dcp(source, specs, None, {}, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
