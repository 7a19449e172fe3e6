"""``tiekit inspect``, ``verify`` and ``convert`` of a sharded checkpoint the user may not read: a
`CheckpointError` naming the path ("cannot read: Permission denied"), never the raw
`PermissionError` the CLI called "not expected", nor a shard file "damaged in place".

Root reads everything whatever the permissions say, so when the tests run as root the command
runs as the unprivileged uid 65534 (nobody), in a folder of /tmp every uid can search: pytest's
own temporary folder is root's alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from launching import TIMEOUT, base_env

import tiekit

# tiekit's reading and wording, the same on both stacks: run once (keeps CI under its budget).
pytestmark = pytest.mark.newest_torch_only

NOBODY = 65534
TINY = """
from torch import nn


def build():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    return model
"""


def unprivileged() -> list[str]:
    """The command prefix that drops root's privileges (none when not root). setpriv, not
    ``subprocess.run(user=...)``, whose exec of this interpreter (under root's own home) fails."""
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if os.geteuid() == 0 else []


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder every uid can search, holding ``tiny.py`` and ``ck``, a `save_sharded` checkpoint of
    ``tiny.build()``; removed afterwards, whatever its permissions became."""
    folder = Path(tempfile.mkdtemp(prefix="tiekit-permissions-", dir="/tmp"))
    try:
        folder.chmod(0o755)
        (folder / "home").mkdir(mode=0o777)
        (folder / "home").chmod(0o777)  # the unprivileged process writes its caches and outputs here
        (folder / "tiny.py").write_text(TINY)
        sys.path.insert(0, str(folder))
        try:
            import tiny  # type: ignore[import-not-found]

            tiekit.save_sharded(tiny.build(), folder / "ck")
        finally:
            sys.path.remove(str(folder))
            sys.modules.pop("tiny", None)
        try:
            subprocess.run([*unprivileged(), sys.executable, "-c", ""], check=True, timeout=TIMEOUT)
        except (OSError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"cannot run a process as uid {NOBODY}: {exc}")
        yield folder
    finally:
        for path in [folder, *folder.rglob("*")]:
            path.chmod(0o777)
        shutil.rmtree(folder)


def tiekit_command(folder: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m tiekit argv`` in ``folder`` (unprivileged when the tests run as root)."""
    home = str(folder / "home")
    # Variables naming pytest's folder (TMPDIR, TORCHINDUCTOR_CACHE_DIR that torch sets under it)
    # are root's alone: the factory's build on meta failed reaching them, and fell back to the CPU.
    private = tempfile.gettempdir()
    env = {k: v for k, v in base_env().items() if not v.startswith(private)}
    return subprocess.run(
        [*unprivileged(), sys.executable, "-m", "tiekit", *argv],
        capture_output=True,
        text=True,
        cwd=folder,
        env={**env, "HOME": home, "TMPDIR": home},
        timeout=TIMEOUT,
    )


def test_an_unreadable_checkpoint_folder_is_named_by_inspect_verify_and_convert(shared: Path) -> None:
    """``Path.is_file`` raised the PermissionError of the marker's stat: "this was not expected;
    please report it", and verify crashed instead of printing FAIL."""
    (shared / "ck").chmod(0)
    said = "ck: cannot read: Permission denied"
    for argv in (["inspect", "ck"], ["convert", "ck", "home/out.safetensors"]):
        result = tiekit_command(shared, *argv)
        assert result.returncode == 1 and result.stderr.startswith(f"tiekit: error: {said}\n"), (argv, result.stderr)
        assert "not expected" not in result.stderr
    result = tiekit_command(shared, "verify", "ck", "--model", "tiny:build")
    assert result.returncode == 1 and f"FAIL  file: {said}" in result.stdout, (result.stdout, result.stderr)
    assert not (shared / "home" / "out.safetensors").exists()


def test_an_unreadable_shard_file_is_named_unreadable_not_damaged(shared: Path) -> None:
    """verify said the file's "bytes were changed in place". inspect reads no shard file (only
    the marker and DCP's metadata), so it still describes the checkpoint."""
    shard = next((shared / "ck").glob("save-*/__0_0.distcp"))
    shard.chmod(0)
    named = shard.relative_to(shared)
    result = tiekit_command(shared, "verify", "ck", "--model", "tiny:build")
    assert result.returncode == 1 and "built on meta" in result.stdout, (result.stdout, result.stderr)
    assert f"FAIL  load: {shard}: cannot read: Permission denied (it holds key " in result.stdout, result.stdout
    assert "damaged" not in result.stdout
    result = tiekit_command(shared, "convert", "ck", "home/out.safetensors")
    assert result.returncode == 1 and f"tiekit: error: {named}: unreadable (Permission denied)" in result.stderr
    assert not (shared / "home" / "out.safetensors").exists()
    assert tiekit_command(shared, "inspect", "ck").returncode == 0
