"""DCP's ``.metadata`` is a pickle: tiekit reads it with the globals DCP's records need only, so a
crafted one runs nothing (`tiekit.dcp.metadata_pickle`), in `tiekit inspect`, `verify`, `convert`,
`load_sharded` and the DCP loads tiekit runs; real metadata of torch 2.9.1 and 2.14.1 still reads."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata

import tiekit
from tiekit.cli import main
from tiekit.dcp.layout import MARKER_NAME

DATA = Path(__file__).parent / "data" / "dcp_metadata"
REAL = sorted(DATA.glob("torch-*/*.metadata"))
SYSTEM = f"{os.system.__module__}.system"  # posix.system: what pickle names os.system by
REFUSED = re.escape(f"refuses to unpickle {SYSTEM}: DCP metadata holds only torch.distributed.checkpoint's records")

FACTORY = """
from torch import nn


def tied():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    return model
"""


class RunsCommand:
    """Unpickles as ``os.system(command)``: what a crafted ``.metadata`` holds."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


def tied() -> nn.Module:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    return model


def craft(metadata_file: Path, ran: Path) -> None:
    """Rewrite DCP's real ``metadata_file`` with a command in it (its ``version``) that creates
    ``ran``; checked to run under plain ``pickle.loads``, as torch's reader unpickles."""
    metadata = pickle.loads(metadata_file.read_bytes())  # the test's own save
    metadata.version = RunsCommand(f"touch {ran}")
    data = pickle.dumps(metadata)
    pickle.loads(data)
    assert ran.exists(), "the crafted pickle does not run its command"
    ran.unlink()
    metadata_file.write_bytes(data)


def vouch(checkpoint: Path) -> Path:
    """Make the marker of `save_sharded` folder ``checkpoint`` name its current ``.metadata``
    (whoever writes one can write the other); the metadata file."""
    marker = json.loads((checkpoint / MARKER_NAME).read_text())
    metadata = checkpoint / marker["folder"] / ".metadata"
    marker["metadata_sha256"] = hashlib.sha256(metadata.read_bytes()).hexdigest()
    marker["files"][".metadata"] = metadata.stat().st_size
    (checkpoint / MARKER_NAME).write_text(json.dumps(marker))
    return metadata


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """The exit code and what was printed (verify reports its failed check on stdout)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


def test_plain_dcp_folder_whose_metadata_runs_a_command_is_refused_naming_the_global(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, ran = tmp_path / "plain", tmp_path / "ran"
    dcp.save({"w": torch.ones(3), "step": 3, "name": "n"}, checkpoint_id=folder, no_dist=True)
    craft(folder / ".metadata", ran)
    for argv in (
        ["inspect", str(folder)],
        ["inspect", str(folder), "--check-values"],
        ["convert", str(folder), str(tmp_path / "out.safetensors")],
    ):
        code, err = cli(capsys, *argv)
        assert code == 1 and re.search(re.escape(f"{folder / '.metadata'}: ") + REFUSED, err), (argv, err)
        assert not ran.exists(), argv
    with pytest.raises(tiekit.CheckpointError, match=REFUSED):
        tiekit.convert(folder, tmp_path / "out2.safetensors")
    assert not ran.exists() and not (tmp_path / "out.safetensors").exists()


def test_a_chunk_placed_in_a_file_outside_the_folder_is_refused(tmp_path: Path) -> None:
    """A metadata whose only "global" is DCP's own records can still name the file of a chunk:
    DCP joins it to the folder, so ``../secret`` was read as the tensor's bytes, and convert
    copied them into its output."""
    folder, secret = tmp_path / "plain", tmp_path / "secret"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=folder, no_dist=True)
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    [(index, where)] = metadata.storage_data.items()
    secret.write_bytes((folder / where.relative_path).read_bytes().replace(b"\x00\x00\x80\x3f", b"\x00\x00\x40\x40"))
    metadata.storage_data[index] = type(where)("../secret", where.offset, where.length)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    plain = tmp_path / "plain.safetensors"
    with pytest.raises(tiekit.CheckpointError, match=r"key 'w' is stored in '../secret', not a file of the"):
        tiekit.convert(folder, plain)
    assert not plain.exists()


def test_save_sharded_folder_whose_marker_vouches_for_a_crafted_metadata_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pk_models.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    checkpoint, ran = tmp_path / "ckpt", tmp_path / "ran"
    tiekit.save_sharded(tied(), checkpoint)
    metadata = next(checkpoint.glob("save-*/.metadata"))
    craft(metadata, ran)
    assert vouch(checkpoint) == metadata
    for argv in (
        ["inspect", str(checkpoint)],
        ["verify", str(checkpoint), "--model", "pk_models:tied"],
        ["convert", str(checkpoint), str(tmp_path / "out.safetensors")],
    ):
        code, err = cli(capsys, *argv)
        assert code == 1 and re.search(re.escape(f"{metadata}: ") + REFUSED, err), (argv, err)
        assert not ran.exists(), argv
    model = tied()
    before = model[0].weight.detach().clone()
    with pytest.raises(tiekit.CheckpointError, match=re.escape(f"{metadata}: ") + REFUSED):
        tiekit.load_sharded(model, checkpoint)
    assert not ran.exists()
    assert torch.equal(model[0].weight, before)


def test_dcp_loads_tiekit_runs_read_the_metadata_restricted_too(tmp_path: Path) -> None:
    """DCP's load unpickles the metadata again itself: tiekit gives it a reader that reads it
    restricted, so a ``.metadata`` swapped after tiekit's own read runs nothing either."""
    from tiekit.dcp.metadata_pickle import metadata_reader
    from tiekit.dcp.records import dcp_load, dcp_metadata

    folder, ran = tmp_path / "plain", tmp_path / "ran"
    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=folder, no_dist=True)
    metadata = dcp_metadata(folder)  # tiekit's own read, before the swap
    genuine = (folder / ".metadata").read_bytes()
    craft(folder / ".metadata", ran)
    with pytest.raises(tiekit.CheckpointError, match=REFUSED):
        dcp_load({"w": torch.empty(2, 3)}, folder, metadata, None, True)
    assert not ran.exists()
    reader = metadata_reader(folder)
    with pytest.raises(BaseException):  # noqa: B017 - DCP's CheckpointException (torch 2.9's says only AssertionError)
        dcp.load({"w": torch.empty(2, 3)}, storage_reader=reader, no_dist=True)
    assert not ran.exists()
    assert re.search(REFUSED, str(reader.refusal))
    (folder / ".metadata").write_bytes(genuine)  # and the genuine metadata reads through it
    value = torch.empty(2, 3)
    dcp.load({"w": value}, storage_reader=metadata_reader(folder), no_dist=True)
    assert torch.equal(value, torch.arange(6.0).reshape(2, 3))


