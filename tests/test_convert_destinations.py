"""`tiekit.convert` and ``tiekit convert`` refuse destinations that would lose data or mix checkpoints."""

from __future__ import annotations

import re
import resource
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from launching import TIMEOUT, base_env
from torch import nn

import tiekit
from tiekit.cli import main
from tiekit.dcp.layout import committed_save_id

# tiekit's rules for a destination folder, the same on both stacks: run once (keeps CI under its budget).
pytestmark = pytest.mark.newest_torch_only


class Tied(nn.Module):
    """An embedding tied to the output layer, small enough for every test to save in milliseconds."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        if tie:
            self.head.weight = self.embed.weight


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes: what a refused convert must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(src: Path, dst: Path | str, match: str, **kwargs: object) -> None:
    """``convert(src, dst)`` is a `CheckpointError` matching ``match`` and changes no file."""
    before = tree(src.parent)
    with warnings.catch_warnings(), pytest.raises(tiekit.CheckpointError, match=match):
        warnings.simplefilter("ignore")
        tiekit.convert(src, dst, **kwargs)  # type: ignore[arg-type]
    assert tree(src.parent) == before


def test_convert_and_save_sharded_remove_only_the_save_folders_tiekit_names(tmp_path: Path) -> None:
    model = Tied()
    tiekit.save_model(model, tmp_path / "model.safetensors")
    runs = tmp_path / "runs"
    (runs / "save-best").mkdir(parents=True)
    (runs / "save-best" / "weights.bin").write_text("the user's")
    tiekit.convert(tmp_path / "model.safetensors", runs)
    assert (runs / "save-best" / "weights.bin").read_text() == "the user's"
    converted = committed_save_id(runs)
    tiekit.save_sharded(model, runs)  # its commit removes the converted save, not the user's folder
    assert (runs / "save-best" / "weights.bin").read_text() == "the user's"
    assert sorted(p.name for p in runs.glob("save-*")) == sorted(["save-best", f"save-{committed_save_id(runs)}"])
    assert converted != committed_save_id(runs)


@pytest.mark.parametrize("source", ["model.safetensors", "ck"])
def test_convert_refuses_a_destination_holding_save_folders_without_a_marker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str
) -> None:
    """A save_sharded under way in another process (or save folders copied without their marker)
    was removed by convert's commit, as stale saves of the checkpoint it wrote, and exit code 0."""
    tiekit.save_model(Tied(), tmp_path / "model.safetensors")
    tiekit.save_sharded(Tied(), tmp_path / "ck")
    live = tmp_path / "dst" / f"save-{committed_save_id(tmp_path / 'ck')}"
    shutil.copytree(next((tmp_path / "ck").glob("save-*")), live)  # a save not committed yet
    said = (
        f"{live}: exists, the save folder of a sharded checkpoint with no marker (a save_sharded under way, or a "
        f"checkpoint whose tiekit-dcp.json is gone); convert writes a new checkpoint and {tmp_path / 'dst'} holds"
    )
    refused(tmp_path / source, tmp_path / "dst", re.escape(said))
    code = main(["convert", str(tmp_path / source), str(tmp_path / "dst")])
    assert code == 1 and said in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "dst").iterdir()] == [live.name]


@pytest.mark.parametrize(
    ("dst", "said"),
    [("ck", "is the source"), ("ck/inner.safetensors", "is inside the source"), (".", "contains the source")],
)
def test_convert_refuses_a_destination_that_is_inside_or_holds_its_source(tmp_path: Path, dst: str, said: str) -> None:
    tiekit.save_sharded(Tied(), tmp_path / "ck")
    refused(tmp_path / "ck", tmp_path / dst, f"{said} {tmp_path / 'ck'}")


