"""The ``tiekit`` command: inspect files and factories, verify checkpoints, errors without tracebacks."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from launching import TIMEOUT, base_env
from models import gpt2
from safetensors.torch import save_file
from safetensors.torch import save_model as st_save_model
from torch import nn

import tiekit
from tiekit.cli import main

TIEKIT = Path(sys.executable).with_name("tiekit")
ROOT = Path(__file__).resolve().parents[1]
WTE_BYTES = 96 * 32 * 4  # the tied embedding of tests.models.gpt2()

FACTORIES = """
import torch
from torch import nn
import sys
sys.path.insert(0, {tests!r})
from models import ViewBuffers, gpt2


def tied():
    return gpt2()


def untied():
    return gpt2(tie_word_embeddings=False)


def wider():
    return gpt2(n_embd=64)


def views():
    return ViewBuffers()


def needs_data():
    model = ViewBuffers()
    model.scale = float(model.w.detach().abs().sum())  # .item() on meta raises: built on the CPU instead
    return model


def not_a_model():
    return 42


def embedding_alone():  # the model of the test's tied file without its head
    return nn.Sequential(nn.Embedding(10, 4))


def broken():
    raise RuntimeError("the config file is missing")


class Abort(BaseException):  # a user's own, as frameworks raise to stop a run
    pass


def aborts():
    raise Abort("stop")


def chatty():  # prints as it builds, as many training scripts do
    print("building the model...")
    return gpt2()


def reads_the_command_line():  # as a training script's build() does
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, required=True)
    return parser.parse_args().width
"""


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of factories in a fresh current directory; returns its (unique) module name."""
    name = f"factories_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(FACTORIES.format(tests=str(ROOT / "tests")))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield name
    sys.modules.pop(name, None)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_inspect_tiekit_file_reports_groups_sizes_and_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "model.safetensors"
    tiekit.save_model(gpt2(), path)
    code, out, _ = run(capsys, "inspect", str(path), "--json")
    report = json.loads(out)
    assert code == 0
    assert (report["plan_origin"], report["plan_version"]) == ("tiekit", tiekit.PLAN_VERSION)
    assert (report["stored_tensors"], report["names"]) == (28, 29)
    assert report["saved_bytes"] == WTE_BYTES
    assert report["stored_bytes"] == sum(t["bytes"] for t in report["tensors"])
    assert report["stored_bytes"] + 8 < path.stat().st_size  # header + data
    assert tiekit.TiePlan.from_dict(report["plan"]).source_of("lm_head.weight") == "transformer.wte.weight"

    code, out, _ = run(capsys, "inspect", str(path))
    assert code == 0
    assert "recorded by tiekit (plan format v1)" in out
    assert "28 stored for 29 names" in out
    assert "12.0 KiB saved by de-duplication" in out
    assert "transformer.wte.weight  parameter  96x32  float32  lm_head.weight" in out


def test_inspect_sharded_index_and_its_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiekit.save_model(gpt2(), tmp_path, max_shard_size="40KB")
    by_folder = json.loads(run(capsys, "inspect", str(tmp_path), "--json")[1])
    index = tmp_path / "model.safetensors.index.json"
    by_index = json.loads(run(capsys, "inspect", str(index), "--json")[1])
    assert by_folder == by_index
    # The file path such a save is given (no file there: its index beside it) reads the index.
    assert json.loads(run(capsys, "inspect", str(tmp_path / "model.safetensors"), "--json")[1]) == by_index
    assert len(by_index["files"]) > 1 and by_index["path"] == str(index)
    assert (by_index["stored_tensors"], by_index["names"], by_index["saved_bytes"]) == (28, 29, WTE_BYTES)
    out = run(capsys, "inspect", str(index), "--tensors")[1]
    assert f"{len(by_index['files'])} shard files" in out
    assert "transformer.h.1.mlp.c_fc.weight" in out and "lm_head.weight  float32" not in out


