"""Runtimes, one module each, behind the few questions the training loop asks (`base.Backend`).

* `base`: the interface, and one process on one device.
* `torch_distributed`: CPU/CUDA in one process or DDP over torch.distributed processes.
* `fsdp`: FSDP2 over torch.distributed processes (`tiekit.shard`'s units).
* `xla`: the XLA runtime both XLA backends share (identity, loader, RNG, counters).
* `xla_replicas`: one replica per XLA device (``torch_xla.launch``).
* `xla_spmd`: one SPMD program over every XLA device, parameters replicated or sharded.

A new runtime (TorchTPU's ``torch_tpu``, device ``"tpu"``) is one more module here: a `Backend`
subclass answering the same questions, and a line in `tiekit.train.launch` starting it. The rest
of tiekit asks `tiekit.devices` about tensors and devices and never imports these modules'
runtimes itself; torch_xla is imported only when an XLA backend is built.
"""