def test_a_pickle_setting_attributes_of_an_allowed_class_is_refused_and_undone(tmp_path: Path) -> None:
    """Pickle's BUILD sets attributes on whatever it is given, an allowed class too (which would
    change DCP's records for the whole process)."""
    from tiekit.dcp.metadata_pickle import read_dcp_metadata

    file = tmp_path / ".metadata"
    name = b"torch.distributed.checkpoint.metadata"
    # PROTO 4; push the class Metadata; state (None, {"__eq__": None}); BUILD; STOP
    file.write_bytes(b"\x80\x04\x8c" + bytes([len(name)]) + name + b"\x8c\x08Metadata\x93N}\x8c\x06__eq__Ns\x86b.")
    eq = Metadata.__eq__
    with pytest.raises(tiekit.CheckpointError, match=r"\.metadata: refuses to unpickle it: it sets Metadata\.__eq__"):
        read_dcp_metadata(file)
    assert Metadata.__eq__ is eq
    file.write_bytes(pickle.dumps(["not", "metadata"]))
    with pytest.raises(tiekit.CheckpointError, match=r"\.metadata: holds a list, not DCP's Metadata"):
        read_dcp_metadata(file)


@pytest.mark.parametrize("file", REAL, ids=[f"{p.parent.name}/{p.stem}" for p in REAL])
def test_real_metadata_of_torch_2_9_and_2_14_reads(file: Path) -> None:
    """Each kind of folder tiekit reads, written by either torch (tests/data/dcp_metadata/
    write_folders.py), reads the same as torch's own unpickling of it, under this torch."""
    from tiekit.dcp.metadata_pickle import read_dcp_metadata

    metadata = read_dcp_metadata(file)
    assert isinstance(metadata, Metadata) and metadata.state_dict_metadata
    assert metadata == pickle.loads(file.read_bytes())  # the test's own files
