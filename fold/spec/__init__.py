"""The speculative-decoding adapter: drafter checkpoints, context policies, the loop, metrics."""

from fold.spec.generate import GenerateResult, autoregressive, generate
from fold.spec.loading import load_drafter
from fold.spec.metrics import bootstrap_ci, per_sequence_speedup, per_sequence_tau
from fold.spec.policies import BUILT as POLICIES
from fold.spec.policies import Read, make_read
from fold.spec.session import Prefills, TargetSession
from fold.spec.target import TargetFacts

__all__ = ["GenerateResult", "POLICIES", "Prefills", "Read", "TargetFacts", "TargetSession", "autoregressive",
           "bootstrap_ci",
           "generate", "load_drafter", "make_read", "per_sequence_speedup", "per_sequence_tau"]
