"""The vLLM tests run in vLLM's own environment (README: "Serving with vLLM"); elsewhere only
``test_config.py`` (the ``fold`` block's parsing, no vLLM import) is collected. The engines run in this
process (one process, no thread pinning, a small cache), and fold's Triton kernels in Triton's interpreter, so a drafter block with ``"backend": "triton"`` runs
inside the engine exactly the launches a GPU would."""

import importlib.util
import os
from pathlib import Path

if importlib.util.find_spec("vllm") is None:
    collect_ignore = [p.name for p in Path(__file__).parent.glob("test_*.py") if p.name != "test_config.py"]

# set before vLLM reads its environment and before fold's kernels are imported
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

if importlib.util.find_spec("vllm") is not None:
    import pytest

    from tests.vllm.engine import LATER, MAX_TOKENS, PROMPTS, generate, served
    from tests.vllm.pair import make_drafter, make_target

    @pytest.fixture(scope="session")
    def pairs(tmp_path_factory):
        root = tmp_path_factory.mktemp("pair")
        # the plain target's greedy output varies (no shared direction); the pulled one agrees with the drafter
        # now and then
        plain, pulled = make_target(root / "target", shift=0.0), make_target(root / "target-pulled", pull=4.0)
        # a drafter whose layers shape its drafts, and a weaker one whose drafts the pulled target accepts at times
        drafter, agreeing = make_drafter(root / "drafter"), make_drafter(root / "drafter-agreeing", scale=0.02)
        return dict(root=root, plain=plain, pulled=pulled, drafter=drafter, agreeing=agreeing)

    @pytest.fixture(scope="session")
    def target_greedy(pairs):
        """The plain target's greedy output (vLLM without speculation, float32, eager)."""
        return served(lambda llm: (generate(llm, PROMPTS, MAX_TOKENS), generate(llm, LATER, [16, 16])), pairs["plain"])
