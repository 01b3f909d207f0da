"""FOLD in vLLM: a plug-in that serves a DFlash / DSpark drafter's attention layers through fold.

Installed with ``pip install "fold[vllm]"``; vLLM loads :func:`register` through the
``vllm.general_plugins`` entry point in every process. The read is chosen in the drafter's
config.json (see :mod:`fold.vllm.config`, or write it with :func:`configure`)::

    "fold": {"read": "fold", "window": 2048, "alpha": 2.0}

and the drafter is configured as usual::

    LLM(model=TARGET, speculative_config={"method": "dflash", "model": DRAFTER_WITH_FOLD_BLOCK,
                                          "num_speculative_tokens": 7})

Only :mod:`fold.vllm.compat` imports vLLM's internal names; this module imports none of vLLM until
:func:`register` runs.
"""

from fold.vllm.config import READS, ServeRead, configure, parse_block, read_of

__all__ = ["READS", "ServeRead", "configure", "parse_block", "read_of", "register"]


def register() -> None:
    """vLLM's plug-in hook: the ``FOLD`` attention backend and the drafter classes (idempotent)."""
    from fold.vllm import compat
    from fold.vllm.backend import NAME

    if NAME not in compat.AttentionBackendEnum.__members__:
        compat.register_backend(NAME, "fold.vllm.backend.FoldAttentionBackend")
    for arch in compat.DRAFTERS:
        compat.ModelRegistry.register_model(arch, f"fold.vllm.models:Fold{arch}")
