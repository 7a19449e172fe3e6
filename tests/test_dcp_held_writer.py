"""A background sharded save held back until the training thread lets it start (``hold=True``):
fit starts the writer as the next backward pass begins, where the training thread leaves the
GIL free. The writer must start at the copies' ``release()``, ``settle()``, the handle's
``wait()``/``join()``, or the end of the thread that made the save, and at nothing else; and a
held save still writes the values of its call."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from models import WeightSharingModule, filled
from torch import nn

import tiekit
from tiekit.checkpoint.deferred import DeferredCopies
from tiekit.checkpoint.handle import SaveHandle
from tiekit.dcp.saving import save_sharded_staged
from tiekit.train.loop import train_step

WAIT = 60  # seconds: a writer that does not start fails the test, never hangs it


def started_within(path: Path, seconds: float) -> bool:
    """Whether a save into ``path`` begins writing (a shard file appears) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not any(path.glob("save-*/*.distcp")):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def held_save(path: Path, value: float, hold: bool = True) -> tuple[nn.Module, SaveHandle, DeferredCopies]:
    """A background save of a tied model filled with ``value``, its writer held (``hold``). Its
    write ends by waiting for ``settle`` (the check that the copies hold the call's values)."""
    model = filled(value)
    handle, _, copies = save_sharded_staged(model, path, blocking=False, defer=True, hold=hold)
    assert copies is not None
    return model, handle, copies


def assert_saved(path: Path, value: float) -> None:
    loaded = WeightSharingModule()
    tiekit.load_sharded(loaded, path)
    assert all(torch.equal(p, torch.full_like(p, value)) for p in loaded.parameters())
    assert loaded.layer_3.weight is loaded.layer_1.weight


def test_a_save_not_held_writes_on_its_own(tmp_path: Path) -> None:
    """The control for the tests below: without ``hold`` the writer starts by itself."""
    _, handle, copies = held_save(tmp_path / "ck", 1.0, hold=False)
    assert started_within(tmp_path / "ck", WAIT)
    copies.settle()
    handle.wait(WAIT)
    assert_saved(tmp_path / "ck", 1.0)


def test_a_held_save_writes_nothing_until_released(tmp_path: Path) -> None:
    _, handle, copies = held_save(tmp_path / "ck", 1.0)
    assert not started_within(tmp_path / "ck", 0.5)
    assert not handle.done()
    copies.release()
    assert started_within(tmp_path / "ck", WAIT)
    copies.settle()
    handle.wait(WAIT)
    assert_saved(tmp_path / "ck", 1.0)


@pytest.mark.parametrize(
    "releaser",
    [
        lambda handle, copies: copies.settle(),
        lambda handle, copies: handle.wait(WAIT),
        lambda handle, copies: handle.join(),
    ],
    ids=["settle", "wait", "join"],
)
def test_whatever_waits_for_a_held_save_lets_it_start(
    tmp_path: Path, releaser: Callable[[SaveHandle, DeferredCopies], None]
) -> None:
    """``settle`` waits for the copies, ``wait``/``join`` for the write: each would wait forever
    for a writer still held, so each lets it start first (in a thread: a hang fails the test)."""
    _, handle, copies = held_save(tmp_path / "ck", 1.0)
    assert not started_within(tmp_path / "ck", 0.2)
    waiter = threading.Thread(target=releaser, args=(handle, copies), daemon=True)
    waiter.start()
    assert started_within(tmp_path / "ck", WAIT)
    copies.settle()  # this thread made the save: the write's end waits for its check
    waiter.join(WAIT)
    assert not waiter.is_alive()
    handle.wait(WAIT)
    assert_saved(tmp_path / "ck", 1.0)


def test_a_held_save_starts_when_the_thread_that_made_it_ends(tmp_path: Path) -> None:
    """A training thread that ends between the save and the next backward pass leaves no writer
    waiting for it forever (the interpreter waits for the writer at exit): the writer starts, and
    the save fails as any deferred save whose copies were never checked."""
    made: dict[str, SaveHandle] = {}

    def save() -> None:
        made["handle"] = held_save(tmp_path / "ck", 1.0)[1]

    thread = threading.Thread(target=save)
    thread.start()
    thread.join(WAIT)
    handle = made["handle"]
    assert started_within(tmp_path / "ck", WAIT)
    with pytest.raises(tiekit.CheckpointError, match="ended before its copy could be checked"):
        handle.wait(WAIT)


def test_a_held_save_writes_the_values_of_its_call(tmp_path: Path) -> None:
    """The copies are made once released, after the weights changed in place: the save still
    holds the values of the call (the deferred copy's check: it must not be written before
    ``settle``), here by changing them only after ``settle``."""
    model, handle, copies = held_save(tmp_path / "ck", 1.0)
    copies.release()
    copies.settle()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(2.0)
    handle.wait(WAIT)
    assert_saved(tmp_path / "ck", 1.0)


def test_train_step_calls_before_backward_before_the_backward_pass() -> None:
    """fit releases a held save from ``before_backward``: it must run after the forward pass and
    before the backward pass (and ``before_update`` after it)."""
    from tiekit.backends.torch_distributed import TorchBackend
    from tiekit.train.precision import resolve_precision

    order: list[str] = []
    model = torch.nn.Linear(3, 1)
    model.weight.register_hook(lambda grad: order.append("backward"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        order.append("forward")
        return ((out - target) ** 2).mean()

    backend = TorchBackend(torch.device("cpu"))
    batch = (torch.ones(2, 3), torch.zeros(2, 1))
    train_step(
        model,
        optimizer,
        batch,
        backend,
        resolve_precision("32-true", "cpu"),
        loss_fn,
        lambda: order.append("update"),
        lambda: order.append("before_backward"),
    )
    assert order == ["forward", "before_backward", "backward", "update"]