def test_cli_convert_of_a_folder_into_its_parent_keeps_the_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "out" / "save-1"
    tiekit.save_model(Tied(), source / "model.safetensors")
    code = main(["convert", str(source), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and f"{tmp_path / 'out'}: the destination contains the source {source}" in err
    assert (source / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["save-1"]


def holding(folder: Path, what: str) -> str:
    """Make ``folder`` hold a checkpoint of kind ``what``; return the file that makes it one."""
    model = Tied()
    if what == "safetensors":
        tiekit.save_model(model, folder / "model.safetensors")
        return "model.safetensors"
    if what == "index":
        tiekit.save_model(nn.Linear(64, 64), folder / "model.safetensors", max_shard_size="8KB")
        return "model.safetensors.index.json"
    if what == "plain dcp":
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(model.state_dict(), checkpoint_id=str(folder), no_dist=True)
        return ".metadata"
    tiekit.save_sharded(model, folder)
    return "tiekit-dcp.json"


@pytest.mark.parametrize("what", ["safetensors", "index", "plain dcp", "sharded"])
@pytest.mark.parametrize("source", ["model.safetensors", "ck"])
def test_convert_refuses_a_destination_folder_that_holds_a_checkpoint(tmp_path: Path, source: str, what: str) -> None:
    src = tmp_path / source
    if source == "ck":
        tiekit.save_sharded(Tied(), src)
    else:
        tiekit.save_model(Tied(), src)
    found = holding(tmp_path / "dst", what)
    refused(
        src,
        tmp_path / "dst",
        f"{tmp_path / 'dst' / found}: exists; convert writes a new checkpoint and {tmp_path / 'dst'} holds one already",
    )


def holding_another_name(folder: Path, what: str) -> str:
    """Make ``folder`` hold a checkpoint no file of `CHECKPOINT_FILES` names; return its first file."""
    if what == "single file":
        tiekit.save_model(Tied(), folder / "weights.safetensors")
        return "weights.safetensors"
    if what == "fit steps":  # a checkpoint_dir of tiekit.fit's single-file strategies
        for step in (2, 4):
            tiekit.save_model(Tied(), folder / f"step-{step:08d}.safetensors")
        return "step-00000002.safetensors"
    if what == "index":
        tiekit.save_model(nn.Linear(64, 64), folder / "weights.safetensors", max_shard_size="8KB")
        return "weights.safetensors.index.json"
    tiekit.save_model(nn.Linear(64, 64), folder / "weights.safetensors", max_shard_size="8KB")
    (folder / "weights.safetensors.index.json").unlink()  # shards a killed save left: load_model names them
    return "weights-00001-of-00002.safetensors"


@pytest.mark.parametrize("what", ["single file", "fit steps", "index", "shards"])
@pytest.mark.parametrize("source", ["model.safetensors", "ck"])
def test_convert_refuses_a_destination_folder_holding_a_checkpoint_of_another_name(
    tmp_path: Path, source: str, what: str
) -> None:
    """Only model.safetensors (and its index) and a DCP folder's files were looked for: `tiekit convert
    ck held` beside held/weights.safetensors exited 0 with held/model.safetensors, which the folder
    then loaded as, and a safetensors source made a DCP checkpoint beside it (probe)."""
    src = tmp_path / source
    if source == "ck":
        tiekit.save_sharded(Tied(), src)
    else:
        tiekit.save_model(Tied(), src)
    found = holding_another_name(tmp_path / "held", what)
    said = f"{tmp_path / 'held' / found}: exists; convert writes a new checkpoint and {tmp_path / 'held'} holds one"
    refused(src, tmp_path / "held", re.escape(said))
    result = subprocess.run(
        [sys.executable, "-m", "tiekit", "convert", source, "held"],
        cwd=tmp_path,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 1 and result.stderr.startswith(f"tiekit: error: held/{found}: exists; "), result
    assert (
        not (tmp_path / "held" / "model.safetensors").exists() and not (tmp_path / "held" / "tiekit-dcp.json").exists()
    )


def test_convert_into_a_folder_holding_only_hidden_files_writes_the_checkpoint(tmp_path: Path) -> None:
    """Hidden files (a killed save's leftovers) are no checkpoint a loader reads: they do not refuse it."""
    tiekit.save_sharded(Tied(), tmp_path / "ck")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".partial.safetensors").write_bytes(b"half a file")
    tiekit.convert(tmp_path / "ck", tmp_path / "out")
    model = Tied(tie=False)
    tiekit.load_model(model, tmp_path / "out")
    assert model.head.weight is model.embed.weight


@pytest.mark.parametrize(
    ("dst", "options", "said"),
    [
        ("out.safetensors", [], "converts to a sharded \\(DCP\\) folder, not to a safetensors file"),
        ("out.safetensors", ["--max-shard-size", "1KB"], "not to a safetensors file"),
        ("out", ["--max-shard-size", "1KB"], "max_shard_size \\(--max-shard-size\\) applies to a safetensors"),
    ],
    ids=["file", "file and size", "folder and size"],
)
def test_cli_convert_of_safetensors_refuses_a_safetensors_destination_or_a_shard_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dst: str, options: list[str], said: str
) -> None:
    tiekit.save_model(Tied(), tmp_path / "in.safetensors")
    code = main(["convert", str(tmp_path / "in.safetensors"), str(tmp_path / dst), *options])
    err = capsys.readouterr().err
    assert code == 1 and re.search(said, err) and "tiekit.save_model(model, path, max_shard_size=...)" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]


@pytest.mark.parametrize(
    ("source", "dst", "said"),
    [
        ("ck", "afile", "it is a file, not a folder"),
        ("ck", "afile/sub.safetensors", "it lies in {tmp}/afile, a file, not a folder"),
        ("model.safetensors", "afile", "it is a file, not a folder"),
        ("model.safetensors", "afile/sub", "it lies in {tmp}/afile, a file, not a folder"),
        ("ck", "", "the destination is an empty path"),
    ],
)
def test_convert_names_a_destination_it_cannot_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, dst: str, said: str
) -> None:
    monkeypatch.chdir(tmp_path)  # an empty path once meant the current folder: written here, then seen
    tiekit.save_sharded(Tied(), tmp_path / "ck")
    tiekit.save_model(Tied(), tmp_path / "model.safetensors")
    (tmp_path / "afile").write_text("not a folder")
    target = str(tmp_path / dst) if dst else ""
    refused(
        tmp_path / source,
        target,
        re.escape(f"{target}: cannot be written: " if dst else "") + said.format(tmp=tmp_path),
    )


