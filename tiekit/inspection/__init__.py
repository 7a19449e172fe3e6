"""What the ``tiekit`` command reports: a checkpoint's ties and sizes, a model's plan, a load check.

Reading a checkpoint here never loads its tensors: the header (or the index and the shards'
headers) says every name, dtype, shape and byte range, and the tie plan tiekit wrote there
says which names were stored once. Building a model from ``module:factory`` happens on the
meta device when the factory allows it, so inspecting a large model allocates no weights.
"""

from tiekit.inspection.files import FileReport, StoredTensor, inspect_file
from tiekit.inspection.models import (
    FACTORY_HINT,
    FACTORY_PATTERN,
    BuiltModel,
    FactoryError,
    ModelReport,
    TargetError,
    build_model,
    inspect_model,
    is_factory_spec,
    load_factory,
    model_plan,
)
from tiekit.inspection.verifying import Check, VerifyOutcome, verify_checkpoint

__all__ = [
    "FACTORY_HINT",
    "FACTORY_PATTERN",
    "BuiltModel",
    "Check",
    "FactoryError",
    "FileReport",
    "ModelReport",
    "StoredTensor",
    "TargetError",
    "VerifyOutcome",
    "build_model",
    "inspect_file",
    "inspect_model",
    "is_factory_spec",
    "load_factory",
    "model_plan",
    "verify_checkpoint",
]
