"""Warnings of spawned replicas, shown by the process that called `fit`.

A replica fit spawns (``"ddp"``, ``"fsdp"``; ``"xla"``: a process of launch threads) is a process
of its own: a warning it gives (a resume in batches of another size, a checkpoint saved on other
replicas...) went to its stderr only, out of reach of the caller's filters, ``pytest.warns`` and
``-W error``, and out of sight in a notebook. Each replica records its warnings instead (its own
filters apply, so one per place in the code, as Python shows them) and writes them out when it
ends, failed or not; the caller gives each once, with the category, message and place the
replica gave (your fit call's line when that place is tiekit's, Python's or a package's: the
launch's machinery, not your code).
"""

from __future__ import annotations

import builtins
import importlib
import json
import os
import sysconfig
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from tiekit.errors import user_stacklevel


@contextmanager
def recorded(path: Path) -> Iterator[None]:
    """Local: record the warnings given inside (by any thread) instead of showing them, and write
    them to ``path`` as JSON on the way out, whatever ends the block."""
    with warnings.catch_warnings(record=True) as caught:
        try:
            yield
        finally:
            _write(path, [_described(str(w.message), w.category, w.filename, w.lineno) for w in caught])


_threads_lock = threading.Lock()
_threads_in = 0
_threads_caught: list[dict[str, Any]] = []
_shown_before: Any = None


@contextmanager
def recorded_in_threads(path: Path) -> Iterator[None]:
    """Local: `recorded` for the ``torch_xla.launch`` threads of one process (XLA:CPU), each in
    its own block: ``warnings.catch_warnings`` swaps process-wide state, so the first thread in
    swaps ``warnings.showwarning`` for a recorder and the last one out puts it back; each thread
    writes what the process recorded so far (the caller gives each warning once)."""
    global _threads_in, _shown_before
    with _threads_lock:
        if _threads_in == 0:
            _shown_before, warnings.showwarning = warnings.showwarning, _record_in_threads
        _threads_in += 1
    try:
        yield
    finally:
        with _threads_lock:
            _threads_in -= 1
            if _threads_in == 0:
                warnings.showwarning = _shown_before
            shown = list(_threads_caught)
        _write(path, shown)


def _record_in_threads(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    with _threads_lock:
        _threads_caught.append(_described(str(message), category, filename, lineno))


def _described(message: str, category: type[Warning], filename: str, lineno: int) -> dict[str, Any]:
    return {
        "module": category.__module__,
        "category": category.__qualname__,
        "message": message,
        "filename": filename,
        "lineno": lineno,
    }


def _write(path: Path, shown: list[dict[str, Any]]) -> None:
    partial = path.with_name("." + path.name)
    partial.write_text(json.dumps(shown), encoding="utf-8")
    partial.replace(path)  # whole or not there: the caller may read it as the process is stopped


def relay(folder: Path) -> None:
    """Local: give here each warning the replicas recorded in ``folder`` (`recorded`), once: the
    replicas of a run mostly give the same ones. Unreadable files are passed over."""
    seen: set[tuple[str, str, str, int]] = set()
    for path in sorted(folder.glob("warnings-*.json")):
        try:
            found = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for w in found if isinstance(found, list) else []:
            key = (f"{w['module']}.{w['category']}", w["message"], w["filename"], int(w["lineno"]))
            if key in seen:
                continue
            seen.add(key)
            category = _category(w["module"], w["category"])
            if _library_code(w["filename"]):  # given in the launch's machinery: it is about your fit call
                warnings.warn(w["message"], category, stacklevel=user_stacklevel())
            else:
                warnings.warn_explicit(w["message"], category, w["filename"], int(w["lineno"]))


def _library_code(filename: str) -> bool:
    """Whether ``filename`` is tiekit's, or Python's or an installed package's (not your script)."""
    libraries = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    return any(os.path.abspath(filename).startswith(os.path.join(lib, "")) for lib in libraries) or filename.startswith(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    )


def _category(module: str, qualname: str) -> type[Warning]:
    """The warning class ``qualname`` of ``module``; `UserWarning` when it cannot be found here."""
    found: Any = builtins if module == "builtins" else None
    if found is None:
        try:
            found = importlib.import_module(module)
        except Exception:  # noqa: BLE001 - any failure to import: the class is unknown here
            return UserWarning
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) and issubclass(found, Warning) else UserWarning
