"""Tied checkpoints: safetensors files that keep ties, load into any state of a model, never lose data.

Format. A standard safetensors file: one tensor per tie group under its source name, every
other tensor under its own name, and in the header metadata ``{"format": "pt"}`` plus the
model's `TiePlan` as JSON under ``"tiekit.plan"``. Any safetensors reader opens it; tiekit
uses the plan to re-tie on load. Sharded saves follow the Hugging Face layout
(``model-00001-of-00003.safetensors`` + ``model.safetensors.index.json``), with the plan in
the index's metadata. Training checkpoints add the optimizer state (tensors under
``optimizer/...``, the rest as JSON under ``"tiekit.checkpoint"``): no pickle anywhere.

Loading validates everything first (headers, names, shapes, dtypes, the file's plan against
the model's declared ties), then commits: real tensors are overwritten in place, so parameter
identity and optimizers stay valid; meta tensors (and tensors on another device than the one
asked for) are replaced by one new tensor per unique weight, then re-tied.

Writing goes to a private work folder inside the target folder; the file is fsynced and
renamed over the target, so a crash at any point leaves the previous checkpoint loadable. For
sharded saves the index is the commit point and is written last. ``durable=False`` drops the
fsyncs: a killed process still leaves the previous checkpoint (the kernel keeps what was
written, renames stay ordered), a power loss may not.

The package, one idea a module: `layout` (names on disk), `saving` (what is stored),
`files` (atomic and sharded writes), `source` (opening and validating), `staging` (checking a
load against the model), `loading` (committing it), `reads` (bytes into tensors), `optimizer`
(optimizer state), `codec` (values as JSON plus tensors). Every function here is local;
`tiekit.collective` coordinates ranks.
"""

from tiekit.checkpoint.layout import (
    CHECKPOINT_NAME,
    INDEX_SUFFIX,
    PLAN_KEY,
    SAVE_ID_KEY,
    STATE_KEY,
    WEIGHTS_NAME,
)
from tiekit.checkpoint.loading import LoadResult, load_checkpoint, load_model
from tiekit.checkpoint.saving import save_checkpoint, save_model
from tiekit.checkpoint.source import Source, open_source
from tiekit.declarations import declared_ties

__all__ = [
    "CHECKPOINT_NAME",
    "INDEX_SUFFIX",
    "PLAN_KEY",
    "SAVE_ID_KEY",
    "STATE_KEY",
    "WEIGHTS_NAME",
    "LoadResult",
    "Source",
    "declared_ties",
    "load_checkpoint",
    "load_model",
    "open_source",
    "save_checkpoint",
    "save_model",
]
