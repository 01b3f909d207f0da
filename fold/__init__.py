"""fold: FOLD attention for long-context speculative decoding, without retraining the drafter.

Public API: :class:`Rope`, :func:`attention` (and its append form :func:`attention_with_kvcache`),
:func:`merge_states`, :func:`tree_attention`, and
:mod:`fold.far_pages` (the page bounds of a budgeted far read, ``attention(..., far_budget=N)``).
"""

from fold import far_pages
from fold.fold_attention import attention
from fold.merge import merge_states
from fold.rope import Rope
from fold.hybrid_tree import tree_attention
from fold.with_kvcache import attention_with_kvcache

__version__ = "0.1.0"

__all__ = ["Rope", "__version__", "attention", "attention_with_kvcache", "far_pages", "merge_states",
           "tree_attention"]
