"""`tiekit.convert` and ``tiekit convert/inspect/verify`` on sharded checkpoint folders (issue 12)."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from launching import ROOT, TIMEOUT, base_env
from models import gpt2
from torch import nn

import tiekit
from tiekit.cli import main
from tiekit.inspection import inspect_file

WTE = "transformer.wte.weight"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def untied_gpt2() -> nn.Module:
    model = gpt2()
    model.lm_head.weight = nn.Parameter(torch.zeros_like(model.lm_head.weight))
    return model


@pytest.fixture
def factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"dcp_factories_{tmp_path.name.replace('-', '_')}"
    text = f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\nfrom models import gpt2\n\n\ndef tied():\n"
    (tmp_path / f"{name}.py").write_text(text + "    return gpt2()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield f"{name}:tied"
    sys.modules.pop(name, None)


def trained_gpt2() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small GPT-2 after one AdamW step, and its optimizer (which then holds state)."""
    torch.manual_seed(0)
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 96, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture
def saved(tmp_path: Path) -> tuple[nn.Module, Path]:
    model, optimizer = trained_gpt2()
    tiekit.save_sharded(model, tmp_path / "ck", optimizer=optimizer)
    return model, tmp_path / "ck"


def test_dcp_to_tied_safetensors_and_back(saved: tuple[nn.Module, Path], tmp_path: Path) -> None:
    model, path = saved
    with pytest.warns(UserWarning, match="left out: optimizer state"):
        result = tiekit.convert(path, tmp_path / "model.safetensors")
    assert result.left_out == ("optimizer state",)
    assert WTE in result.stored and "lm_head.weight" not in result.stored  # one copy per tie group
    unique = sum(p.numel() * 4 for p in model.parameters())
    data = (tmp_path / "model.safetensors").read_bytes()
    assert result.bytes == unique and len(data) == 8 + int.from_bytes(data[:8], "little") + unique
    loaded = untied_gpt2()
    tiekit.load_model(loaded, tmp_path / "model.safetensors")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight and equal(loaded, model)

    back = tiekit.convert(tmp_path / "model.safetensors", tmp_path / "back")
    assert back.files[0].endswith("tiekit-dcp.json")
    again = untied_gpt2()
    tiekit.load_sharded(again, tmp_path / "back")
    assert again.lm_head.weight is again.transformer.wte.weight and equal(again, model)


def test_a_damaged_record_is_named_with_its_file_and_key(saved: tuple[nn.Module, Path], tmp_path: Path) -> None:
    # Whole-tensor chunks are read straight from the shard file: a record overwritten in place
    # (same size, so the marker's file sizes still match) is refused, not read as garbage.
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    _, path = saved
    folder = next(path.glob("save-*"))
    metadata = FileSystemReader(folder).read_metadata()
    where = next(w for i, w in metadata.storage_data.items() if i.fqn == WTE)
    shard = folder / where.relative_path
    data = bytearray(shard.read_bytes())
    data[where.offset : where.offset + 64] = b"\0" * 64  # the record's zip header
    shard.write_bytes(bytes(data))
    said = (
        rf"{shard.name}: key '{WTE}' \(bytes {where.offset} to {where.offset + where.length}\) is damaged, its record"
    )
    with pytest.raises(tiekit.CheckpointError, match=said) as refused:
        tiekit.convert(path, tmp_path / "model.safetensors")
    assert "weights_only" not in str(refused.value)  # torch's advice to unpickle anything is not repeated
    assert not (tmp_path / "model.safetensors").exists()


class FailingReads(io.BufferedReader):
    """A shard file whose reads fail as a failing disk's do (EIO): the fault injected at the system's boundary."""

    def readinto(self, buffer: Any) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))


