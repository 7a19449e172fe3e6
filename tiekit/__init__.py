"""tiekit: keep tied weights tied through device moves, dtype casts and checkpoints."""

from typing import TYPE_CHECKING, Any

from tiekit.agreement import collective_check_same_model
from tiekit.analyze import find_ties
from tiekit.backends.torch_distributed import clear_dtensor_caches
from tiekit.checkpoint import LoadResult, load_checkpoint, load_model, save_checkpoint, save_model
from tiekit.collective import collective_save_checkpoint, collective_save_model, is_writer
from tiekit.dcp import ConvertResult, SaveHandle, ShardedLoadResult, convert, load_sharded, save_sharded
from tiekit.errors import CheckpointError, ReplicaStopped, TieError, TiekitError, TieWarning
from tiekit.mixin import TPUMixin
from tiekit.moving import move, preserve_ties, rebind_optimizer
from tiekit.plan import PLAN_VERSION, CrossModuleUse, TieGroup, TieMember, TiePlan, TieUse, ViewGeometry
from tiekit.retie import VerifyReport, retie, verify
from tiekit.sharding import check_sharding, shard

if TYPE_CHECKING:
    from tiekit.train import FitResult, fit

__version__ = "0.1.0"

__all__ = [
    "PLAN_VERSION",
    "CheckpointError",
    "ConvertResult",
    "CrossModuleUse",
    "FitResult",
    "LoadResult",
    "ReplicaStopped",
    "SaveHandle",
    "ShardedLoadResult",
    "TPUMixin",
    "TieError",
    "TieGroup",
    "TieMember",
    "TiePlan",
    "TieUse",
    "TieWarning",
    "TiekitError",
    "VerifyReport",
    "ViewGeometry",
    "__version__",
    "check_sharding",
    "clear_dtensor_caches",
    "collective_check_same_model",
    "collective_save_checkpoint",
    "collective_save_model",
    "convert",
    "find_ties",
    "fit",
    "is_writer",
    "load_checkpoint",
    "load_model",
    "load_sharded",
    "move",
    "preserve_ties",
    "rebind_optimizer",
    "retie",
    "save_checkpoint",
    "save_model",
    "save_sharded",
    "shard",
    "verify",
]


def __getattr__(name: str) -> Any:
    # The training loop (DataLoader, torch.distributed, tqdm) loads on first use of tiekit.fit.
    if name in ("fit", "FitResult"):
        from tiekit import train

        return getattr(train, name)
    raise AttributeError(f"module 'tiekit' has no attribute {name!r}")
