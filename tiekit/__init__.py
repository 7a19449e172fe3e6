"""tiekit: keep tied weights tied through device moves, dtype casts and checkpoints."""

from tiekit.analyze import find_ties
from tiekit.checkpoint import LoadResult, load_checkpoint, load_model, save_checkpoint, save_model
from tiekit.errors import CheckpointError, TieError, TiekitError, TieWarning
from tiekit.mixin import TPUMixin
from tiekit.plan import PLAN_VERSION, CrossModuleUse, TieGroup, TieMember, TiePlan, TieUse, ViewGeometry
from tiekit.retie import VerifyReport, move, preserve_ties, rebind_optimizer, retie, verify

__version__ = "0.1.0"

__all__ = [
    "PLAN_VERSION",
    "CheckpointError",
    "CrossModuleUse",
    "LoadResult",
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
    "find_ties",
    "load_checkpoint",
    "load_model",
    "move",
    "preserve_ties",
    "rebind_optimizer",
    "retie",
    "save_checkpoint",
    "save_model",
    "verify",
]
