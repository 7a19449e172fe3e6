"""Packaging promises: no torch_xla on import, py.typed shipped, public API present."""

from __future__ import annotations

import importlib.resources
import subprocess
import sys

import tiekit

PUBLIC = [
    "find_ties",
    "TiePlan",
    "TieGroup",
    "retie",
    "verify",
    "move",
    "preserve_ties",
    "TPUMixin",
    "TieError",
    "CheckpointError",
    "TieWarning",
]


def test_import_and_core_use_do_not_import_torch_xla() -> None:
    code = (
        "import sys, torch, tiekit\n"
        "m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))\n"
        "m[1].weight = m[0].weight\n"
        "plan = tiekit.find_ties(m, check_values=True)\n"
        "tiekit.move(m, dtype=torch.float64)\n"
        "print('torch_xla' in sys.modules, len(plan))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "1"]


def test_py_typed_is_shipped() -> None:
    assert (importlib.resources.files("tiekit") / "py.typed").is_file()


def test_public_api_names() -> None:
    missing = [name for name in PUBLIC if not hasattr(tiekit, name)]
    assert missing == []
    assert issubclass(tiekit.TieError, tiekit.TiekitError)
    assert issubclass(tiekit.CheckpointError, tiekit.TiekitError)
