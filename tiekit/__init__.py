"""tiekit: keep tied weights tied through device moves, dtype casts and checkpoints."""

from tiekit.analyze import find_ties
from tiekit.errors import CheckpointError, TieError, TiekitError, TieWarning
from tiekit.mixin import TPUMixin
from tiekit.plan import PLAN_VERSION, CrossModuleUse, TieGroup, TieMember, TiePlan, TieUse, ViewGeometry
from tiekit.retie import VerifyReport, move, preserve_ties, rebind_optimizer, retie, verify

__version__ = "0.1.0"

__all__ = [
    "PLAN_VERSION",
    "CheckpointError",
    "CrossModuleUse",
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
    "move",
    "preserve_ties",
    "rebind_optimizer",
    "retie",
    "verify",
]
