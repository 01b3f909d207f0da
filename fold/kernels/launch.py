"""The one door every Triton launch of fold goes through, so a tool can see the launches without a device.

fold's launchers call ``launcher(kernel, grid)(*args, **kwargs)`` where Triton's own form is
``kernel[grid](*args, **kwargs)``. Outside :func:`recorded` the two are the same call. Inside it,
nothing runs: each launch is appended to the list the block gets, as a :class:`Launch` (the JIT
function, the grid, the arguments and the launch options exactly as the launcher passed them), so
``python -m tools.static_report`` can run the real launchers on ``meta`` tensors and compile what they
would launch, with no GPU and without reaching into Triton's runtime.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch a launcher made: ``kernel[grid](*args, **kwargs)``."""

    kernel: object        # a triton.JITFunction
    grid: tuple
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


_RECORDING: contextvars.ContextVar[list[Launch] | None] = contextvars.ContextVar("fold_launches", default=None)


def launcher(kernel, grid: tuple) -> Callable:
    """``kernel[grid]``, or inside :func:`recorded` a stand-in that records the call instead."""
    seen = _RECORDING.get()
    if seen is None:
        return kernel[grid]
    return lambda *args, **kwargs: seen.append(Launch(kernel, tuple(grid), args, kwargs))


@contextlib.contextmanager
def recorded() -> Iterator[list[Launch]]:
    """Inside the block (this thread or task), fold's launches are recorded into the list it yields, not run."""
    seen: list[Launch] = []
    token = _RECORDING.set(seen)
    try:
        yield seen
    finally:
        _RECORDING.reset(token)
