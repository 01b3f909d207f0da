"""Readable PyTorch references for every op in ``fold``: dense, float64-capable, no Triton.

Tests, benchmarks and the tuner compare against these; ``fold`` itself never imports them.
"""

from reference.fold_attention import (attention_with_kvcache_ref, fold_attention_ref, rope_attention_ref,
                                      select_far_pages_ref)
from reference.merge import merge_states_ref
from reference.rope import apply_rope
from reference.tree_attention import tree_attention_ref

__all__ = ["apply_rope", "attention_with_kvcache_ref", "fold_attention_ref", "merge_states_ref", "rope_attention_ref", "select_far_pages_ref",
           "tree_attention_ref"]