def test_inspect_save_sharded_folder_counts_its_data_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder one rank saved holds one data file (and DCP's .metadata, which holds no tensor)."""
    tiekit.save_sharded(gpt2(), tmp_path / "ckpt")
    code, out, _ = run(capsys, "inspect", str(tmp_path / "ckpt"))
    assert code == 0
    assert out.splitlines()[0].startswith(f"{tmp_path / 'ckpt'}: 1 file, "), out


def test_inspect_plain_file_says_no_plan_and_finds_a_tie_stored_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = gpt2()
    path = tmp_path / "plain.safetensors"
    save_file({k: v.clone() for k, v in model.state_dict().items()}, path)
    code, out, _ = run(capsys, "inspect", str(path))
    assert code == 0
    assert "tie plan: none recorded" in out
    assert "29 stored for 29 names" in out and "0 B saved" in out
    assert "storage sharing is not visible in a file" in out

    report = json.loads(run(capsys, "inspect", str(path), "--json", "--check-values")[1])
    assert report["plan_origin"] == "none" and report["plan"] is None
    # Constant tensors (zero biases, LayerNorm ones) are equal by construction and left out.
    assert report["identical"] == [["lm_head.weight", "transformer.wte.weight"]]

    # A Hugging Face folder: save_pretrained drops the declared duplicate and records nothing.
    model.save_pretrained(tmp_path / "hf")
    report = json.loads(run(capsys, "inspect", str(tmp_path / "hf"), "--json")[1])
    assert report["path"] == str(tmp_path / "hf" / "model.safetensors")
    assert (report["plan_origin"], report["stored_tensors"], report["names"]) == ("none", 28, 28)


def test_inspect_lists_what_safetensors_save_model_dropped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "st.safetensors"
    st_save_model(gpt2(), str(path), metadata={"author": "me"})
    report = json.loads(run(capsys, "inspect", str(path), "--json")[1])
    assert report["plan_origin"] == "safetensors"
    [group] = report["plan"]["groups"]
    kept = group["source"]
    removed = [m["name"] for m in group["members"][1:]]
    assert sorted([kept, *removed]) == ["lm_head.weight", "transformer.wte.weight"]
    assert report["metadata"] == {"author": "me"}  # the removed -> kept entries are the plan, not metadata
    out = run(capsys, "inspect", str(path))[1]
    assert "safetensors.save_model listed the duplicates it dropped" in out


def test_inspect_training_checkpoint_counts_optimizer_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 96, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    tiekit.save_checkpoint(tmp_path, model=model, optimizer=optimizer, step=7)
    report = json.loads(run(capsys, "inspect", str(tmp_path), "--json")[1])
    assert report["checkpoint_version"] == 1
    assert report["stored_tensors"] == 28
    # exp_avg and exp_avg_sq per unique parameter, plus the step tensors, stored once per tie group
    assert report["optimizer_tensors"] >= 2 * 28
    assert report["optimizer_bytes"] >= 2 * report["stored_bytes"]


def test_inspect_factory_builds_on_meta_and_falls_back_to_cpu(
    factories: str, capsys: pytest.CaptureFixture[str]
) -> None:
    report = json.loads(run(capsys, "inspect", f"{factories}:views", "--json")[1])
    assert (report["model"], report["device"], report["note"]) == ("ViewBuffers", "meta", "")
    [group] = report["plan"]["groups"]
    assert group["kind"] == "view" and [m["name"] for m in group["members"]] == ["w", "wt", "ws", "wv"]
    assert report["saved_bytes"] == (24 + 12 + 24) * 4  # wt, ws (4x3), wv: rebuilt as views, never stored

    report = json.loads(run(capsys, "inspect", f"{factories}:needs_data", "--json")[1])
    assert report["device"] == "cpu"
    assert "failed on the meta device" in report["note"] and "built on the CPU" in report["note"]

    code, out, _ = run(capsys, "inspect", f"{factories}:tied")
    assert code == 0
    assert out.startswith(f"{factories}:tied -> GPT2LMHeadModel, built on meta (no memory allocated)")
    assert "transformer.wte.weight  parameter  96x32  float32  lm_head.weight" in out


def test_inspect_model_given_a_model_object_says_it_takes_a_factory_name() -> None:
    from tiekit.inspection import inspect_model

    with pytest.raises(tiekit.TiekitError, match=r"'module:factory' string, not given as a GPT2LMHeadModel"):
        inspect_model(gpt2())  # type: ignore[arg-type]  # a TypeError from re before


def test_verify_exit_codes_for_ci(factories: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.safetensors"
    tiekit.save_model(gpt2(), path)
    before = digest(path)

    code, out, _ = run(capsys, "verify", str(path), "--model", f"{factories}:tied")
    assert code == 0, out
    assert out.splitlines()[-1] == "PASSED"
    assert "ok    load: 28 stored tensors filled 29 names of GPT2LMHeadModel; no key missing" in out
    assert "ok    ties: 1 group(s) hold (lm_head.weight -> transformer.wte.weight)" in out
    assert "ok    parameters: 28 unique under 29 names" in out

    code, out, _ = run(capsys, "verify", str(path), "--model", f"{factories}:untied", "--json")
    report = json.loads(out)
    assert code == 1 and report["ok"] is False
    failed = [c for c in report["checks"] if not c["ok"]]
    assert [c["name"] for c in failed] == ["parameters"]
    assert "the file ties lm_head.weight, transformer.wte.weight" in failed[0]["detail"]

    code, out, _ = run(capsys, "verify", str(path), "--model", f"{factories}:wider")
    assert code == 1
    assert "FAIL  load:" in out and "shape mismatch for 'transformer.wte.weight'" in out
    assert out.splitlines()[-1] == "FAILED: 1 of 2 check(s)"
    assert digest(path) == before  # verify never writes

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-100])
    code, out, _ = run(capsys, "verify", str(truncated), "--model", f"{factories}:tied")
    assert code == 1 and "FAIL  file:" in out and "truncated" in out


