"""argparse types, one set for every command line here (``fold-demo``, the examples, ``tuning``,
``benchmarks``, ``tools``): each turns a string into a number or raises ``ArgumentTypeError`` with
what was expected, so argparse prints ``argument --x: must be ...`` and exits with status 2."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def _parse(text: str, kind: type):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    return value


def positive(kind: type = int) -> Callable[[str], int | float]:
    """A number ``> 0`` of ``kind`` (``int`` or ``float``)."""
    def parse(text: str):
        value = _parse(text, kind)
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}, got {text!r}")
        return value
    return parse


def at_least(minimum: int | float, why: str = "", *, kind: type = int) -> Callable[[str], int | float]:
    """A finite number ``>= minimum`` of ``kind``; ``why`` is appended to the message (e.g. ``" (a block)"``)."""
    what = "a finite number " if kind is float else ""
    def parse(text: str):
        value = _parse(text, kind)
        if not (value >= minimum and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be {what}>= {minimum}{why}, got {value}")
        return value
    return parse


def in_range(low: float, high: float, *, high_open: bool = False) -> Callable[[str], float]:
    """A float in ``[low, high]`` (``[low, high)`` with ``high_open``)."""
    def parse(text: str):
        value = _parse(text, float)
        if not (low <= value < high if high_open else low <= value <= high):
            raise argparse.ArgumentTypeError(f"must lie in [{low:g}, {high:g}{')' if high_open else ']'}, got {value}")
        return value
    return parse
