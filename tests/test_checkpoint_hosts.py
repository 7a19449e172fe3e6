"""Several hosts saving into one shared folder: a save cleans up only the work folders that dead
processes of its own host left, never another host's save in progress.

Two real processes claim to be different hosts: each runs in its own UTS namespace (its own
host name), and the second also in its own PID namespace, so, as on another machine, it cannot
see the first one's process: to it, the first writer's process id is dead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from models import WeightSharingModule

import tiekit

ROOT = Path(__file__).resolve().parents[1]

WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    from models import WeightSharingModule
    import tiekit

    folder = Path(sys.argv[1])

    def pause_before_publishing(event, args):
        if event == "os.rename" and str(args[1]).endswith("a.safetensors"):
            (folder.parent / "paused").write_text("")  # the work folder holds the whole file now
            while not (folder.parent / "go").exists():
                time.sleep(0.05)

    sys.addaudithook(pause_before_publishing)
    torch.manual_seed(1)
    try:
        tiekit.save_model(WeightSharingModule(), folder / "a.safetensors")
    except tiekit.CheckpointError as exc:
        print("FAILED", exc)
        sys.exit(3)
    print("SAVED")
    """
)

OTHER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from models import WeightSharingModule
    import tiekit

    tiekit.save_model(WeightSharingModule(), Path(sys.argv[1]) / "b.safetensors")
    """
)


def _as_host(host: str, script: Path, folder: Path, own_pids: bool) -> list[str]:
    flags = ["--uts", "--pid", "--fork"] if own_pids else ["--uts"]
    command = f'hostname {host} && exec "{sys.executable}" "{script}" "{folder}"'
    return ["unshare", *flags, "sh", "-c", command]


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--uts", "--pid", "--fork", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(
    os.name != "posix" or not _namespaces_work(), reason="needs unshare (root, Linux namespaces)"
)


@pytest.mark.parametrize("second_host", ["host-b", "host-a"])
def test_a_save_never_removes_another_hosts_save_in_progress(tmp_path: Path, second_host: str) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    writer, other = tmp_path / "writer.py", tmp_path / "other.py"
    writer.write_text(WRITER)
    other.write_text(OTHER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}

    first = subprocess.Popen(
        _as_host("host-a", writer, folder, own_pids=False),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "paused").exists():
            assert first.poll() is None, first.communicate()[0]
            assert time.monotonic() < deadline, "the first writer never reached its rename"
            time.sleep(0.05)
        work = [p.name for p in folder.iterdir() if ".tiekit-tmp-" in p.name]
        assert len(work) == 1 and "host-a-" in work[0]

        # A second host saves into the same folder while the first is paused mid-save.
        done = subprocess.run(
            _as_host(second_host, other, folder, own_pids=True), env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-3000:]
        left = [p.name for p in folder.iterdir() if ".tiekit-tmp-" in p.name]
    finally:
        (tmp_path / "go").write_text("")
        out = first.communicate(timeout=120)[0]

    if second_host == "host-b":
        assert left == work  # another host's work folder is not ours to judge
        assert first.returncode == 0 and "SAVED" in out, out
        torch.manual_seed(1)
        expected = WeightSharingModule()
        loaded = WeightSharingModule()
        tiekit.load_model(loaded, folder / "a.safetensors")
        assert torch.equal(loaded.layer_2.weight, expected.layer_2.weight)
        assert loaded.layer_3.weight is loaded.layer_1.weight
    else:
        # The control: a process of the same host whose writer it cannot see (a dead process id)
        # is garbage to it. This is exactly what a host-blind cleanup does to another host's save.
        assert left == []
        assert first.returncode == 3 and "FAILED" in out, out
    assert (folder / "b.safetensors").is_file()


@pytest.mark.parametrize("sharded", [False, True])
def test_checkpoints_are_as_readable_as_torch_saves(tmp_path: Path, sharded: bool) -> None:
    """safetensors alone creates 0600 files: other users of a shared folder could not load them."""
    old = os.umask(0o022)
    try:
        torch.save({}, tmp_path / "reference.pt")
        kwargs = {"max_shard_size": 1500} if sharded else {}
        tiekit.save_model(WeightSharingModule(), tmp_path / "ckpt", **kwargs)  # type: ignore[arg-type]
    finally:
        os.umask(old)
    expected = (tmp_path / "reference.pt").stat().st_mode & 0o777
    files = [p for p in (tmp_path / "ckpt").iterdir() if p.name.endswith(".safetensors")]
    assert len(files) > 1 if sharded else len(files) == 1
    for path in files:
        assert path.stat().st_mode & 0o777 == expected == 0o644, path.name
