"""Lightning: keep ties through the Trainer's cast, move and teardown; save checkpoints as tied safetensors.

``KeepTies`` is a callback. Lightning's strategies cast the module (``precision="bf16-true"``),
move it (``model_to_device``) and build the optimizers, all inside ``strategy.setup``, and
move it back to the CPU in ``strategy.teardown``; no callback hook runs between the move and
the optimizers. So the callback wraps the strategy's ``setup`` (to plan before the cast) and
``model_to_device`` (to re-tie and verify right after the move, before any optimizer holds a
parameter), re-ties again after teardown, and verifies at the start of every stage. It also
plans before ``configure_model``, where ``ModelParallelStrategy`` users shard the module with
FSDP2, and refuses the ties that hook undid (units splitting a tie: `tiekit.check_sharding`). Lightning's
own XLA strategies re-tie parameters with ``set_shared_parameters``; they keep neither buffers
nor views, do not check counts, and do nothing after teardown's ``.cpu()``, which breaks
parameter ties again.

``TiedCheckpointIO`` writes what ``ModelCheckpoint`` saves as one safetensors file: the
module's weights once per tie group (with the tie plan), the optimizer state and every other
entry as tensors plus JSON. Nothing is pickled unless ``allow_pickle=True``.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback
from torch import nn

from tiekit.analyze import find_ties
from tiekit.checkpoint.codec import Fallback, Reader
from tiekit.checkpoint.loading import read_training_checkpoint
from tiekit.checkpoint.saving import write_training_checkpoint
from tiekit.devices import storage_key
from tiekit.errors import CheckpointError, TieError, TiekitError, TieWarning
from tiekit.plan import TieGroup, TiePlan
from tiekit.retie import OnError, retie, verify
from tiekit.sharding.check import check_sharding
from tiekit.sharding.wrap import fsdp2
from tiekit.slots import has_module, resolve

__all__ = ["KeepTies", "TiedCheckpointIO"]


class KeepTies(Callback):
    """Keep the LightningModule's tied weights tied through the Trainer's cast, device move and teardown.

    ``declared`` adds ties the module declares as ``{target: source}`` but does not hold in
    memory. ``on_error="warn"`` turns a failed check into a `tiekit.TieWarning`. ``plan`` is
    the plan made at the last setup.

    ``plan=tiekit.find_ties(module)``, made before ``trainer.fit``, is used instead of planning
    at setup. ``strategy="ddp_spawn"`` on the CPU needs it when buffers are views of weights:
    Lightning copies every parameter and buffer in the spawned workers before any callback
    runs, so a view buffer arrives as a separate copy that only the earlier plan knows was a
    view (parameter ties survive that copy; the plan is not needed for them).
    """

    def __init__(
        self,
        *,
        declared: Mapping[str, str] | None = None,
        on_error: OnError = "raise",
        plan: TiePlan | None = None,
    ) -> None:
        super().__init__()
        if plan is not None and declared:
            raise TypeError("KeepTies: pass declared ties to find_ties when making the plan, not with plan=")
        self.declared = dict(declared) if declared else None
        self.on_error: OnError = on_error
        self.plan: TiePlan | None = plan
        self._given = plan
        self._wrapped: tuple[Any, dict[str, Callable[..., Any]]] | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Wrap this run's strategy: plan when its setup starts, re-tie right after its move.

        The ties the module holds now, before ``configure_model``, must survive that hook:
        where it shards the module with FSDP2 (``ModelParallelStrategy``), units that split a
        tie raise `tiekit.TieError` naming them (`tiekit.check_sharding`), before the first step."""
        self._unwrap()
        strategy = trainer.strategy
        _refuse_tied_io_where_unused(strategy)
        _refuse_tied_io_in_async(strategy)
        originals = {"setup": strategy.setup, "model_to_device": strategy.model_to_device}
        before = self._given if self._given is not None else find_ties(pl_module, declared=self.declared)

        def setup(trainer_: Any) -> None:
            # After configure_model, before the precision plugin casts and the strategy moves.
            self.plan = self._given if self._given is not None else find_ties(pl_module, declared=self.declared)
            self._check_configured(pl_module, before)
            originals["setup"](trainer_)

        def model_to_device() -> None:
            originals["model_to_device"]()
            self._retie(pl_module)

        strategy.setup = setup
        strategy.model_to_device = model_to_device
        self._wrapped = (strategy, originals)

    def _retie(self, pl_module: nn.Module) -> None:
        if self.plan is not None:
            retie(pl_module, self.plan)
            verify(pl_module, self.plan, on_error=self.on_error)

    def _check_configured(self, pl_module: nn.Module, before: TiePlan) -> None:
        """Refuse ties that were one tensor before ``configure_model`` and are not after it."""
        kept = _still_named(pl_module, before)  # configure_model may replace modules: those are new
        if not kept.groups:
            return
        if _has_fsdp2_units(pl_module):
            check_sharding(pl_module, kept)  # TieError naming the units that split a tie
        if self._given is not None:
            return  # the given plan re-ties after the move
        assert self.plan is not None
        lost = [f"{name} is no longer {g.source}" for g in kept.groups for name in _untied(self.plan, g)]
        if lost:
            message = (
                "tiekit: configure_model (or the module's setup hook) undid ties the module held when the "
                f"run's setup began: {'; '.join(lost)}. Tie them again there, or pass "
                "KeepTies(plan=tiekit.find_ties(module)) made before fit to re-tie them after the move."
            )
            if self.on_error == "raise":
                raise TieError(message)
            warnings.warn(message, TieWarning, stacklevel=2)

    def _check(self, pl_module: nn.Module) -> None:
        if self.plan is not None:
            verify(pl_module, self.plan, on_error=self.on_error)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Check the ties before training starts."""
        self._check(pl_module)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        """Check the ties before validation."""
        self._check(pl_module)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        """Check the ties before testing."""
        self._check(pl_module)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        """Check the ties before predicting."""
        self._check(pl_module)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Re-tie after the strategy's teardown moved the module back to the CPU; unwrap the strategy."""
        self._unwrap()
        self._retie(pl_module)

    def _unwrap(self) -> None:
        if self._wrapped is None:
            return
        strategy, originals = self._wrapped
        for name in originals:
            # The wrappers are instance attributes over the class's methods: removing them restores those.
            strategy.__dict__.pop(name, None)
        self._wrapped = None


