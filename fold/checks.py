"""The checks of fold's scalar arguments, one per kind, for every public boundary: the error names the
argument, what it must be and what it got (a wrong type raises :class:`ScalarTypeError`, a value out of
range ``ValueError``). Each returns the value normalised (an ``int``, a ``float``)."""

from __future__ import annotations

import math
import numbers


class ScalarTypeError(TypeError, ValueError):
    """A scalar argument of the wrong type: a ``TypeError``, and a ``ValueError`` too, as some boundaries
    (``generate``'s counts, the vLLM config block) have always refused any bad value with one."""


def shown(value) -> str:
    """``value`` as an error message shows it: the repr of a number, a string or None; else its type's name
    (a tensor's repr would be its values)."""
    return repr(value) if value is None or isinstance(value, (numbers.Number, str)) else type(value).__name__


def is_int(value) -> bool:
    """An integer, and not a bool (which Python counts as one)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ScalarTypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_int(name: str, value, minimum: int | None = None, *, none_ok: bool = False,
              expected: str | None = None) -> int | None:
    """``value`` as an ``int`` (``None`` passes with ``none_ok``): an integer (a bool is not one), ``>= minimum``.

    Both errors read ``{name} must be {expected}, got {value}``; without ``expected``, "an int" (or None)
    for a wrong type and ">= minimum" for a value out of range.
    """
    if value is None and none_ok:
        return None
    if not is_int(value):
        kind = expected or ("an int or None" if none_ok else "an int")
        raise ScalarTypeError(f"{name} must be {kind}, got {shown(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {expected or f'>= {minimum}'}, got {shown(value)}")
    return int(value)


def check_float(name: str, value, low: float | None = None, high: float | None = None, *, open_low: bool = False,
                open_high: bool = False, none_ok: bool = False, expected: str | None = None) -> float | None:
    """``value`` as a ``float`` (``None`` passes with ``none_ok``): a real number (a bool is not one), finite,
    within ``[low, high]`` (either end open with ``open_low``/``open_high``, either bound left out with None).

    Both errors read ``{name} must be {expected}, got {value}``; without ``expected``, "a real number"
    (or None) for a wrong type and "finite and <the range>" for a value out of range.
    """
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kind = expected or ("a real number or None" if none_ok else "a real number")
        raise ScalarTypeError(f"{name} must be {kind}, got {shown(value)}")
    below = low is not None and (value <= low if open_low else value < low)
    above = high is not None and (value >= high if open_high else value > high)
    if not math.isfinite(value) or below or above:
        raise ValueError(f"{name} must be {expected or 'finite' + _range(low, high, open_low, open_high)}, "
                         f"got {shown(value)}")
    return float(value)


def _range(low, high, open_low, open_high) -> str:
    if low is not None and high is not None:
        return f" and in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
    if low is not None:
        return f" and {'>' if open_low else '>='} {low:g}"
    return "" if high is None else f" and {'<' if open_high else '<='} {high:g}"


def check_choice(name: str, value, choices: tuple[str, ...]) -> str:
    """``value``, one of the strings ``choices``."""
    if not isinstance(value, str):
        raise ScalarTypeError(f"{name} must be one of {choices}, got {shown(value)}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value
