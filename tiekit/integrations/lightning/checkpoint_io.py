"""`TiedCheckpointIO`: what Lightning's ``ModelCheckpoint`` saves, as one tied safetensors file
(see the package's docstring)."""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from fsspec.utils import get_protocol
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from torch import nn

from tiekit.checkpoint.codec import Fallback, Reader
from tiekit.checkpoint.loading import read_training_checkpoint, usable_device
from tiekit.checkpoint.saving import write_training_checkpoint
from tiekit.devices import storage_key
from tiekit.errors import CheckpointError, TiekitError
from tiekit.moving import move

#: The checkpoint entry holding the state dict's values that are no tensors (extra state).
_VALUES_KEY = "tiekit_state_dict_values"


class TiedCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that writes tied safetensors instead of pickles.

    ``Trainer(plugins=[TiedCheckpointIO()])``. The ``state_dict`` entry is stored one tensor
    per tie group, with the tie plan (tensors of the state dict that share memory are ties);
    optimizer states, loops, callbacks and hyperparameters are stored as tensors plus JSON.
    Values JSON cannot hold (arbitrary objects in hyperparameters) raise `tiekit.CheckpointError`
    unless ``allow_pickle=True``, which pickles just those values (and unpickles them on load:
    only for files you trust). ``durable=False`` skips the fsyncs, as in `tiekit.save_model`
    (still atomic against a killed process). The file is a safetensors file whatever its name
    (``epoch=0-step=10.ckpt``): ``tiekit.load_model(module, path)`` reads the weights, and
    ``trainer.fit(ckpt_path=...)`` resumes from it. Not for the XLA strategies, which accept only
    their own ``XLACheckpointIO``, nor for ``ModelParallelStrategy`` and ``FSDPStrategy``, which
    bypass it (`KeepTies` refuses the pair), nor inside Lightning's ``AsyncCheckpointIO``, which
    clones each tensor on its own so that the file would store tied names untied (`KeepTies`
    refuses that too, when the run starts). It writes each checkpoint before training goes on.
    Extra state in the state dict (``get_extra_state``) is stored as a tensor, or as the other
    values are. Paths must be local: a URL (``s3://``, ``memory://``) is a `tiekit.TiekitError`.
    """

    def __init__(self, *, allow_pickle: bool = False, durable: bool = True) -> None:
        # A string from a config file ("false") is truthy: it would turn unpickling on.
        self.allow_pickle = _flag(allow_pickle, "allow_pickle")
        self.durable = _flag(durable, "durable")

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically (a crash leaves the previous file)."""
        target = local_path(path)
        if storage_options is not None:
            raise TiekitError(
                "TiedCheckpointIO does not support storage_options; got "
                f"{storage_options!r}. Use a CheckpointIO that understands them."
            )
        state = checkpoint.get("state_dict", {})
        if not isinstance(state, Mapping) or not all(isinstance(name, str) for name in state):
            raise CheckpointError(f"{target}: the checkpoint's 'state_dict' must map names (strings) to values")
        if _VALUES_KEY in checkpoint:
            raise CheckpointError(f"{target}: the checkpoint has an entry {_VALUES_KEY!r}, which TiedCheckpointIO uses")
        tensors = {name: v for name, v in state.items() if isinstance(v, torch.Tensor)}
        # Extra state (get_extra_state) that is no tensor: stored as the other entries are (JSON, or
        # pickled with allow_pickle), under a key of its own, and put back into the state dict on load.
        values = {name: v for name, v in state.items() if not isinstance(v, torch.Tensor)}
        rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        if values:
            rest[_VALUES_KEY] = values
        write_training_checkpoint(
            target,
            model=_holder(tensors),
            optimizer=None,
            step=None,
            extra=rest,
            durable=self.durable,
            fallback=_storer(self.allow_pickle),
        )

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read a file written by `save_checkpoint` back into Lightning's checkpoint dict.

        Tied names come back as the same tensor (views as views), on ``map_location`` too, which
        may be a device or a device string; tensors are on the CPU otherwise.
        """
        from tiekit.inspection import inspect_file

        target = local_path(path)
        report = inspect_file(target)
        holder = _holder(_meta_state(report))
        readers = {"__pickle__": _unpickler(self.allow_pickle, str(target))}
        loaded = read_training_checkpoint(target, model=holder, dtype="file", readers=readers)
        rest = loaded["extra"]
        if not isinstance(rest, dict):
            raise CheckpointError(f"{target}: not written by TiedCheckpointIO (no checkpoint entries)")
        if map_location is not None:
            device = _device(map_location, target)
            # The holder moves as a model does (tiekit.move): a tensor copied on its own would
            # leave the views it has behind, as separate copies on the device.
            move(holder, device)
            rest = cast(dict[str, Any], _map_tensors(rest, device))
        values = rest.pop(_VALUES_KEY, {})
        if not isinstance(values, dict):
            raise CheckpointError(f"{target}: corrupted checkpoint metadata ({_VALUES_KEY!r} is not a dict)")
        return {"state_dict": {**_tensors_by_name(holder), **values}, **rest}

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint file."""
        target = local_path(path)
        if target.is_file():
            target.unlink()


def _device(map_location: Any, target: Path) -> torch.device:
    # Checked after the read, as before: a file that is no checkpoint is the first thing to name.
    if isinstance(map_location, str | torch.device):
        try:
            device = torch.device(map_location)
        except RuntimeError as exc:
            raise TiekitError(f"TiedCheckpointIO: map_location {map_location!r} is not a device ({exc})") from None
        # One this machine has ("cuda" without a GPU failed inside the move, named as a conversion).
        usable_device(map_location, f"{target}: map_location")
        return device
    raise TiekitError(f"TiedCheckpointIO: map_location must be a device or a string, not {map_location!r}")


def local_path(path: Any) -> Path:
    """The local path ``path`` names; a URL (``s3://``, ``memory://``, ``file://``, ``a::b``) is a
    `TiekitError`: as a `Path` it would name a folder ``s3:`` in the working directory, while
    Lightning records the URL."""
    text = os.fspath(path)
    if isinstance(text, str) and ("://" in text or get_protocol(text) != "file"):
        raise TiekitError(
            f"TiedCheckpointIO writes local files only; got the URL {text!r}. Give ModelCheckpoint (dirpath=) "
            "and ckpt_path a local or mounted path, or use a CheckpointIO that writes through fsspec for URLs."
        )
    return Path(text)


def _holder(tensors: Mapping[str, torch.Tensor]) -> nn.Module:
    """A module holding ``tensors`` as buffers under their dotted names, so the tie machinery
    (which works on modules) can plan, save and load a plain state dict.

    A state dict holds a tied parameter once per name, as separate detached tensors over one
    memory: tensors with the same storage, offset, shape, strides and dtype become one object
    here, so the plan records an identity tie (loaded as the same object), not a view covering
    the whole source. A real view (a slice, a transpose) keeps its own tensor and stays a view.
    """
    root = nn.Module()
    same: dict[tuple[Any, ...], torch.Tensor] = {}
    for name, tensor in tensors.items():
        storage = storage_key(tensor)
        if storage is not None:
            key = (storage, tensor.device, tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype)
            tensor = same.setdefault(key, tensor)
        *path, attr = name.split(".")
        module = root
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = module._modules[part] = nn.Module()
            module = child
        module._buffers[attr] = tensor
    return root


def _tensors_by_name(holder: nn.Module) -> dict[str, torch.Tensor]:
    """Every name `_holder` holds, tied names as the one tensor object they share (``state_dict``
    would detach each name into its own object) and views as the views they are."""
    return dict(holder.named_buffers(remove_duplicate=False))


def _flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TiekitError(f"TiedCheckpointIO: {name} must be True or False, not {value!r}")
    return value


def _meta_state(report: Any) -> dict[str, torch.Tensor]:
    """Meta tensors for every name a file covers (stored ones and tied ones), with their shapes."""
    meta: dict[str, torch.Tensor] = {}
    for t in report.tensors:
        meta[t.name] = torch.empty(t.shape, dtype=getattr(torch, t.dtype), device="meta")
    if report.plan is not None:
        for group in report.plan.groups:
            for member in group.members[1:]:
                shape = group.shape if member.view is None else member.view.size
                meta[member.name] = torch.empty(shape, dtype=getattr(torch, group.dtype), device="meta")
    return meta


def _storer(allow_pickle: bool) -> Fallback:
    """The codec's fallback for values it has no JSON form for: pickled into a byte tensor with
    ``allow_pickle``, else a `CheckpointError` naming the entry."""

    def store(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        # The codec's key for the state dict's extra state names the plugin's storage, not the user's entry.
        shown = key.replace(f"extra/value/{_VALUES_KEY}/", "state_dict/", 1)
        if not allow_pickle:
            raise CheckpointError(
                f"cannot store {shown!r}: a {type(value).__name__}, which has no JSON form; store plain values, or "
                "use TiedCheckpointIO(allow_pickle=True) to pickle such values"
            )
        try:
            data = pickle.dumps(value)
        except Exception as exc:  # a local class, a lock, an open file: pickle's error named no entry
            raise CheckpointError(
                f"cannot store {shown!r}: pickling its {type(value).__name__} failed ({exc})"
            ) from exc
        tensors[key] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return {"__pickle__": key}

    return store


def _unpickler(allow_pickle: bool, where: str) -> Reader:
    """Reads `_storer`'s pickles back, only with ``allow_pickle`` (files the user trusts)."""

    def read(body: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
        if not allow_pickle:
            raise CheckpointError(
                f"{where}: holds a pickled value; load it with TiedCheckpointIO(allow_pickle=True) only if you trust "
                "the file"
            )
        # Earlier files stored the bytes as a tensor value: {"__pickle__": {"__tensor__": key}}.
        key = body.get("__tensor__") if isinstance(body, dict) else body
        if not isinstance(key, str) or key not in tensors:
            raise CheckpointError(f"{where}: a pickled value names key {key!r}, which the file lacks")
        return pickle.loads(tensors[key].numpy().tobytes())  # only with allow_pickle, for trusted files

    return read


def _map_tensors(value: Any, device: torch.device, moved: dict[int, torch.Tensor] | None = None) -> Any:
    # One copy per tensor object, so names that share a tensor still share it on the device.
    moved = {} if moved is None else moved
    if isinstance(value, torch.Tensor):
        if id(value) not in moved:
            moved[id(value)] = value.to(device)
        return moved[id(value)]
    if isinstance(value, dict):
        return {k: _map_tensors(v, device, moved) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_map_tensors(v, device, moved) for v in value)
    return value
