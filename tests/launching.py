"""Running real launchers in tests: never a hang, always the output of every process.

Every command starts in its own session (process group). `run_together` waits for all of them
until a deadline, and once one of them has failed, gives the others ``grace`` seconds (a peer
blocked in a collective would otherwise wait for its own timeout); then it kills, with SIGKILL
(Lightning ignores SIGTERM), every process it started and every descendant it has seen (torchrun
puts its workers in sessions of their own, so killing the agent's group would orphan them), and
fails the test with each process's output.

`audit_env` makes every Python process started with it record each ``os.rename``/``os.replace``
(the call that publishes a tiekit file) with the rank that made it, through an audit hook in a
``sitecustomize`` module: the tests count writes without touching the code under test.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent

#: Seconds one launcher run may take on a busy 2-core machine before it counts as hung.
TIMEOUT = 240.0


@dataclass(frozen=True)
class Finished:
    """One process of a run: its command, exit code and combined stdout/stderr."""

    command: tuple[str, ...]
    returncode: int
    output: str


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the system's ephemeral
    range and not handed out before by this process.

    The launcher binds it later. A port the system chose for ``bind(("", 0))`` comes from the
    ephemeral range, where the system also picks the ports of every other socket opened
    meanwhile (the other test stack runs beside this one): one took a port a test had been given
    before its rendezvous bound it (EADDRINUSE, fit's own copy of this race was seen in CI).
    Below that range only an explicit choice like this one can collide.
    """
    high = _ephemeral_start()
    low = 20000 if high > 21000 else 1024
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free TCP port in {low}-{high} after 200 tries")


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def base_env(**extra: str) -> dict[str, str]:
    """The environment of a launched process: this one's, with the repository importable,
    one thread per process and accelerate kept off XLA."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
        PATH=os.pathsep.join([str(BIN), env.get("PATH", "")]),
        OMP_NUM_THREADS="1",
        USE_TORCH_XLA="0",
        TQDM_DISABLE="1",
    )
    env.update(extra)
    return env


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


def describe(runs: list[Finished]) -> str:
    """Every process's command, exit code and the end of its output."""
    return "\n".join(f"--- {' '.join(r.command)} (exit {r.returncode}) ---\n{_tail(r.output)}" for r in runs)


def run_together(
    commands: list[list[str]],
    *,
    env: dict[str, str],
    cwd: Path,
    timeout: float = TIMEOUT,
    grace: float = 30.0,
) -> list[Finished]:
    """Start ``commands`` at once, each in its own process group; return when all have exited.

    Raises AssertionError (with every output) when they are not all done within ``timeout``
    seconds, or ``grace`` seconds after the first failure; then every process still alive is killed.
    """
    logs = [cwd / f".launch-{i}-{time.monotonic_ns()}.log" for i in range(len(commands))]
    procs: list[subprocess.Popen[bytes]] = []
    for command, log in zip(commands, logs, strict=True):
        with open(log, "wb") as out:
            procs.append(
                subprocess.Popen(
                    command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    family: dict[int, psutil.Process] = {p.pid: psutil.Process(p.pid) for p in procs}
    deadline = time.monotonic() + timeout
    reason = ""
    while True:
        _adopt_descendants(family)
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        if any(c not in (None, 0) for c in codes):
            deadline = min(deadline, time.monotonic() + grace)
            reason = f"a process failed and the others were still running {grace:g} s later"
        if time.monotonic() > deadline:
            reason = reason or f"not done within {timeout:g} s (hung?)"
            break
        time.sleep(0.2)
    killed = any(p.poll() is None for p in procs)
    _adopt_descendants(family)
    for member in family.values():
        with contextlib.suppress(psutil.Error):
            if member.is_running():  # psutil checks the creation time: never a recycled pid
                member.kill()
    for p in procs:
        p.wait()
    runs = [
        Finished(tuple(map(str, c)), int(p.returncode), log.read_text(errors="replace"))
        for c, p, log in zip(commands, procs, logs, strict=True)
    ]
    for log in logs:
        log.unlink(missing_ok=True)
    if killed:
        raise AssertionError(f"killed: {reason}\n{describe(runs)}")
    return runs


def _adopt_descendants(family: dict[int, psutil.Process]) -> None:
    """Add every live descendant of the processes in ``family`` to it."""
    for member in list(family.values()):
        with contextlib.suppress(psutil.Error):
            for child in member.children(recursive=True):
                family.setdefault(child.pid, child)


def run_ok(commands: list[list[str]], **kwargs: object) -> list[Finished]:
    """`run_together`, failing the test unless every process exited with 0."""
    runs = run_together(commands, **kwargs)  # type: ignore[arg-type]
    assert all(r.returncode == 0 for r in runs), describe(runs)
    return runs


# -- counting writes ---------------------------------------------------------------------------

SITECUSTOMIZE = textwrap.dedent(
    '''
    """Test instrumentation: log every os.rename/os.replace with the rank that made it."""
    import json, os, sys, threading

    _DIR = os.environ.get("TIEKIT_AUDIT_DIR")


    def _rank():
        collective = sys.modules.get("tiekit.collective")
        if collective is not None:
            try:
                return collective.ranks().rank
            except Exception:
                pass
        return int(os.environ.get("RANK", "-1"))


    def _hook(event, args):
        if event != "os.rename":
            return
        record = {
            "pid": os.getpid(),
            "thread": threading.get_ident(),
            "rank": _rank(),
            "src": os.path.realpath(os.fsdecode(args[0])),
            "dst": os.path.realpath(os.fsdecode(args[1])),
        }
        with open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a") as log:
            log.write(json.dumps(record) + "\\n")


    if _DIR:
        sys.addaudithook(_hook)
    '''
)


def audit_env(folder: Path) -> dict[str, str]:
    """Environment entries that make every Python process log its renames into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(folder), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {"TIEKIT_AUDIT_DIR": str(folder), "PYTHONPATH": path}


def renames(folder: Path, into: Path) -> dict[str, list[int]]:
    """{file name: ranks that renamed a file onto it} for the targets inside ``into``."""
    found: dict[str, list[int]] = {}
    for log in sorted(folder.glob("*.jsonl")):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            target = Path(record["dst"])
            if target.parent == into.resolve():
                found.setdefault(target.name, []).append(int(record["rank"]))
    return {name: sorted(ranks) for name, ranks in sorted(found.items())}
