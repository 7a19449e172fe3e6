"""Background saves held back: the tests' way to have a save wait, with no timing involved."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def writer_held(kind: str = "file") -> Iterator[None]:
    """The background writer of single-file (``"file"``) or sharded (``"sharded"``) saves busy
    until the block ends: saves made inside stay queued."""
    from tiekit.checkpoint.saving import _background
    from tiekit.dcp.background import background_writer

    release = threading.Event()
    (_background() if kind == "file" else background_writer()).submit(release.wait, 60)
    try:
        yield
    finally:
        release.set()
