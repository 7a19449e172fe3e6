"""Host copies a background save makes while training goes on (`tiekit.fit`'s checkpoints).

A training checkpoint's parameters and optimizer state change only in the optimizer step, so
the copy of them that a background save needs can be made beside the next step's forward and
backward passes instead of inside the training loop: the loop then stalls only for the tensors
that may change earlier (buffers, which a forward pass updates). The copy must be done before
the next optimizer step (`DeferredCopies.settle`, called by the training thread) and the file is
published only once it is (`DeferredCopies.confirmed`, called by the writer).

A single-file save can go further and need no copy at all: `settle` moves the parameters and
optimizer state into the save's file image (``adopt``), so training goes on in that memory and
the next save into the same image writes them from where they are. That save's `settle` then
takes the image back from the writer before the optimizer step changes it
(`tiekit.checkpoint.image.LentMemory`: it waits for the chunk being written, and copies aside
only what is not yet written). A sharded save does the same with the optimizer state in its
shard file's image (`tiekit.dcp.staging`); FSDP2's parameters stay where FSDP2 keeps them.

Every in-place write bumps a tensor's version counter. The counters are read when the save is
made and again in `settle`: a tensor written in between (a forward pass that changes a parameter
in place) makes that save fail with a `CheckpointError` naming it, never write a torn checkpoint.
A write through ``.data`` bypasses the counter and is not seen. For FSDP2's DTensors the
counter that moves is the DTensor's (its local tensor's stays), so that is the one watched
while the local tensors are copied.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from tiekit.checkpoint.image import LentMemory
from tiekit.errors import CheckpointError

#: How often the writer looks whether the training thread it waits for still exists.
_OWNER_POLL_SECONDS = 0.5


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s values in this process: a DTensor's local shard, else ``t``."""
    if type(t).__name__ != "DTensor":
        return t
    with torch.no_grad():  # the shard itself, not a view recorded for autograd
        return t.to_local()  # type: ignore[attr-defined,no-any-return]


def deferrable_storages(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[int, list[torch.Tensor]]:
    """The host storages (data pointers; DTensors: of their local shards) that only an optimizer
    step changes: the parameters and the optimizer's per-parameter state. Buffers are not among
    them: a forward pass updates running statistics. Each maps to the parameters and state
    tensors on it (not a DTensor, whose shard is not the tensor itself)."""
    tensors: list[torch.Tensor] = list(model.parameters())
    if optimizer is not None:
        states = optimizer.state.values()
        tensors += [v for per_param in states for v in per_param.values() if isinstance(v, torch.Tensor)]
    found: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        part = local_part(t)
        if part.device.type != "cpu":
            continue
        on_storage = found.setdefault(part.untyped_storage().data_ptr(), [])
        if part is t:  # a DTensor's shard is not the tensor the optimizer holds
            on_storage.append(t)
    return found


def into_image(original: torch.Tensor, view: torch.Tensor) -> Callable[[], None]:
    """The move of ``original`` (a parameter or state tensor) into ``view`` (its copy in a save's
    image, equal to it when the move is made): ``original.data = view``."""

    def move() -> None:
        original.data = view

    return move


class DeferredCopies:
    """Copies made by the writing thread (`copy`), checked by the training thread (`settle`)
    before it changes any source. Each entry is ``(name, watched, source, destination)``:
    ``source`` is copied into ``destination``, and ``watched`` (``source`` itself, or the
    DTensor whose local shard it is) must not be written in the meantime; None for a source
    nothing else holds (a host copy made for this save), which needs no settling. A source that is
    its destination (training state living in the save's image) is not copied: ``lent`` is then
    that image, taken back from the writer by `settle`. ``adopt``: moves (`into_image`,
    `tiekit.dcp.staging`), each putting a state tensor into its view of the image, made by
    `settle` once the copy is made and checked, so that the next save into that image copies
    nothing."""

    def __init__(
        self,
        entries: Sequence[tuple[str, torch.Tensor | None, torch.Tensor, torch.Tensor]],
        *,
        lent: LentMemory | None = None,
        adopt: Sequence[Callable[[], None]] = (),
    ) -> None:
        # A source that is its destination (state living in the image) needs no copy.
        self._pairs = [(n, s, d) for n, _, s, d in entries if s.data_ptr() != d.data_ptr() or not s.numel()]
        self.lent = lent
        self._adopt = list(adopt)
        self._watched = [(name, watched, watched._version) for name, watched, _, _ in entries if watched is not None]
        self._owner = threading.current_thread()
        self._copied = threading.Event()
        if not self._pairs:
            self._copied.set()
        self._settled = threading.Event()
        if not self._watched and lent is None and not self._adopt:
            self._settled.set()
        self._problem: str | None = None

    def copy(self) -> None:
        """Writing thread: copy every source into its destination (torch's copy releases the GIL)."""
        try:
            with torch.no_grad():
                for _, source, destination in self._pairs:
                    destination.copy_(source)
            self._pairs = []  # a source made for this save is freed once copied
        except BaseException as exc:
            self._problem = f"the copy of the state to host memory failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            self._copied.set()

    def settle(self, *, then_wait: bool = False) -> None:
        """Training thread, before anything may change the sources (the next optimizer step):
        wait until they are copied, and check that none was written since the save was made.
        Returns at once when already settled. ``then_wait``: the caller waits for the write next
        and changes nothing meanwhile, so a lent image stays with the writer (nothing copied aside)."""
        if self._settled.is_set():
            return
        self._copied.wait()
        changed = [name for name, watched, version in self._watched if watched._version != version]
        if changed and self._problem is None:
            more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
            self._problem = (
                f"{changed[0]!r}{more} was written in place after the save was made and before the next "
                "optimizer step (by the forward or backward pass?), so its copy may mix old and new values; "
                "the save is not committed (what it wrote is removed). Save with the copy made in the step "
                "(fit: checkpoint_async=False)"
            )
        if self.lent is not None and not then_wait:
            self.lent.take_back()  # the step may change the image now: the writer has the rest aside
        if self._problem is None:
            with torch.no_grad():
                for move in self._adopt:  # equal values: the copy is made and nothing wrote them
                    move()
        self._adopt = []
        self._settled.set()

    def confirmed(self, where: Path) -> None:
        """Writing thread, before publishing the file: wait for `settle`; a `CheckpointError` if the
        copy does not hold the values of the save, or if the training thread ended without settling."""
        while not self._settled.wait(_OWNER_POLL_SECONDS):
            if not self._owner.is_alive():
                raise CheckpointError(
                    f"{where}: the thread that made this save ended before its copy could be checked; "
                    "nothing was written"
                )
        if self._problem is not None:
            raise CheckpointError(f"{where}: {self._problem}")