def _checkpoint_io_chain(strategy: Any) -> list[Any]:
    """The strategy's ``CheckpointIO`` and every plugin it wraps, outermost first: Lightning's
    wrapping plugins (``AsyncCheckpointIO``) hold the plugin they wrap as ``checkpoint_io``."""
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

    chain = [strategy.checkpoint_io]
    while isinstance(chain[-1], _WrappingCheckpointIO) and chain[-1].checkpoint_io is not None:
        if any(chain[-1].checkpoint_io is seen for seen in chain):
            break  # a plugin wrapping itself: nothing more to find
        chain.append(chain[-1].checkpoint_io)
    return chain


def _uses_tied_io(strategy: Any) -> bool:
    """Whether the strategy's checkpoints go through a `TiedCheckpointIO`, bare or wrapped."""
    return any(isinstance(io, TiedCheckpointIO) for io in _checkpoint_io_chain(strategy))


def _refuse_tied_io_where_unused(strategy: Any) -> None:
    """`TiekitError` for `TiedCheckpointIO` (bare or wrapped) under a strategy that bypasses it:
    Lightning's ``ModelParallelStrategy`` and ``FSDPStrategy`` save a distributed checkpoint
    without it, or give it a gathered state dict whose tied names are separate copies (the file
    stores both), and they load every checkpoint with ``torch.load``, never through it (a resume fails)."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, ModelParallelStrategy | FSDPStrategy) and _uses_tied_io(strategy):
        raise TiekitError(
            f"TiedCheckpointIO does not work under {type(strategy).__name__}: it writes distributed checkpoints "
            "without the plugin, or hands it a gathered state dict whose tied names are separate copies, and it "
            "reads checkpoints with torch.load, never through the plugin, so a resume would fail. Drop the plugin "
            "and keep the strategy's own checkpoints (KeepTies re-ties after their load), or save with "
            "tiekit.save_sharded"
        )


def _refuse_tied_io_in_async(strategy: Any) -> None:
    """`TiekitError` for `TiedCheckpointIO` inside Lightning's ``AsyncCheckpointIO``.

    ``AsyncCheckpointIO`` clones every tensor of the checkpoint on its own before handing it to
    the plugin, so the tied names arrive as unrelated tensors and the file would store each of
    them, with no tie (which `tiekit.load_model` takes only where it can compare the copies and
    finds them equal). Refused rather
    than re-tied by name: that would take a plan the plugin does not have and trust that clones
    equal in value are one weight, and ``AsyncCheckpointIO`` reports a failed write only at the
    next save or at the end of the run, after ``ModelCheckpoint`` counted the file as saved and
    may have deleted the one before it."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    chain = _checkpoint_io_chain(strategy)
    if any(isinstance(io, TiedCheckpointIO) for io in chain) and any(isinstance(io, AsyncCheckpointIO) for io in chain):
        raise TiekitError(
            "TiedCheckpointIO inside Lightning's AsyncCheckpointIO would lose the ties in every checkpoint: "
            "AsyncCheckpointIO clones each tensor of the checkpoint separately, so tied names reach the plugin as "
            "separate tensors and the file stores each of them, untied (tiekit.load_model takes such a file only "
            "where it can compare the copies and finds them equal). Pass the plugin itself, "
            "plugins=[TiedCheckpointIO()]: it writes each checkpoint atomically before training goes on. To write "
            "checkpoints in the background while training goes on, "
            "train with tiekit.fit (checkpoint_async=True) or save with tiekit.save_checkpoint(..., blocking=False)"
        )


