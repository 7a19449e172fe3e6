"""How the processes of a run meet before they form a process group: in a store `fit` holds
for the processes it spawns (`rendezvous_store`), in torchrun's store under a prefix of this
launch (`collective_store_of_this_launch`), or, started without a launcher, in a store rank 0
hosts at ``MASTER_ADDR:MASTER_PORT``, bounded and saying what it waits for
(`collective_join_by_environment`)."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, cast

from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]  # not in its __all__
from torch.distributed.constants import default_pg_timeout

from tiekit.errors import TiekitError


def rendezvous_store() -> TCPStore:
    """A store on 127.0.0.1 for the processes `fit` spawns to meet in, on a port the system chose
    and this process holds: keep it until they are done (they connect to ``store.port``). A
    port found free and handed to rank 0 to listen on could be taken meanwhile (by another run
    spawning its processes: seen in CI, "EADDRINUSE"). Local."""
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=default_pg_timeout)


LAUNCH_KEY = "tiekit/launch"  # in torchrun's store: "<witness port> <nonce>" of the latest launch's rank 0


def collective_store_of_this_launch(rank: int, timeout: timedelta) -> tuple[Store, TCPStore | None]:
    """Collective (waits for rank 0): torchrun's store, under a prefix no earlier launch of these
    workers used, and on rank 0 the witness store to keep until every rank has joined the group.

    torchrun keeps its store through the restarts of ``--max-restarts``, and torch's ``env://``
    (2.9 to 2.14 at least) joins the default group in it without a prefix per restart, so a
    restarted rank could read the gloo address a rank of the failed launch published, its process
    gone, and fail ("Connection refused") or leave the others waiting. ``TORCHELASTIC_RESTART_COUNT``
    is not the same on every node (pytorch issue 108158), so the prefix is a nonce rank 0 draws;
    a rank tells this launch's nonce from one an earlier launch left by reading it back from a
    store rank 0 hosts meanwhile (the witness): the rank 0 of an earlier launch is dead.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = TCPStore(host, port, is_master=False, timeout=timeout)
    if rank == 0:
        nonce = uuid.uuid4().hex
        witness = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        witness.set("nonce", nonce)
        agent.set(LAUNCH_KEY, f"{witness.port} {nonce}")
        return PrefixStore(f"tiekit/{nonce}", agent), witness
    deadline = time.monotonic() + timeout.total_seconds()
    published = ""
    while time.monotonic() < deadline:
        published = agent.get(LAUNCH_KEY).decode()  # waits for the first launch's rank 0
        witness_port, nonce = published.split()
        if _witness_confirms(host, int(witness_port), nonce):
            return PrefixStore(f"tiekit/{nonce}", agent), None
        time.sleep(0.05)  # an earlier launch's announcement: wait for this launch's rank 0
    raise TiekitError(
        f"rank {rank}: rank 0 of this launch did not announce itself in torchrun's store at {host}:{port} "
        f"within {timeout.total_seconds():g} s (the last announcement there, {published!r}, is not confirmed "
        "by a live rank 0: an earlier launch's)"
    )


def _witness_confirms(host: str, port: int, nonce: str) -> bool:
    try:
        # A dead rank 0's port refuses at once; TCPStore would retry it, logging every attempt.
        socket.create_connection((host, port), timeout=2).close()
        witness = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=2))
        return bool(witness.get("nonce").decode() == nonce)
    except (OSError, RuntimeError):  # refused (its process is gone), or not a store holding a nonce
        return False


JOIN_TIMEOUT = "TIEKIT_JOIN_TIMEOUT"  # seconds processes started without a launcher wait for each other
_FIRST_NOTICE = 30.0  # seconds before a waiting rank says what it waits for (at most half the bound)
_NOTICE_EVERY = 60.0  # and then how often it says it again
_ARRIVALS = "tiekit/env-join/arrivals"


def join_timeout(env: Mapping[str, str]) -> float:
    """Local: seconds the processes of a run started without a launcher wait for each other to
    join (`collective_join_by_environment`): ``TIEKIT_JOIN_TIMEOUT`` when set, else torch's
    default process-group timeout (30 minutes)."""
    text = env.get(JOIN_TIMEOUT)
    if text is None:
        return default_pg_timeout.total_seconds()
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise TiekitError(f"{JOIN_TIMEOUT}={text!r} in the environment must be a positive number of seconds")
    return seconds


