"""Adapters for the frameworks users already train with: ``tiekit.integrations.lightning``
(a callback and a ``CheckpointIO``) and ``tiekit.integrations.accelerate`` (``prepare_tied``).

Nothing is imported here: each adapter imports its framework, so ``import tiekit`` never
pulls Lightning or accelerate in.
"""
