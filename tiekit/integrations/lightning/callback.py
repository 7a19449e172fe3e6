"""`KeepTies`: the Lightning callback that keeps a LightningModule's ties through the Trainer's
cast, move, ``configure_model`` and teardown (see the package's docstring)."""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from lightning.pytorch.callbacks import Callback
from torch import nn

from tiekit.collective import collective_gather, ranks
from tiekit.declared_groups import checked_declared
from tiekit.errors import TieError, TiekitError, TieWarning
from tiekit.integrations.lightning.checkpoint_io import TiedCheckpointIO, local_path
from tiekit.moving import moving_plan, refuse_plan_without_mixin_ties
from tiekit.plan import TieGroup, TiePlan
from tiekit.retie import OnError, checked_on_error, lasting_tie_changes, member_holds, retie, verify
from tiekit.sharding.check import check_sharding
from tiekit.sharding.wrap import fsdp2
from tiekit.slots import has_module, resolve


class KeepTies(Callback):
    """Keep the LightningModule's tied weights tied through the Trainer's cast, device move and teardown.

    The plan is made as `tiekit.move` makes it (`tiekit.moving.moving_plan`): the ties the module
    holds, every ``TPUMixin.tied_weights`` in it, and those it or a submodule declares
    (transformers' ``_tied_weights_keys``) whose tensors are equal in value, which are tied again.
    ``declared`` adds ties the module declares as ``{target: source}`` but does not hold in memory.
    ``on_error="warn"`` turns a failed check into a `tiekit.TieWarning`.
    ``plan`` is the plan made at the last setup.

    The plan is kept for the module between stages: at the start of each later stage
    (``trainer.test(module)`` after ``fit``), a tie it holds that the same module no longer holds
    (its names given separate tensors, or gone) is a `tiekit.TieError` naming them, raised before
    the stage plans again. Not an error: another module object (planned afresh), ties added, and
    a tie whose member's submodule was replaced by another module object (that part was rebuilt).
    With several ranks that check is collective (``setup``, which Lightning calls on every rank,
    gathers each rank's finding): ranks that found different broken ties raise a `tiekit.TieError`
    on every rank naming each rank's, whatever ``on_error`` says.

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
        checked_declared(declared, "KeepTies")
        if plan is not None and declared:
            raise TiekitError("KeepTies: pass declared ties to find_ties when making the plan, not with plan=")
        if plan is not None and not isinstance(plan, TiePlan):
            raise TiekitError(
                f"KeepTies: plan must be a tiekit.TiePlan (tiekit.find_ties), not a {type(plan).__name__}"
            )
        self.declared = dict(declared) if declared else None
        self.on_error: OnError = checked_on_error(on_error, "KeepTies")
        self.plan: TiePlan | None = plan
        self._given = plan
        self._wrapped: tuple[Any, dict[str, Callable[..., Any]]] | None = None
        # The module the plan was made for, and each tied name's owning submodule then (weakly:
        # the callback must not keep a module alive).
        self._kept: tuple[weakref.ref[nn.Module], dict[str, weakref.ref[nn.Module]]] | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Wrap this run's strategy: plan when its setup starts, re-tie right after its move.

        The ties the module holds now, before ``configure_model``, must survive that hook:
        where it shards the module with FSDP2 (``ModelParallelStrategy``), units that split a
        tie raise `tiekit.TieError` naming them (`tiekit.check_sharding`), before the first step.
        A model ``configure_model`` builds itself is checked as it stands after the hook."""
        self._unwrap()
        self._check_kept(trainer, pl_module, stage)
        strategy = trainer.strategy
        _refuse_tied_io_where_unused(strategy)
        _refuse_tied_io_in_async(strategy)
        originals = {"setup": strategy.setup, "model_to_device": strategy.model_to_device}
        before = self._given if self._given is not None else moving_plan(pl_module, self.declared)

        def setup(trainer_: Any) -> None:
            # After configure_model, before the precision plugin casts and the strategy moves.
            self.plan = self._given if self._given is not None else moving_plan(pl_module, self.declared)
            self._kept = (weakref.ref(pl_module), _owners(pl_module, self.plan))
            self._check_configured(pl_module, before)
            if self._given is not None:
                _refuse_unfitting_plan(pl_module, self._given)
                refuse_plan_without_mixin_ties(pl_module, self._given, "KeepTies")
            originals["setup"](trainer_)

        def model_to_device() -> None:
            originals["model_to_device"]()
            self._retie(pl_module)

        strategy.setup = setup
        strategy.model_to_device = model_to_device
        self._wrapped = (strategy, originals)

    def _check_kept(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        """Refuse a stage whose module lost a tie of the plan the last stage kept.

        Planning again from the module as it is would take the broken tie for two tensors, and
        the stage would run untied with nothing said. Collective when the stage's trainer has
        several ranks (every one of them runs its setup; a one-device trainer that rank 0 alone
        runs after a DDP fit checks alone): ranks whose modules differ (a tie broken on rank 0 alone) are a
        `TieError` on every rank naming each rank's, whatever ``on_error`` says; the rank that
        raised alone left the others failing in DDP's first broadcast, naming no tie."""
        kept, plan = self._kept, self.plan
        if kept is None or plan is None:
            return
        broken = _broken_since(pl_module, plan, kept[1]) if kept[0]() is pl_module else []
        stage = getattr(stage, "value", stage)  # Lightning passes its TrainerFn, a str enum
        world = getattr(trainer, "world_size", 1)
        if world > 1 and ranks().world == world:
            _refuse_ranks_that_differ(collective_gather(broken, operation="KeepTies"), pl_module, stage)
        if not broken:
            return
        message = (
            f"KeepTies: at the start of {stage}, {type(pl_module).__name__} no longer holds ties it held at the end "
            f"of the stage before: {'; '.join(broken)}. Something between the stages gave the tied names separate "
            "tensors (load_state_dict(..., assign=True), a plain .to, an assignment) or removed them. Tie them again "
            "with tiekit.retie(module, keep.plan), or load without assign=True; to drop a tie on purpose, run the "
            "stage with a new KeepTies"
        )
        if self.on_error == "raise":
            raise TieError(message)
        warnings.warn(message, TieWarning, stacklevel=2)

    def _retie(self, pl_module: nn.Module) -> None:
        if self.plan is not None:
            retie(pl_module, self.plan)
            verify(pl_module, self.plan, on_error=self.on_error)

    def _check_configured(self, pl_module: nn.Module, before: TiePlan) -> None:
        """Refuse ties that were one tensor before ``configure_model`` and are not after it."""
        kept = _still_named(pl_module, before)  # configure_model may replace modules: those are new
        if not kept.groups:
            if _has_fsdp2_units(pl_module):  # a model built in configure_model: its ties as read now
                check_sharding(pl_module)
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
        """Check the ties before training starts; refuse a ``ModelCheckpoint`` folder that is a URL
        when `TiedCheckpointIO` writes the checkpoints (it writes local files only)."""
        _refuse_tied_io_to_urls(trainer)
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


def _refuse_ranks_that_differ(everyone: list[list[str]], pl_module: nn.Module, stage: str) -> None:
    """`TieError` (on every rank: each has ``everyone``) unless every rank's module lost the same ties."""
    if all(broken == everyone[0] for broken in everyone):
        return
    said = "; ".join(
        f"rank {rank}: {', '.join(broken) if broken else 'holds every tie'}" for rank, broken in enumerate(everyone)
    )
    raise TieError(
        f"KeepTies: at the start of {stage}, the ranks' {type(pl_module).__name__} no longer hold the same ties "
        f"they held at the end of the stage before ({said}). Something between the stages changed the module on "
        "some ranks only (weights loaded on rank 0 alone with load_state_dict(..., assign=True)?), and the ranks "
        "cannot train modules whose parameters differ. Tie them again with tiekit.retie(module, keep.plan) on "
        "those ranks, or load the same weights on every rank without assign=True"
    )


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


def _holds_tied_io(chain: list[Any]) -> bool:
    """Whether a plugin chain (`_checkpoint_io_chain`) holds a `TiedCheckpointIO`, bare or wrapped."""
    return any(isinstance(io, TiedCheckpointIO) for io in chain)


def _refuse_tied_io_where_unused(strategy: Any) -> None:
    """`TiekitError` for `TiedCheckpointIO` (bare or wrapped) under a strategy that bypasses it:
    Lightning's ``ModelParallelStrategy`` and ``FSDPStrategy`` save a distributed checkpoint
    without it, or give it a gathered state dict whose tied names are separate copies (the file
    stores both), and they load every checkpoint with ``torch.load``, never through it (a resume fails)."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, ModelParallelStrategy | FSDPStrategy) and _holds_tied_io(_checkpoint_io_chain(strategy)):
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
    if _holds_tied_io(chain) and any(isinstance(io, AsyncCheckpointIO) for io in chain):
        raise TiekitError(
            "TiedCheckpointIO inside Lightning's AsyncCheckpointIO would lose the ties in every checkpoint: "
            "AsyncCheckpointIO clones each tensor of the checkpoint separately, so tied names reach the plugin as "
            "separate tensors and the file stores each of them, untied (tiekit.load_model takes such a file only "
            "where it can compare the copies and finds them equal). Pass the plugin itself, "
            "plugins=[TiedCheckpointIO()]: it writes each checkpoint atomically before training goes on. To write "
            "checkpoints in the background while training goes on, "
            "train with tiekit.fit (checkpoint_async=True) or save with tiekit.save_checkpoint(..., blocking=False)"
        )


def _refuse_tied_io_to_urls(trainer: Any) -> None:
    """`TiekitError` naming a ``ModelCheckpoint`` folder that is a URL (``s3://``) when the
    strategy's plugins hold `TiedCheckpointIO`: raised at the start of fit (the callbacks' setup
    has resolved their folders by then) rather than at the first save, after the first epoch."""
    if not _holds_tied_io(_checkpoint_io_chain(trainer.strategy)):
        return
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if dirpath is not None:
            local_path(dirpath)


def _refuse_unfitting_plan(pl_module: nn.Module, plan: TiePlan) -> None:
    """`TieError` when the re-tie after the move could not apply ``plan`` to ``pl_module`` (a name
    it lacks, a shape that differs): raised before the strategy casts and moves the module,
    which it found only after them."""
    for group in plan.groups:
        try:
            lasting_tie_changes(pl_module, group)  # the checks retie makes, nothing re-pointed
        except TieError as exc:
            raise TieError(
                f"KeepTies: the plan given does not fit {type(pl_module).__name__} ({exc}); nothing was cast or "
                "moved. Make the plan from this module: KeepTies(plan=tiekit.find_ties(module))"
            ) from None


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


def _owners(model: nn.Module, plan: TiePlan) -> dict[str, weakref.ref[nn.Module]]:
    """The submodule owning each name of ``plan``'s groups, by its path in ``model`` (weakly)."""
    owners: dict[str, weakref.ref[nn.Module]] = {}
    for name in (n for g in plan.groups for n in g.names):
        path = name.rpartition(".")[0]
        if path not in owners and has_module(model, path):
            owners[path] = weakref.ref(model.get_submodule(path))
    return owners


def _broken_since(model: nn.Module, plan: TiePlan, owners: Mapping[str, weakref.ref[nn.Module]]) -> list[str]:
    """What ``model`` no longer holds of ``plan``'s ties: a name that is not its group's source
    (or the view of it the plan records), or that no longer resolves. A group one of whose
    names' submodule is another object now than ``owners`` recorded was rebuilt, not broken."""

    def replaced(name: str) -> bool:
        path = name.rpartition(".")[0]
        was = owners.get(path)
        return was is not None and has_module(model, path) and model.get_submodule(path) is not was()

    broken: list[str] = []
    for group in plan.groups:
        if any(replaced(name) for name in group.names):
            continue
        try:
            _, _, source, _ = resolve(model, group.source, "tie source")
        except TieError as exc:
            broken.append(str(exc))
            continue
        for member in group.members[1:]:
            try:
                if not member_holds(model, member, source):
                    what = "" if member.view is None else "a view of "
                    broken.append(f"{member.name} is not {what}{group.source}")
            except TieError as exc:
                broken.append(str(exc))
    return broken


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
