"""Sharded tied checkpoints: torch.distributed.checkpoint (DCP) folders with one copy per tie group.

DCP de-duplicates by name and offset, not by alias, so a plain ``dcp.save`` of a tied model
writes both names of a tied weight. `save_sharded` hands DCP one tensor per tie group (each
group's source name; FSDP2's DTensor shards as the model holds them; XLA SPMD tensors through
torch_xla's SPMD planners, each device's shard) and keeps the tie plan beside it;
`load_sharded` reads it back on any number of ranks (DCP reshards) and re-ties.

Format (version 1) of a checkpoint folder ``CKPT/``::

    CKPT/tiekit-dcp.json        the commit marker (JSON, written last by rank 0, atomically)
    CKPT/save-<id>/.metadata    DCP's metadata (a pickle, written by DCP's FileSystemWriter)
    CKPT/save-<id>/__<rank>_0.distcp   DCP's shard files, one per writing rank

The marker holds ``format``/``version``, the ``save_id`` and its ``folder``, the size of every
file of that folder, the SHA-256 of ``.metadata`` (checked before it is unpickled, with only
the globals DCP's records need: `tiekit.dcp.metadata_pickle`), the `TiePlan` (``plan``), every
stored key's global shape and dtype (``tensors``), the optimizer
record (param groups and non-tensor state by parameter source name) and ``extra`` as JSON; their
tensors are DCP keys under ``optimizer/...`` and ``extra/...`` (the codec of `tiekit.checkpoint`).

Crash safety: a save writes a new ``save-<id>/`` and commits by renaming a new marker over the
old one; a load believes only the marker, and only a save folder whose files all have the sizes
and metadata hash it records. A killed save leaves the previous marker and its folder intact;
the next commit removes folders no marker names.

Modules: `layout` (names, the marker), `state` (what is stored), `saving` (`save_sharded`),
`loading` (`load_sharded`), `convert` (to and from tied safetensors), `stream` (writing one
tensor at a time), `chunks` (reading DCP chunks straight from the shard files).
"""

from tiekit.checkpoint.handle import SaveHandle
from tiekit.dcp.convert import ConvertResult, convert
from tiekit.dcp.layout import MARKER_NAME, is_sharded_checkpoint
from tiekit.dcp.loading import ShardedLoadResult, load_sharded
from tiekit.dcp.saving import save_sharded

__all__ = [
    "MARKER_NAME",
    "ConvertResult",
    "SaveHandle",
    "ShardedLoadResult",
    "convert",
    "is_sharded_checkpoint",
    "load_sharded",
    "save_sharded",
]
