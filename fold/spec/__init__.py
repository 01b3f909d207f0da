"""The speculative-decoding adapter: drafter checkpoints, context policies, the loop, metrics."""

from fold.spec.generate import GenerateResult, autoregressive, generate
from fold.spec.loading import load_drafter
from fold.spec.metrics import bootstrap_ci, per_sequence_speedup, per_sequence_tau

__all__ = ["GenerateResult", "autoregressive", "bootstrap_ci", "generate", "load_drafter", "per_sequence_speedup",
           "per_sequence_tau"]
