"""vLLM 0.34's V2 DFlash speculator, driven directly on a CPU (``harness.py``).

Collected only where vLLM 0.34 is installed (``.venv-v2``: the CUDA wheel, ``--no-deps``, on torch's
CUDA build without a driver). Run alone, one process:

    CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1 OMP_NUM_THREADS=1 \
        .venv-v2/bin/python -m pytest -q -p no:xdist tests/vllm_v2

The two variables are also set here, before anything imports vLLM: ``vllm.triton_utils`` keeps its
Triton kernels only when ``CUDA_VISIBLE_DEVICES`` is present and empty (no active driver), and
Triton's interpreter then runs them on CPU tensors.
"""

import importlib.metadata
import os
import sys


def _vllm_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


VLLM = _vllm_version()
if VLLM is None or not VLLM.startswith("0.34."):
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _IMPORTED_EARLY = "vllm" in sys.modules        # by another conftest: its Triton check then ran without us

    import pytest

    # .ci/run (CI=true) runs this folder in the venv that has vLLM 0.34: there a harness that cannot run fails
    _not_run = pytest.fail if os.environ.get("CI") == "true" else pytest.skip

    @pytest.fixture(scope="module")
    def v2_process():
        """This process set up for the harness: the platform patches (``harness.WORKAROUNDS``),
        ``fold.vllm.register()`` (``DFlashDraftModel`` -> fold's subclass), a one-rank gloo world.
        Module-scoped: undone whenever a worker (``-n 2``) goes on to another module's tests, which
        then run unpatched."""
        if os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
            _not_run("the V2 harness drives vLLM's CPU-less CUDA build on UnspecifiedPlatform: it needs "
                        'CUDA_VISIBLE_DEVICES=""')
        from vllm.platforms import current_platform, interface
        from vllm.triton_utils import HAS_TRITON

        if not isinstance(current_platform, interface.UnspecifiedPlatform):
            _not_run(f"the V2 harness is for a machine without a GPU (vLLM found {type(current_platform).__name__})")
        if not HAS_TRITON:
            _not_run("vLLM disabled its Triton kernels (imported before this conftest set CUDA_VISIBLE_DEVICES=''"
                        if _IMPORTED_EARLY else "vLLM disabled its Triton kernels")
        import fold.vllm
        from tests.vllm_v2 import harness

        with harness.patched():
            fold.vllm.register()
            with harness.distributed():
                yield harness
