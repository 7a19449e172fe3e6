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

from tiekit.integrations.lightning.callback import KeepTies
from tiekit.integrations.lightning.checkpoint_io import TiedCheckpointIO

__all__ = ["KeepTies", "TiedCheckpointIO"]