def test_a_record_the_system_will_not_read_is_not_called_damaged(
    saved: tuple[nn.Module, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """convert called a read error (EIO) inside a record "damaged, its record does not read", as if
    its bytes were changed (verify said "cannot read"): no byte was seen, so none is blamed."""
    from tiekit.dcp import chunks

    _, path = saved

    def failing_open(file: Path, key: str) -> io.BufferedReader:
        return FailingReads(io.FileIO(file, "rb"))  # closed by convert, as the file it stands for

    monkeypatch.setattr(chunks, "_open_shard", failing_open)
    with pytest.raises(
        tiekit.CheckpointError, match=r"__0_0\.distcp: cannot read: Input/output error \(it holds key "
    ) as e:
        tiekit.convert(path, tmp_path / "model.safetensors")
    assert "damaged" not in str(e.value)
    assert not (tmp_path / "model.safetensors").exists()


def test_cli_converts_to_a_hugging_face_style_sharded_folder(
    saved: tuple[nn.Module, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, path = saved
    code, out, _ = run(capsys, "convert", str(path), str(tmp_path / "hf"), "--max-shard-size", "20KB")
    assert code == 0 and "28 tensors" in out
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    loaded = untied_gpt2()
    tiekit.load_model(loaded, tmp_path / "hf")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight and equal(loaded, model)
    # A destination holding a checkpoint is never overwritten.
    code, _, err = run(capsys, "convert", str(path), str(tmp_path / "hf"), "--max-shard-size", "20KB")
    assert code == 1 and "exists; convert writes a new checkpoint" in err


def test_plain_dcp_folder_merges_equal_tied_names_and_refuses_different_ones(
    tmp_path: Path, factory: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    model = gpt2()
    save(model.state_dict(), storage_writer=FileSystemWriter(tmp_path / "plain"), no_dist=True)
    code, out, _ = run(capsys, "convert", str(tmp_path / "plain"), str(tmp_path / "m.safetensors"), "--model", factory)
    assert code == 0 and "merged into their tie source: lm_head.weight" in out, out
    loaded = untied_gpt2()
    tiekit.load_model(loaded, tmp_path / "m.safetensors")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight and equal(loaded, model)

    trained = model.state_dict()
    trained["lm_head.weight"] = trained["lm_head.weight"] + 1  # a tie broken, then trained
    save(trained, storage_writer=FileSystemWriter(tmp_path / "broken"), no_dist=True)
    with pytest.raises(tiekit.CheckpointError, match=r"refusing to merge tied keys 'lm_head\.weight' and 'transformer"):
        tiekit.convert(tmp_path / "broken", tmp_path / "b.safetensors", plan=gpt2())
    assert not (tmp_path / "b.safetensors").exists()
    with pytest.raises(tiekit.CheckpointError, match="refusing to merge"):
        tiekit.convert(tmp_path / "broken", tmp_path / "b-dcp", plan=gpt2())
    assert not (tmp_path / "b-dcp" / "tiekit-dcp.json").exists()
    # Without a plan both names are kept: nothing is lost.
    kept = tiekit.convert(tmp_path / "broken", tmp_path / "kept.safetensors")
    assert "lm_head.weight" in kept.stored and not kept.merged


def test_a_source_that_records_no_ties_converts_to_checkpoints_that_record_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plain DCP folder or safetensors file of a tied model stores both names (equal values) and
    no plan; converted without ``plan``, the result records no plan either, and loads into the
    model (its ties taken, the equal copy accepted), as the source does. It recorded an empty
    plan ("no ties"), which the loaders of a tied model refused."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    model = gpt2()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    save(state, storage_writer=FileSystemWriter(tmp_path / "plain"), no_dist=True)
    save_file(state, tmp_path / "plain.safetensors")
    converted = [
        tiekit.convert(tmp_path / "plain", tmp_path / "from-dcp.safetensors"),
        tiekit.convert(tmp_path / "plain", tmp_path / "from-dcp", max_shard_size="40KB"),  # HF-style shards
        tiekit.convert(tmp_path / "plain.safetensors", tmp_path / "sharded"),  # a save_sharded folder
    ]
    for result in converted:
        assert "lm_head.weight" in result.stored and not result.merged  # nothing merged without a plan
        first = Path(result.files[0])
        sharded = first.name == "tiekit-dcp.json"
        target = first.parent if sharded or len(result.files) > 1 else first
        loaded = untied_gpt2()
        (tiekit.load_sharded if sharded else tiekit.load_model)(loaded, target)
        assert loaded.lm_head.weight is loaded.transformer.wte.weight and equal(loaded, model), target
        code, out, _ = run(capsys, "inspect", str(target))
        assert code == 0 and "tie plan: none recorded" in out, out

    # Copies that differ are refused (the folder's are read by DCP to be compared).
    state["lm_head.weight"] = state["lm_head.weight"] * 2
    save_file(state, tmp_path / "different.safetensors")
    tiekit.convert(tmp_path / "different.safetensors", tmp_path / "different")
    with pytest.raises(
        tiekit.CheckpointError, match=r"stores 'lm_head\.weight' and 'transformer\.wte\.weight' with differ"
    ):
        tiekit.load_sharded(untied_gpt2(), tmp_path / "different")


def test_a_saved_conjugate_view_converts_to_its_values(tmp_path: Path) -> None:
    """DCP's shard files keep a saved ``x.conj()`` as a conjugate view; convert wrote its bytes
    with a dtype view, which torch refuses (RuntimeError)."""
    model = nn.Module()
    model.register_buffer("z", torch.randn(3, dtype=torch.complex64).conj())
    tiekit.save_sharded(model, tmp_path / "ck")
    tiekit.convert(tmp_path / "ck", tmp_path / "m.safetensors")
    fresh = nn.Module()
    fresh.register_buffer("z", torch.zeros(3, dtype=torch.complex64))
    tiekit.load_model(fresh, tmp_path / "m.safetensors")
    assert torch.equal(fresh.z, model.z.resolve_conj())


def test_what_convert_leaves_out_is_in_its_result_a_warning_and_the_cli_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Optimizer state and extra were dropped in silence (only the module docstring said so)."""
    model, optimizer = trained_gpt2()
    tiekit.save_sharded(model, tmp_path / "ck", optimizer=optimizer, extra={"epoch": 3})
    tiekit.save_checkpoint(tmp_path / "train.safetensors", model=model, optimizer=optimizer, step=7)
    with pytest.warns(UserWarning, match=r"ck: tiekit.convert converted the model's tensors only; left out: opt"):
        result = tiekit.convert(tmp_path / "ck", tmp_path / "m.safetensors")
    assert result.left_out == ("optimizer state", "extra")
    with pytest.warns(UserWarning, match=r"train.safetensors: .*left out: optimizer state, step \("):
        assert tiekit.convert(tmp_path / "train.safetensors", tmp_path / "ck2").left_out == ("optimizer state", "step")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the model alone: nothing left out, nothing said
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        assert tiekit.convert(tmp_path / "m.safetensors", tmp_path / "ck3").left_out == ()

    from torch.distributed.checkpoint import save

    save({"w": torch.ones(2), "note": "epoch 3"}, checkpoint_id=tmp_path / "plain", no_dist=True)
    # A plain DCP folder names no model: every tensor is converted (it said "the model's tensors only").
    plain_said = r"plain: tiekit.convert converted every tensor of this plain DCP folder .* left out, not being "
    with pytest.warns(UserWarning, match=plain_said + "tensors: non-tensor entries 'note'"):
        assert tiekit.convert(tmp_path / "plain", tmp_path / "plain.safetensors").stored == ("w",)

    code, out, err = run(capsys, "convert", str(tmp_path / "ck"), str(tmp_path / "cli.safetensors"))
    said = "  converted the model's tensors only; left out: optimizer state, extra (still in "
    assert code == 0 and said + f"{tmp_path / 'ck'}, which load_sharded / load_checkpoint read)" in out, out
    assert "tiekit.convert converted" not in err  # said once, in the command's output
    code, out, _ = run(capsys, "convert", str(tmp_path / "ck"), str(tmp_path / "cli2.safetensors"), "--json")
    assert code == 0 and json.loads(out)["left_out"] == ["optimizer state", "extra"]


def test_inspect_and_verify_read_sharded_folders(
    saved: tuple[nn.Module, Path], factory: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _, path = saved
    code, out, _ = run(capsys, "inspect", str(path), "--json")
    report = json.loads(out)
    assert code == 0 and report["plan_origin"] == "tiekit"
    assert (report["stored_tensors"], report["names"]) == (28, 29)
    assert report["optimizer_tensors"] == 3 * 28  # exp_avg, exp_avg_sq, step per unique parameter
    assert report["metadata"]["world_size"] == "1"
    code, out, _ = run(capsys, "inspect", str(path))
    assert "transformer.wte.weight  parameter  96x32  float32  lm_head.weight" in out

    code, out, _ = run(capsys, "verify", str(path), "--model", factory)
    assert code == 0 and "PASSED" in out, out
    shard = next(path.glob("save-*/__0_0.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    code, out, _ = run(capsys, "verify", str(path), "--model", factory)
    assert code == 1 and "FAIL  file:" in out and "__0_0.distcp: 100 bytes, but save" in out


def test_inspect_reads_a_plain_dcp_folder_and_finds_its_tie_stored_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tiekit inspect` of a folder dcp.save wrote (no tiekit marker) said "no safetensors file or
    index in this folder", although `tiekit convert` reads such folders."""
    from torch.distributed.checkpoint import save

    model = gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "torch.distributed is disabled ... single process"
        save({**model.state_dict(), "step": 7}, checkpoint_id=tmp_path / "plain", no_dist=True)
    code, out, _ = run(capsys, "inspect", str(tmp_path / "plain"), "--json")
    report = json.loads(out)
    unique = len({t.data_ptr() for t in model.state_dict().values()})
    assert code == 0 and (report["kind"], report["plan_origin"]) == ("dcp", "none")
    assert report["stored_tensors"] == len(model.state_dict()) == unique + 1  # both names of the tie
    assert report["metadata"] == {"non-tensor entries": "1"}
    assert report["stored_bytes"] == sum(t.nbytes for t in model.state_dict().values())
    code, out, _ = run(capsys, "inspect", str(tmp_path / "plain"), "--check-values")
    assert code == 0 and "none recorded (a plain torch.distributed.checkpoint folder)" in out
    assert "lm_head.weight, transformer.wte.weight" in out or "transformer.wte.weight, lm_head.weight" in out
    # The loaders said only "no tiekit-dcp.json" or "no safetensors file or index in this folder".
    for load in (tiekit.load_sharded, tiekit.load_model):
        with pytest.raises(
            tiekit.CheckpointError, match=r"a plain torch.distributed.checkpoint folder .* tiekit\.convert"
        ):
            load(gpt2(), tmp_path / "plain")
    tiekit.save_sharded(model, tmp_path / "sharded")
    with pytest.raises(tiekit.CheckpointError, match=r"a sharded checkpoint .*: load it with tiekit\.load_sharded"):
        tiekit.load_model(gpt2(), tmp_path / "sharded")


@pytest.mark.parametrize("piece", [16, 1 << 22])
def test_check_values_of_a_plain_dcp_folder_compares_every_piece(
    tmp_path: Path, piece: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Values are hashed and checked for constancy piece by piece (16 bytes: 4 floats a piece);
    a difference or a non-constant value in the last piece only still counts."""
    from torch.distributed.checkpoint import save

    from tiekit.dcp import report

    monkeypatch.setattr(report, "_PIECE_BYTES", piece)
    a = torch.randn(64)
    almost = a.clone()
    almost[-1] += 1
    ones_then_two = torch.ones(64)
    ones_then_two[-1] = 2
    state = {"a": a, "b": a.clone(), "almost": almost, "z1": torch.zeros(64), "z2": torch.zeros(64)}
    state.update(d=ones_then_two, e=ones_then_two.clone(), half=a[:32].clone(), half2=a[:32].to(torch.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "torch.distributed is disabled ... single process"
        save(state, checkpoint_id=tmp_path / "plain", no_dist=True)
    found = inspect_file(tmp_path / "plain", check_values=True).identical
    assert sorted(tuple(sorted(g)) for g in found or ()) == [("a", "b"), ("d", "e")]


MEMORY = """
import pathlib, sys, torch
import tiekit
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load


def peak_since_reset():
    # VmHWM, the peak resident size, reset by writing 5 to clear_refs (Linux): imports do not count.
    status = pathlib.Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024


def reset():
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    return peak_since_reset()


src, dst = sys.argv[1], sys.argv[2]
before = reset()
tiekit.convert(src, dst)
converted = peak_since_reset() - before
before = reset()
whole = {f"w{i}": torch.empty(2048, 4096) for i in range(8)}
load(whole, storage_reader=FileSystemReader(next(pathlib.Path(src).glob("save-*"))), no_dist=True)
loaded = peak_since_reset() - before
del whole
before = reset()
tiekit.convert(dst, sys.argv[3])  # and back to a sharded folder
back = peak_since_reset() - before
print(converted, loaded, back)
"""


def test_convert_streams_one_batch_at_a_time(tmp_path: Path) -> None:
    """Peak memory of converting a 256 MiB model of eight 32 MiB tensors, against reading it whole."""
    model = nn.ParameterDict({f"w{i}": nn.Parameter(torch.randn(2048, 4096)) for i in range(8)})
    tiekit.save_sharded(model, tmp_path / "big")
    del model
    script = tmp_path / "memory.py"
    script.write_text(MEMORY)
    command = [sys.executable, str(script), str(tmp_path / "big"), str(tmp_path / "big.safetensors")]
    command.append(str(tmp_path / "back"))
    done = subprocess.run(command, env=base_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    converted, loaded, back = map(int, done.stdout.split()[-3:])
    size = 8 * 2048 * 4096 * 4
    assert loaded >= size * 0.9  # the control: a whole-state read holds the model
    # One 64 MiB batch (two tensors) at a time, not the model: 0.26x. The writer's loop variable held the
    # last tensor of a batch while the next batch was read: 0.39x.
    assert converted < size * 0.32, (converted, size)
    # To a sharded folder: torch's writer held every tensor of its one file until the end (the model),
    # and torch 2.9's torch.save left each tensor in a reference cycle (235 of 256 MiB held).
    assert back < size * 0.32, (back, size)


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_plain_dcp_folder_with_a_damaged_shard_file_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    """`tiekit inspect` of a plain DCP folder whose shard file was truncated (or is gone) reported
    the folder as whole; ``--check-values`` then failed with torch's error (or a FileNotFoundError)
    and `convert` with an error naming its destination. DCP's metadata says where every chunk
    ends: a file shorter than that is refused up front, naming it and a key it holds."""
    from torch.distributed.checkpoint import save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "torch.distributed is disabled ... single process"
        save(gpt2().state_dict(), checkpoint_id=tmp_path / "plain", no_dist=True)
    shard = tmp_path / "plain" / "__0_0.distcp"
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:1000])
        said = rf"{shard}: 1000 bytes, but DCP's metadata has key '[^']+' reach byte \d+ \(truncated"
    else:
        shard.unlink()
        said = rf"{shard}: missing shard file of the DCP checkpoint {tmp_path / 'plain'}"
    said += r".*holding 'lm_head\.weight'"
    for check_values in (False, True):
        with pytest.raises(tiekit.CheckpointError, match=said):
            inspect_file(tmp_path / "plain", check_values=check_values)
        code, _, err = run(capsys, "inspect", str(tmp_path / "plain"), *(["--check-values"] if check_values else []))
        assert code == 1 and str(shard) in err and "not expected" not in err, err
    for dst in ("m.safetensors", "hf"):
        with pytest.raises(tiekit.CheckpointError, match=said):
            tiekit.convert(tmp_path / "plain", tmp_path / dst, plan=gpt2())
        assert not (tmp_path / dst).exists()
    code, _, err = run(capsys, "convert", str(tmp_path / "plain"), str(tmp_path / "m.safetensors"))
    assert code == 1 and str(shard) in err, err


def files_in(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes: what a refused convert must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("dst", "present"),
    [
        ("out.safetensors", "out-00001-of-00002.safetensors"),  # the name this convert writes
        ("out.safetensors", "out-00003-of-00007.safetensors"),  # a shard of another count
        ("hf", "hf/model-00002-of-00002.safetensors"),  # a folder holding shards without their index
    ],
)
def test_a_sharded_safetensors_destination_replaces_no_file_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dst: str, present: str
) -> None:
    """`convert --max-shard-size` refused an existing index or single file, but replaced files
    named as its shards without looking at them (a user's, another checkpoint's)."""
    tiekit.save_sharded(nn.Linear(64, 64), tmp_path / "ck")  # 16 KiB weight, 256 B bias: 2 shards of 8KB
    (tmp_path / present).parent.mkdir(exist_ok=True)
    (tmp_path / present).write_text("the user's")
    before = files_in(tmp_path)
    said = f"{tmp_path / present}: exists, named as a shard of"
    if dst == "hf":  # a folder holding any .safetensors file holds a checkpoint: refused as such, first
        said = f"{tmp_path / present}: exists; convert writes a new checkpoint and {tmp_path / dst} holds one already"
    with pytest.raises(tiekit.CheckpointError, match=re.escape(said)):
        tiekit.convert(tmp_path / "ck", tmp_path / dst, max_shard_size="8KB")
    code, _, err = run(capsys, "convert", str(tmp_path / "ck"), str(tmp_path / dst), "--max-shard-size", "8KB")
    assert code == 1 and said in err, err
    assert files_in(tmp_path) == before
    (tmp_path / present).unlink()
    assert len(tiekit.convert(tmp_path / "ck", tmp_path / dst, max_shard_size="8KB").files) == 3


def test_a_shard_file_that_appears_while_converting_is_not_replaced(tmp_path: Path) -> None:
    """Another writer's file that appears under a shard name after convert checked the
    destination (here: while the tensors stream) is refused, and the shard already moved in is
    removed again: the destination is left as it was found."""
    from tiekit.dcp.stream import write_safetensors

    specs = [("weight", (64, 64), torch.float32), ("bias", (64,), torch.float32)]
    other = tmp_path / "out-00002-of-00002.safetensors"

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        yield "weight", torch.ones(64, 64)
        other.write_text("another writer's")  # before the shards are moved in
        yield "bias", torch.ones(64)

    with pytest.raises(tiekit.CheckpointError, match=re.escape(f"{other}: exists; convert writes a new checkpoint")):
        write_safetensors(tmp_path / "out.safetensors", specs, None, tensors(), max_shard_size=8 << 10)
    assert files_in(tmp_path) == {other.name: b"another writer's"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name]  # no shard, index or work folder left


class Four(nn.Module):
    """Four projections, tied as ``ties`` says (pairs of letters): the source's ties and the model's."""

    def __init__(self, ties: tuple[str, ...] = ()) -> None:
        super().__init__()
        for name in "abcd":
            setattr(self, name, nn.Linear(4, 4, bias=False))
        for pair in ties:
            getattr(self, pair[1]).weight = getattr(self, pair[0]).weight


def test_convert_merges_a_model_tie_that_partly_overlaps_a_recorded_one(tmp_path: Path) -> None:
    """The source records a=b; the model ties b=c (and keeps a apart). The model's group shares
    b with the recorded one and lost to it: c was stored on its own, untied. The groups are now
    merged (a, b, c under the recorded source a), c's stored value checked against a's; a model
    group joining two recorded ones (b=c, with a=b and c=d recorded) merges all four."""
    saved = Four(("ab",))
    with torch.no_grad():
        saved.c.weight.copy_(saved.a.weight)  # an equal copy, which the model's tie merges
    tiekit.save_sharded(saved, tmp_path / "ck")  # records a.weight = b.weight
    result = tiekit.convert(tmp_path / "ck", tmp_path / "m.safetensors", plan=Four(("bc",)))
    assert (result.stored, result.merged) == (("a.weight", "d.weight"), ("c.weight",))
    groups = [g.names for g in inspect_file(tmp_path / "m.safetensors").plan.groups]  # type: ignore[union-attr]
    assert groups == [("a.weight", "b.weight", "c.weight")]
    loaded = Four(("ab", "bc"))
    tiekit.load_model(loaded, tmp_path / "m.safetensors")
    assert loaded.c.weight is loaded.a.weight and torch.equal(loaded.c.weight, saved.a.weight)

    with torch.no_grad():
        saved.c.weight.add_(1)  # the copy trained apart: merging would lose it
    tiekit.save_sharded(saved, tmp_path / "trained")
    with pytest.raises(tiekit.CheckpointError, match=r"refusing to merge tied keys 'c\.weight' and 'a\.weight'"):
        tiekit.convert(tmp_path / "trained", tmp_path / "t.safetensors", plan=Four(("bc",)))
    assert not (tmp_path / "t.safetensors").exists()

    two = Four(("ab", "cd"))
    with torch.no_grad():
        two.c.weight.copy_(two.a.weight)
    tiekit.save_sharded(two, tmp_path / "two")  # records a = b and c = d
    result = tiekit.convert(tmp_path / "two", tmp_path / "two.safetensors", plan=Four(("bc",)))
    assert (result.stored, result.merged) == (("a.weight",), ("c.weight",))
    groups = [g.names for g in inspect_file(tmp_path / "two.safetensors").plan.groups]  # type: ignore[union-attr]
    assert groups == [("a.weight", "b.weight", "c.weight", "d.weight")]


def test_convert_refuses_a_model_tie_meeting_a_recorded_one_at_a_view_only(tmp_path: Path) -> None:
    """A model group that reaches a recorded group through a name it holds as a view of its own
    tensor cannot be one group under the recorded source: refused, naming the source, where it
    was left out in silence."""
    from tiekit.plan import TieGroup, TieMember, TiePlan, ViewGeometry

    tiekit.save_sharded(Four(("ab",)), tmp_path / "ck")  # records a.weight = b.weight
    view = ViewGeometry(0, (4, 4), (4, 1))
    members = (TieMember("c.weight", "parameter"), TieMember("b.weight", "parameter", view))
    given = TiePlan((TieGroup("c.weight", members, "view", (4, 4), "float32"),), 3, 4)
    said = f"{tmp_path / 'ck' / 'tiekit-dcp.json'}: the model ties c.weight, b.weight and the source records a.weight"
    with pytest.raises(tiekit.CheckpointError, match=re.escape(said)):
        tiekit.convert(tmp_path / "ck", tmp_path / "m.safetensors", plan=given)
    assert not (tmp_path / "m.safetensors").exists()


class TwoTies(nn.Module):
    """Two ties: embed/head, and a second pair whose names a checkpoint may not store."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.extra = nn.Linear(4, 4)
        self.extra_copy = nn.Linear(4, 4)
        self.extra_copy.weight = self.extra.weight


def test_convert_with_a_model_whose_tied_names_the_source_lacks(tmp_path: Path) -> None:
    """A model whose tied names are none of the source's keys (a ``dcp.save({"model": ...})``
    folder stores ``model.embed.weight``) is refused, nothing written; it recorded the model's
    plan and wrote a checkpoint no loader could read ("names key 'embed.weight' ... no such
    tensor"). A group naming no stored key is left out of the recorded plan; the others are kept."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    model = TwoTies()
    prefixed = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    save(prefixed, storage_writer=FileSystemWriter(tmp_path / "prefixed"), no_dist=True)
    save_file(prefixed, tmp_path / "prefixed.safetensors")
    for src, dst in (("prefixed", "p.safetensors"), ("prefixed", "p-dcp"), ("prefixed.safetensors", "p2-dcp")):
        with pytest.raises(tiekit.CheckpointError, match=r"stores none of the tied names .*'embed\.weight'.*'model\."):
            tiekit.convert(tmp_path / src, tmp_path / dst, plan=TwoTies())
        assert not (tmp_path / dst).exists()

    # The embed/head tie stored, the extra pair not (a checkpoint of another head): only the first is recorded.
    partial = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("extra")}
    save(partial, storage_writer=FileSystemWriter(tmp_path / "partial"), no_dist=True)
    result = tiekit.convert(tmp_path / "partial", tmp_path / "out.safetensors", plan=TwoTies())
    assert result.merged == ("head.weight",)
    report = inspect_file(tmp_path / "out.safetensors")
    assert report.plan is not None and [g.names for g in report.plan.groups] == [("embed.weight", "head.weight")]
    loaded = TwoTies()
    tiekit.load_model(loaded, tmp_path / "out.safetensors", strict=False)
    assert loaded.head.weight is loaded.embed.weight and torch.equal(loaded.embed.weight, model.embed.weight)
