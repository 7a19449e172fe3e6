"""Sharded training that keeps ties: FSDP2 units chosen so that the owners of every tied parameter
share one (`shard`), and a check for models wrapped by hand or by a framework (`check_sharding`).

``import tiekit`` stays light: torch.distributed.fsdp is imported inside the functions.
"""

from tiekit.sharding.check import check_sharding, fsdp_assignment
from tiekit.sharding.units import Unit, UnitSpec, repeated_blocks, shard_units
from tiekit.sharding.wrap import shard

__all__ = ["Unit", "UnitSpec", "check_sharding", "fsdp_assignment", "repeated_blocks", "shard", "shard_units"]
