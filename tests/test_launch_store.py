"""How fit joins torchrun's store (`collective_store_of_this_launch`), in one process: torchrun's
store is a real TCPStore this test hosts, the ranks are threads, a dead rank 0 is a closed port."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from tiekit import TiekitError
from tiekit.backends.rendezvous import LAUNCH_KEY, collective_store_of_this_launch


@pytest.fixture
def torchruns_store(monkeypatch: pytest.MonkeyPatch) -> dist.Store:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    return store


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed on return: connecting is refused


def test_a_rank_waits_past_a_dead_launchs_announcement_for_its_own_rank_0(torchruns_store: dist.Store) -> None:
    torchruns_store.set(LAUNCH_KEY, f"{_dead_port()} nonce-of-a-dead-launch")
    joined: dict[int, dist.Store] = {}

    def rank_1() -> None:
        joined[1] = collective_store_of_this_launch(1, timedelta(seconds=30))[0]

    thread = threading.Thread(target=rank_1)
    thread.start()  # rank 1 asks first and finds the dead launch's announcement
    thread.join(timeout=0.5)
    assert thread.is_alive()  # it did not take it
    store_0, witness = collective_store_of_this_launch(0, timedelta(seconds=30))
    thread.join(timeout=20)
    assert not thread.is_alive() and witness is not None
    store_0.set("from-rank-0", b"hello")  # both ranks write and read under one fresh prefix
    assert joined[1].get("from-rank-0") == b"hello"
    assert not torchruns_store.check(["tiekit/nonce-of-a-dead-launch/from-rank-0"])


def test_a_rank_0_that_never_comes_is_a_tiekit_error_naming_the_stale_announcement(
    torchruns_store: dist.Store,
) -> None:
    stale = f"{_dead_port()} nonce-of-a-dead-launch"
    torchruns_store.set(LAUNCH_KEY, stale)
    with pytest.raises(TiekitError) as caught:
        collective_store_of_this_launch(1, timedelta(seconds=1))
    message = str(caught.value)
    assert "rank 1: rank 0 of this launch did not announce itself in torchrun's store" in message
    assert repr(stale) in message and "an earlier launch's" in message
