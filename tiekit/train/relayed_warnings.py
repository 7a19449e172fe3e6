"""Warnings of spawned replicas, shown by the process that called `fit`.

A replica fit spawns (``"ddp"``, ``"fsdp"``) is a process of its own: a warning it gives (a
resume in batches of another size, a checkpoint saved on other replicas...) went to its stderr
only, out of reach of the caller's filters, ``pytest.warns`` and ``-W error``, and out of sight in
a notebook. Each replica records its warnings instead (its own filters apply, so one per place
in the code, as Python shows them) and writes them out when it ends, failed or not; the caller
gives each once, with the category, message and place the replica gave.
"""

from __future__ import annotations

import builtins
import importlib
import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def recorded(path: Path) -> Iterator[None]:
    """Local: record the warnings given inside (by any thread) instead of showing them, and write
    them to ``path`` as JSON on the way out, whatever ends the block."""
    with warnings.catch_warnings(record=True) as caught:
        try:
            yield
        finally:
            shown = [
                {
                    "module": w.category.__module__,
                    "category": w.category.__qualname__,
                    "message": str(w.message),
                    "filename": w.filename,
                    "lineno": w.lineno,
                }
                for w in caught
            ]
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
            warnings.warn_explicit(w["message"], category, w["filename"], int(w["lineno"]))


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
