"""The speculative-decoding adapter: drafter checkpoints, context policies, the loop, metrics."""

from fold.spec_decode.generate import GenerateResult, autoregressive, generate
from fold.spec_decode.loading import load_drafter
from fold.spec_decode.metrics import bootstrap_ci, per_sequence_speedup, per_sequence_tau
from fold.spec_decode.policies import BUILT as POLICIES
from fold.spec_decode.policies import Read, make_read
from fold.spec_decode.session import Prefills, TargetSession
from fold.spec_decode.target import TargetFacts
from fold.spec_decode.upstream import FoldHandle, use_fold

__all__ = ["FoldHandle", "GenerateResult", "POLICIES", "Prefills", "Read", "TargetFacts", "TargetSession",
           "autoregressive", "bootstrap_ci", "generate", "load_drafter", "make_read",
           "per_sequence_speedup", "per_sequence_tau", "use_fold"]