def collective_join_by_environment(rank: int, world: int, env: Mapping[str, str]) -> Store:
    """Collective: the store of a run whose processes were started without a launcher (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set by hand, as torch's ``env://`` reads
    them), once every rank has arrived in it: rank 0 hosts it at ``MASTER_PORT``, the others
    connect to ``MASTER_ADDR:MASTER_PORT``. Waits for every rank for at most `join_timeout`
    seconds, saying on stderr (after 30 s, then every minute) which ranks it waits for; then
    `TiekitError`. torch's ``env://`` waited silently for 30 minutes, so variables left over in
    a shell from another run made a lone process hang with nothing said.

    `TiekitError` when ``MASTER_ADDR`` or ``MASTER_PORT`` is missing or not an address, or when
    rank 0 cannot listen on ``MASTER_PORT``."""
    seen = ", ".join(f"{name}={env[name]}" for name in _LAUNCH_VARIABLES if name in env)
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]
    if missing:
        raise TiekitError(
            f"{seen} in the environment, without {' or '.join(missing)}: processes started without a launcher "
            "(no torchrun) meet at MASTER_ADDR:MASTER_PORT, so set both on every process; or, if no launcher "
            "started this one, these are leftovers from another run: unset them"
        )
    host = env["MASTER_ADDR"]
    try:
        port = int(env["MASTER_PORT"])
    except ValueError:
        port = -1
    if not 0 < port < 2**16:
        raise TiekitError(f"MASTER_PORT={env['MASTER_PORT']!r} in the environment must be a port number (1 to 65535)")
    bound = join_timeout(env)
    waiting = _JoinWait(rank, world, f"{host}:{port}", seen, bound)
    if rank == 0:
        try:
            # Hosted as torch's env:// hosts it (multi-tenant), but not waiting for the workers
            # to connect inside the constructor, where nothing could say what it waits for.
            store = TCPStore(
                host, port, is_master=True, wait_for_workers=False, multi_tenant=True, timeout=timedelta(seconds=bound)
            )
        except RuntimeError as exc:
            raise TiekitError(
                f"rank 0 of {world} cannot listen on MASTER_PORT={port} ({seen} in the environment): {exc}. "
                "Another process uses the port (another run's rank 0?): choose another MASTER_PORT"
            ) from exc
    else:
        store = waiting.connect(host, port)
    try:
        # Arrivals count up across joins in one store (a store kept alive in this process
        # since an earlier fit): this join's generation is the world-sized block this rank fell in.
        generation = (store.add(_ARRIVALS, 1) - 1) // world
        store.set(f"{_ARRIVALS}/{generation}/{rank}", "")
        while store.add(_ARRIVALS, 0) < (generation + 1) * world:
            waiting.tick(
                lambda: _name_ranks([r for r in range(world) if not store.check([f"{_ARRIVALS}/{generation}/{r}"])])
            )
            time.sleep(0.1)
    except RuntimeError as exc:  # rank 0, hosting the store, has gone
        raise TiekitError(f"{waiting.who}: the store at {host}:{port} failed while the ranks met: {exc}") from exc
    # The group's waits in it (gloo's, tiekit's collectives') are bounded as env://'s, not by what was left of the join.
    store.set_timeout(default_pg_timeout)
    return store


_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class _JoinWait:
    """The clock of one rank waiting for the others in `collective_join_by_environment`: what it
    says on stderr while it waits, and the `TiekitError` once the bound is past."""

    def __init__(self, rank: int, world: int, where: str, seen: str, bound: float) -> None:
        self.who = f"rank {rank} of {world}"
        self.where, self.seen, self.bound = where, seen, bound
        self.start = time.monotonic()
        self.next_notice = self.start + min(_FIRST_NOTICE, bound / 2)

    def remaining(self) -> float:
        return self.start + self.bound - time.monotonic()

    def describe(self, missing: str, waited: str) -> str:
        return (
            f"{self.who} {waited} at {self.where} for {missing} to join. "
            f"{self.seen} came from the environment, set by hand or by a launcher other than torchrun: start "
            "the other processes with the same MASTER_ADDR and MASTER_PORT, or, if none is coming, these are leftovers "
            f"from another run: unset them. Bound: {self.bound:g} s ({JOIN_TIMEOUT} in the environment sets it)"
        )

    def tick(self, missing: Callable[[], str]) -> None:
        """Say what this rank waits for when it is time to (``missing`` names the ranks still
        absent); `TiekitError` once the bound is past."""
        now = time.monotonic()
        if now - self.start >= self.bound:
            raise TiekitError(self.describe(missing(), f"gave up after waiting {now - self.start:.0f} s"))
        if now >= self.next_notice:
            print(
                f"tiekit: {self.describe(missing(), f'has waited {now - self.start:.0f} s')}",
                file=sys.stderr,
                flush=True,
            )
            self.next_notice = now + _NOTICE_EVERY

    def connect(self, host: str, port: int) -> TCPStore:
        """A client of rank 0's store, once rank 0 listens at ``host:port``."""
        while True:
            try:
                # TCPStore would retry a refused connection itself, silently or logging every attempt.
                socket.create_connection((host, port), timeout=min(2.0, max(0.1, self.remaining()))).close()
                break
            except OSError:
                self.tick(lambda: "rank 0 (nothing listens there yet)")
                time.sleep(0.2)
        made: dict[str, Any] = {}

        def make() -> None:
            try:
                made["store"] = TCPStore(
                    host, port, is_master=False, timeout=timedelta(seconds=max(1.0, self.remaining()))
                )
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                made["error"] = exc

        # In a thread of its own: TCPStore's handshake waits for an answer without its timeout, so
        # a program holding the port that is no store (a MASTER_PORT left from another run) kept
        # this rank waiting for good, saying nothing. Left behind (a daemon) if it never returns.
        thread = threading.Thread(target=make, name="tiekit-store-client", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            if thread.is_alive():
                self.tick(lambda: "rank 0's store (something listens there but does not answer as one)")
        if "error" in made:
            raise TiekitError(
                f"{self.who}: what listens at {self.where} (MASTER_ADDR:MASTER_PORT) is not rank 0's store: "
                f"{made['error']}"
            ) from made["error"]
        return cast(TCPStore, made["store"])


def _name_ranks(ranks: list[int]) -> str:
    """How a message names ``ranks``: rank 1; ranks 1, 2 and 5; ranks 1, 2, 3, 4, 5, 6, ... (100 ranks)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 8:
        return f"ranks {', '.join(map(str, ranks[:6]))}, ... ({len(ranks)} ranks)"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"
