"""Test session setup: Triton's interpreter on the CPU, NaN-poisoned allocations, hypothesis profiles."""

import os
import sys

# Must precede any import of fold.kernels: TRITON_INTERPRET is read when kernels are decorated.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# pytest-xdist workers (`-n N`) share the cores: one worker, its share of torch's threads
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def _poisoned(real):
    def alloc(*args, **kwargs):
        out = real(*args, **kwargs)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if (caller == "fold" or caller.startswith("fold.")) and out.is_floating_point():
            out.fill_(float("nan"))
        return out
    return alloc


@pytest.fixture(autouse=True, scope="session")
def nan_poison_fold_allocations():
    """Every float tensor that fold allocates with torch.empty/empty_like starts as NaN, so an element
    a kernel or the torch path forgets to write shows up as NaN in the output."""
    real_empty, real_empty_like = torch.empty, torch.empty_like
    torch.empty, torch.empty_like = _poisoned(real_empty), _poisoned(real_empty_like)
    yield
    torch.empty, torch.empty_like = real_empty, real_empty_like


@pytest.fixture
def plain_mode():
    """The umask at 022 for one test (restored after); gives the mode a plain ``open`` writes under it,
    0o644, which a file written through ``fold.files`` must have (safetensors alone gives 0600)."""
    old = os.umask(0o022)
    yield 0o644
    os.umask(old)


# `-m quick`: the subset another torch release runs (README, .ci/run): the op against the reference on
# both paths, the custom ops under torch.compile, bad input, RoPE, the loop and every target family
QUICK = ("core/test_attention.py", "core/test_torch_path.py", "core/test_engine_ops.py", "core/test_validation.py",
         "core/test_rope.py", "spec_decode/test_spec_loop.py", "spec_decode/test_spec_families.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.replace("\\", "/").startswith(tuple(f"tests/{path}" for path in QUICK)):
            item.add_marker(pytest.mark.quick)
