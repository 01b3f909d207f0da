"""The vLLM tests run in vLLM's own environment (README: "Serving with vLLM"); elsewhere they are not
collected."""

import importlib.util
import os

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]

# one process, no thread pinning, a small cache: set before vLLM reads its environment
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
