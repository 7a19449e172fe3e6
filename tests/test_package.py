"""Packaging promises: no torch_xla on import, py.typed shipped, public API present."""

from __future__ import annotations

import importlib.resources
import subprocess
import sys
from pathlib import Path

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


def test_sharded_checkpoints_do_not_import_torch_xla(tmp_path: Path) -> None:
    # save_sharded / load_sharded / convert ask tiekit.backends.xla_spmd whether the tensors are
    # XLA SPMD ones; that question must not import torch_xla in a process that never did.
    code = (
        "import sys, torch, tiekit\n"
        "m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))\n"
        "m[1].weight = m[0].weight\n"
        f"path = {str(tmp_path / 'ckpt')!r}\n"
        "tiekit.save_sharded(m, path)\n"
        "tiekit.save_sharded(m, path, blocking=False).wait(60)\n"
        "tiekit.load_sharded(m, path)\n"
        f"tiekit.convert(path, {str(tmp_path / 'model.safetensors')!r})\n"
        "print('torch_xla' in sys.modules, m[1].weight is m[0].weight)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.split() == ["False", "True"]


def test_py_typed_is_shipped() -> None:
    assert (importlib.resources.files("tiekit") / "py.typed").is_file()


def test_public_api_names() -> None:
    missing = [name for name in PUBLIC if not hasattr(tiekit, name)]
    assert missing == []
    assert issubclass(tiekit.TieError, tiekit.TiekitError)
    assert issubclass(tiekit.CheckpointError, tiekit.TiekitError)
