"""How the reports write sizes, tie tables and errors in one line."""

from __future__ import annotations

import math

import torch

from tiekit.plan import TieGroup, TiePlan


def group_table(groups: tuple[TieGroup, ...]) -> list[str]:
    # The plan's own table, without its summary line (the report has its own).
    return str(TiePlan(groups, 0, 0)).splitlines()[1:]


def tied_bytes(groups: tuple[TieGroup, ...]) -> int:
    """Bytes of every non-source member: what storing each tied name separately would add."""
    total = 0
    for group in groups:
        itemsize = getattr(torch, group.dtype).itemsize
        for member in group.members[1:]:
            total += math.prod(group.shape if member.view is None else member.view.size) * itemsize
    return total


def size_text(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover - the loop always returns


def shorten(value: str, limit: int = 60) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