def test_verify_fails_a_file_tying_a_name_the_model_lacks(
    factories: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The file stores the head once, under the embedding, and its plan names it: verify into a
    model without the head PASSED, saying "the file records no tie" (probe); the load is refused
    (torch's load_state_dict calls it unexpected), for a file and a sharded folder."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    tiekit.save_model(model, tmp_path / "tied.safetensors")
    tiekit.save_sharded(model, tmp_path / "tied-sharded")
    for path in ("tied.safetensors", "tied-sharded"):
        code, out, _ = run(capsys, "verify", str(tmp_path / path), "--model", f"{factories}:embedding_alone")
        assert code == 1, out
        assert "FAIL  load: " in out and "does not match Sequential: unexpected '1.weight'" in out, out
        assert "records no tie" not in out and out.splitlines()[-1] == "FAILED: 1 of 2 check(s)"


def test_verify_fails_on_a_floating_dtype_the_load_casts(
    factories: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bfloat16 checkpoint loads into a float32 model (cast, as load_state_dict does), but the
    model then does not hold the file's values: verify fails the load check, naming the keys and
    both dtypes, for a safetensors file (load_model) and a save_sharded folder (load_sharded)."""
    model = gpt2().to(torch.bfloat16)
    tiekit.save_model(model, tmp_path / "bf16.safetensors")
    tiekit.save_sharded(model, tmp_path / "bf16-sharded")
    for path, loader in [("bf16.safetensors", "tiekit.load_model"), ("bf16-sharded", "tiekit.load_sharded")]:
        code, out, _ = run(capsys, "verify", str(tmp_path / path), "--model", f"{factories}:tied")
        assert code == 1, out
        load = next(line for line in out.splitlines() if "load:" in line)
        assert load.startswith(f"  FAIL  load: {tmp_path / path}: dtype mismatch for 'transformer."), load
        assert "and 25 more: the file has bfloat16, the model float32; the file still loads" in load
        assert f"(28 stored tensors filled 29 names of GPT2LMHeadModel): {loader} casts them" in load
        assert "ok    ties: 1 group(s) hold" in out  # the checks of the loaded model still run
        assert out.splitlines()[-1] == "FAILED: 1 of 4 check(s)"
    code, out, _ = run(capsys, "verify", str(tmp_path / "bf16.safetensors"), "--model", f"{factories}:tied", "--json")
    failed = [c for c in json.loads(out)["checks"] if not c["ok"]]
    assert [c["name"] for c in failed] == ["load"] and "'transformer.h.0.attn.c_attn.bias'" in failed[0]["detail"]


def test_factory_errors_are_one_line_with_a_hint(factories: str, capsys: pytest.CaptureFixture[str]) -> None:
    cases = {
        f"{factories}:not_a_model": "returned a int, not an nn.Module",
        f"{factories}:broken": "RuntimeError: the config file is missing",
        f"{factories}:missing": f"{factories!r} has no attribute 'missing'",
        "no_such_module_here:build": "cannot import 'no_such_module_here'",
        # argparse's own exit (code 2, tiekit's usage error) ended the command before
        f"{factories}:reads_the_command_line": "() failed: SystemExit: 2 (it exited, as sys.exit and argparse do",
        f"{factories}:aborts": "aborts() failed: Abort: stop",  # a BaseException: was a full traceback
    }
    for spec, message in cases.items():
        code, out, err = run(capsys, "inspect", spec)
        argparse = ("usage: ", "error: the following arguments are required")  # what the factory's parser printed
        lines = [line for line in err.splitlines() if not any(text in line for text in argparse)]
        assert code == 1 and out == ""
        assert len(lines) == 2 and message in lines[0] and lines[0].startswith("tiekit: error: ")
        assert lines[1].startswith("hint: a factory is 'module:function'")
        assert "Traceback" not in err


def test_a_factory_raising_a_base_exception_is_one_line_from_the_console(factories: str, tmp_path: Path) -> None:
    """An exception outside Exception (not SystemExit or KeyboardInterrupt) printed Python's traceback."""
    for argv in (["inspect", f"{factories}:aborts"], ["verify", "x.safetensors", "--model", f"{factories}:aborts"]):
        result = subprocess.run(
            [sys.executable, "-m", "tiekit", *argv],
            cwd=tmp_path,
            env=base_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert result.returncode == 1 and result.stdout == "", (argv, result)
        lines = result.stderr.splitlines()
        assert lines[0] == f"tiekit: error: {factories}:aborts() failed: Abort: stop" and len(lines) == 2, result.stderr


@pytest.mark.newest_torch_only  # the CLI's own output, the same on both stacks: run once
def test_json_output_holds_the_json_alone_when_the_factory_prints(
    factories: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A factory's print went to stdout before the JSON, which then did not parse; it goes to stderr.
    In this process (the CLI's main, its output captured): a process per command took 30 s of the
    suite; the console script itself runs in test_console_script_error_is_one_line_..."""
    tiekit.save_model(gpt2(), tmp_path / "model.safetensors")
    tiekit.save_sharded(gpt2(), tmp_path / "ck")
    for argv in (
        ["inspect", f"{factories}:chatty"],
        ["verify", str(tmp_path / "model.safetensors"), "--model", f"{factories}:chatty"],
        ["convert", str(tmp_path / "ck"), str(tmp_path / "out.safetensors"), "--model", f"{factories}:chatty"],
    ):
        code, out, err = run(capsys, *argv, "--json")
        assert code == 0 and "building the model..." in err, (argv, out, err)
        assert isinstance(json.loads(out), dict), (argv, out)
    code, out, _ = run(capsys, "inspect", f"{factories}:chatty")  # without --json the print stays where it was
    assert code == 0 and out.startswith("building the model...\n")


def test_console_script_error_is_one_line_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    missing = tmp_path / "nothing.safetensors"
    result = subprocess.run([TIEKIT, "inspect", str(missing)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"tiekit: error: {missing}: no such file or folder, and not module:factory",
        "hint: TARGET is a .safetensors file, a *.safetensors.index.json, a folder holding one, a tiekit.save_sharded "
        "folder or a plain torch.distributed.checkpoint one, or module:factory; run again with --debug for the full "
        "traceback",
    ]
    result = subprocess.run(
        [TIEKIT, "--debug", "inspect", str(missing)], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr and "TargetError" in result.stderr
    # `python -m tiekit` is the same command; a path that exists but is no file is named as such.
    result = subprocess.run(
        [sys.executable, "-m", "tiekit", "inspect", os.devnull], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines()[0] == f"tiekit: error: {os.devnull}: not a regular file"


@pytest.mark.parametrize("command", ["inspect", "verify", "convert"])
def test_debug_after_the_command_shows_the_traceback(tmp_path: Path, command: str) -> None:
    """Every error's hint says "run again with --debug", and `tiekit inspect x --debug` was
    argparse's "unrecognized arguments" (exit code 2)."""
    missing = str(tmp_path / "nothing.safetensors")
    argv = {"inspect": [missing], "verify": [missing, "--model", "m:f"], "convert": [missing, str(tmp_path / "o")]}
    with pytest.raises(tiekit.TiekitError, match=r"nothing\.safetensors: no such file|cannot import 'm'"):
        main([command, *argv[command], "--debug"])


def test_file_errors_version_and_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    code, out, err = run(capsys, "inspect", str(garbage))
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.splitlines() == [
        f"tiekit: error: {garbage}: oversized header ({2**64 - 1} bytes, the limit is 100000000)",
        "hint: see 'Errors and how to recover' in docs/checkpoints.md; run again with --debug for the full traceback",
    ]
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"tiekit {tiekit.__version__}"
    with pytest.raises(SystemExit) as exit_info:
        main(["verify", str(garbage)])
    assert exit_info.value.code == 2 and "--model" in capsys.readouterr().err  # argparse's usage error


def test_inspect_example_factory_from_the_repository_root(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(ROOT))])
    report = json.loads(run(capsys, "inspect", "examples.tied_lm:build", "--json")[1])
    assert (report["model"], report["device"]) == ("TiedLM", "meta")
    assert [m["name"] for m in report["plan"]["groups"][0]["members"]] == ["embed.weight", "head.weight"]


def test_inspect_of_a_folder_of_sharded_checkpoints_names_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint_dir of fit's sharded strategies (a step-<step>/ folder per checkpoint) said
    only "no safetensors file or index in this folder" (found by a probe)."""
    for step in (1, 2):
        tiekit.save_sharded(gpt2(), tmp_path / f"step-{step:08d}")
    (tmp_path / "step-00000003").mkdir()  # a save killed before its commit: not a checkpoint
    code, _, err = run(capsys, "inspect", str(tmp_path))
    said = (
        f"{tmp_path}: no safetensors file or index in this folder; it holds 2 sharded checkpoint folder(s) "
        f"(step-00000001, step-00000002): name one of them, such as {tmp_path / 'step-00000002'}"
    )
    assert code == 1 and err.startswith(f"tiekit: error: {said}"), err
    code, out, _ = run(capsys, "inspect", str(tmp_path / "step-00000002"))
    assert code == 0 and "transformer.wte.weight" in out, out


def refused_by_inspect_convert_and_verify(
    capsys: pytest.CaptureFixture[str], factories: str, path: Path, said: str, out_dir: Path
) -> None:
    """Each command fails on ``path`` with ``said`` (verify as its failed check), writing nothing."""
    for argv in (["inspect", str(path)], ["convert", str(path), str(out_dir / "out.safetensors")]):
        code, _, err = run(capsys, *argv)
        assert code == 1 and err.startswith(f"tiekit: error: {said}"), (argv, err)
    code, out, _ = run(capsys, "verify", str(path), "--model", f"{factories}:tied")
    assert code == 1 and f"FAIL  file: {said}" in out, out
    assert not (out_dir / "out.safetensors").exists()


def test_a_sharded_folder_without_its_marker_is_named_so_by_inspect_convert_and_verify(
    factories: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """They said "no safetensors file or index in this folder"; load_sharded says the marker is missing."""
    folder = tmp_path / "ck"
    tiekit.save_sharded(gpt2(), folder)
    (folder / "tiekit-dcp.json").unlink()  # deleted, or a save killed before its first commit
    said = f"{folder}: no tiekit-dcp.json (not a committed sharded checkpoint)"
    with pytest.raises(tiekit.CheckpointError, match=r"no tiekit-dcp\.json \(not a committed sharded checkpoint\)"):
        tiekit.load_sharded(gpt2(), folder)
    refused_by_inspect_convert_and_verify(capsys, factories, folder, said, tmp_path)


def test_a_folder_holding_a_file_and_an_index_is_refused_by_inspect_convert_and_verify(
    factories: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """They read the index's checkpoint and left a.safetensors unsaid, as load_model did (probe)."""
    folder = tmp_path / "both"
    tiekit.save_model(gpt2(), folder / "a.safetensors")
    tiekit.save_model(gpt2(), folder / "b.safetensors", max_shard_size=WTE_BYTES)
    said = f"{folder}: several checkpoints in this folder (a.safetensors, b.safetensors.index.json); name one"
    refused_by_inspect_convert_and_verify(capsys, factories, folder, said, tmp_path)
    code, out, _ = run(capsys, "inspect", str(folder / "b.safetensors.index.json"))
    assert code == 0 and "shard files" in out, out


def test_convert_names_a_damaged_record_as_verify_does(
    factories: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """convert's one-line error was torch's "Weights only load failed ... Re-running `torch.load` with
    `weights_only` set to `False` will likely succeed, but it can result in arbitrary code execution
    ... Please file an issue", where verify names the file, the key, its bytes and the cause (probe)."""
    tiekit.save_sharded(gpt2(), tmp_path / "ck")
    shard = next((tmp_path / "ck").glob("save-*/__0_0.distcp"))
    data = bytearray(shard.read_bytes())
    data[:100] = bytes(100)  # the first record's zip header and pickle, in place: the size is kept
    shard.write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", str(tmp_path / "ck"), "--model", f"{factories}:tied")
    detail = next(line for line in out.splitlines() if line.startswith("  FAIL  load: ")).removeprefix("  FAIL  load: ")
    assert code == 1 and detail.startswith(f"{shard}: key '") and "is damaged, its record does not read (" in detail
    result = subprocess.run(
        [sys.executable, "-m", "tiekit", "convert", str(tmp_path / "ck"), str(tmp_path / "out.safetensors")],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    said = result.stderr.splitlines()[0].removeprefix("tiekit: error: ")
    assert result.returncode == 1 and said == detail.split("; the file has the size")[0], (said, detail)
    assert "weights_only" not in result.stderr and not (tmp_path / "out.safetensors").exists()


def test_a_save_folder_given_for_its_checkpoint_is_refused_by_inspect_convert_and_verify(
    factories: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """They read it as a plain DCP folder (convert wrote its optimizer/... keys as a model's, with
    no tie plan), where load_sharded refuses it."""
    model = gpt2()
    tiekit.save_sharded(model, tmp_path / "ck", optimizer=torch.optim.AdamW(model.parameters()))
    save = next((tmp_path / "ck").glob("save-*"))
    said = f"{save}: a save folder inside a checkpoint; load its parent {tmp_path / 'ck'}"
    with pytest.raises(tiekit.CheckpointError, match=re.escape(said)):
        tiekit.load_sharded(gpt2(), save)
    refused_by_inspect_convert_and_verify(capsys, factories, save, said, tmp_path)
    link = tmp_path / "link"  # a link to the save folder, named otherwise: read as a plain DCP folder
    link.symlink_to(save)
    code, _, err = run(capsys, "inspect", str(link))
    assert code == 1 and "a save folder inside a checkpoint; load its parent" in err, err
