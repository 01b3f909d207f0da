"""The speculative-decoding adapter: drafter checkpoints, context policies, the loop."""

from fold.spec.generate import GenerateResult, generate
from fold.spec.loading import load_drafter

__all__ = ["GenerateResult", "generate", "load_drafter"]