def test_a_convert_that_fails_while_writing_leaves_no_folder_behind(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.zeros(2, dtype=torch.complex128)}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    refused(tmp_path / "plain", tmp_path / "new" / "deeper" / "out.safetensors", "safetensors cannot store")
    assert not (tmp_path / "new").exists()
    broken = {"embed.weight": torch.zeros(10, 4), "head.weight": torch.ones(10, 4)}  # a tie broken and trained
    save_file(broken, tmp_path / "broken.safetensors")
    refused(tmp_path / "broken.safetensors", tmp_path / "new" / "ck", "refusing to merge tied keys", plan=Tied())
    assert not (tmp_path / "new").exists()


class TwoTies(nn.Module):
    """`Tied` whose model also ties two projections: a tie the source's plan may not record."""

    def __init__(self, tie_head: bool = True, tie_projections: bool = True) -> None:
        super().__init__()
        self.lm = Tied(tie_head)
        self.up = nn.Linear(4, 4, bias=False)
        self.down = nn.Linear(4, 4, bias=False)
        if tie_projections:
            self.down.weight = self.up.weight


def test_convert_with_a_model_keeps_the_ties_the_source_records_and_adds_the_models(tmp_path: Path) -> None:
    import torch

    saved = TwoTies(tie_projections=False)
    with torch.no_grad():
        saved.down.weight.copy_(saved.up.weight)  # equal copies, which the model given merges
    tiekit.save_sharded(saved, tmp_path / "ck")  # records lm.embed.weight = lm.head.weight only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        untied_head = tiekit.convert(tmp_path / "ck", tmp_path / "a.safetensors", plan=TwoTies(tie_head=False))
    assert untied_head.stored == ("lm.embed.weight", "up.weight") and untied_head.merged == ("down.weight",)
    loaded = TwoTies(tie_head=False, tie_projections=False)
    tiekit.load_model(loaded, tmp_path / "a.safetensors")  # both tied names there: none lost
    assert torch.equal(loaded.lm.head.weight, saved.lm.embed.weight)
    assert torch.equal(loaded.down.weight, saved.up.weight)


#: A folder name the file system refuses (over 255 bytes: ENAMETOOLONG), as it refuses a folder on
#: a read-only file system or without write permission, which a test running as root cannot make.
TOO_LONG = "x" * 300


@pytest.mark.parametrize(
    ("source", "dst"),
    [("ck", f"{TOO_LONG}/model.safetensors"), ("ck", TOO_LONG), ("model.safetensors", TOO_LONG)],
    ids=["sharded to a file in it", "sharded to it", "safetensors to it"],
)
def test_convert_names_a_destination_folder_it_cannot_create(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str, dst: str
) -> None:
    """It was the raw OSError, which the CLI called "not expected; please report it"."""
    tiekit.save_sharded(Tied(), tmp_path / "ck")
    tiekit.save_model(Tied(), tmp_path / "model.safetensors")
    said = re.escape(f"{tmp_path / dst}: cannot be written: File name too long")
    refused(tmp_path / source, tmp_path / dst, said)
    code = main(["convert", str(tmp_path / source), str(tmp_path / dst)])
    err = capsys.readouterr().err
    assert code == 1 and re.match(f"tiekit: error: {said}", err) and "not expected" not in err, err


def test_writing_safetensors_names_a_folder_it_cannot_create(tmp_path: Path) -> None:
    """The writer's own creation of the folder (convert's checks find a name too long first on
    Python 3.11; a read-only file system fails only here)."""
    import torch

    from tiekit.dcp.stream import write_safetensors

    target = tmp_path / TOO_LONG / "model.safetensors"
    tensors = iter([("w", torch.zeros(2))])
    said = re.escape(f"{tmp_path / TOO_LONG}: cannot create the folder of model.safetensors: File name too long")
    with pytest.raises(tiekit.CheckpointError, match=said):
        write_safetensors(target, [("w", (2,), torch.float32)], None, tensors)


def test_a_convert_to_a_sharded_folder_that_cannot_write_names_the_file_and_the_cause(tmp_path: Path) -> None:
    """It said DCP's "rank 0: RuntimeError: [enforce fail at inline_container.cc:664] . unexpected
    pos 704 vs 598": torch's zip writer's report of the write the file system refused."""
    tiekit.save_model(nn.Embedding(256, 64), tmp_path / "model.safetensors")  # a 64 KiB tensor
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def limited() -> None:  # the kernel refuses writes past 32 KiB with EFBIG, as a full disk with ENOSPC
        resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, hard))

    result = subprocess.run(
        [sys.executable, "-m", "tiekit", "convert", "model.safetensors", "out"],
        cwd=tmp_path,
        env=base_env(),
        preexec_fn=limited,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    said = r"tiekit: error: out/save-[0-9a-f]{16}/__0_\d+\.distcp: cannot write: File too large\n"
    assert result.returncode == 1 and re.match(said, result.stderr), result.stderr
    assert not (tmp_path / "out").exists()