def _still_named(model: nn.Module, plan: TiePlan) -> TiePlan:
    """``plan`` without the groups (and traced reads) naming a slot ``model`` no longer has."""

    def present(names: Iterable[str]) -> bool:
        try:
            for name in names:
                resolve(model, name, "tied name")
        except TieError:
            return False
        return True

    groups = tuple(g for g in plan.groups if present(g.names))
    reads = tuple(u for u in plan.cross_module if present([u.name]) and has_module(model, u.reader))
    return dataclasses.replace(plan, groups=groups, cross_module=reads)


def _untied(plan: TiePlan, group: TieGroup) -> list[str]:
    """The members of ``group`` that ``plan`` does not put in one group with its source."""
    home = plan.group_of(group.source)
    return [n for n in group.names[1:] if home is None or plan.group_of(n) is not home]


def _has_fsdp2_units(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied inside ``model`` (False where torch has no FSDP2)."""
    try:
        FSDPModule = fsdp2()[0]
    except TiekitError:
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


# -- checkpoints ----------------------------------------------------------------------------


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
    """

    def __init__(self, *, allow_pickle: bool = False, durable: bool = True) -> None:
        self.allow_pickle = allow_pickle
        self.durable = durable

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically (a crash leaves the previous file)."""
        if storage_options is not None:
            raise TypeError(
                "TiedCheckpointIO does not support storage_options; got "
                f"{storage_options!r}. Use a CheckpointIO that understands them."
            )
        state = checkpoint.get("state_dict", {})
        if not isinstance(state, Mapping) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise CheckpointError(f"{path}: the checkpoint's 'state_dict' must map names to tensors")
        rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        write_training_checkpoint(
            _target(path),
            model=_holder(state),
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

        Tied names come back as the same tensor (views as views). ``map_location`` may be a
        device or a device string; tensors are on the CPU otherwise.
        """
        from tiekit.inspection import inspect_file

        target = _target(path)
        report = inspect_file(target)
        holder = _holder(_meta_state(report))
        readers = {"__pickle__": _unpickler(self.allow_pickle, str(target))}
        loaded = read_training_checkpoint(target, model=holder, dtype="file", readers=readers)
        state: dict[str, Any] = dict(holder.state_dict())
        rest = loaded["extra"]
        if not isinstance(rest, dict):
            raise CheckpointError(f"{target}: not written by TiedCheckpointIO (no checkpoint entries)")
        checkpoint = {"state_dict": state, **rest}
        if map_location is not None:
            if not isinstance(map_location, str | torch.device):
                raise TypeError(f"TiedCheckpointIO: map_location must be a device or a string, not {map_location!r}")
            checkpoint = cast(dict[str, Any], _map_tensors(checkpoint, torch.device(map_location)))
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint file."""
        target = _target(path)
        if target.is_file():
            target.unlink()


def _target(path: Any) -> Path:
    return Path(os.fspath(path))


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
        if not allow_pickle:
            raise CheckpointError(
                f"cannot store {key!r}: a {type(value).__name__}, which has no JSON form; store plain values, or "
                "use TiedCheckpointIO(allow_pickle=True) to pickle such values"
            )
        tensors[key] = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
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
