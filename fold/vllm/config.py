"""The ``fold`` block of a drafter's config.json: which read vLLM's drafter layers use.

vLLM hands the drafter's config.json to the drafter model (the speculative config's dict
``hf_overrides`` reach the target only), so that is where the choice lives::

    "fold": {"read": "fold", "window": 2048, "alpha": 2.0}
    "fold": {"read": "window", "window": 2048}
    "fold": {"read": "rerope", "window": 2048, "training_length": 4096}
    "fold": {"read": "stock"}

No block (or ``"read": "stock"``) leaves vLLM's own drafter read in place. A block with a bad value
stops the engine at start with a ``ValueError`` naming the field. This module imports no vLLM.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path

from fold.attention import MAX_ALPHA

READS = ("fold", "window", "rerope", "stock")
_FIELDS = {"fold": {"read", "window", "alpha"}, "window": {"read", "window"},
           "rerope": {"read", "window", "training_length"}, "stock": {"read"}}


@dataclass(frozen=True)
class ServeRead:
    """A validated ``fold`` block: ``read`` in :data:`READS`; ``window`` W (context entries kept at exact
    positions); ``alpha`` (``fold`` only); ``training_length`` (``rerope``'s query scaling
    ``max(1, log(p + 1) / log(training_length))``)."""

    read: str = "stock"
    window: int = 0
    alpha: float = 1.0
    training_length: int = 4096

    @property
    def active(self) -> bool:
        return self.read != "stock"


def parse_block(block) -> ServeRead:
    """``block`` (the dict under ``"fold"``, or None) -> :class:`ServeRead`; ``ValueError`` naming the
    field for anything else."""
    if block is None:
        return ServeRead()
    if not isinstance(block, dict):
        raise ValueError(f"fold: the drafter config's 'fold' block must be an object, got {type(block).__name__}")
    read = block.get("read")
    if read not in READS:
        raise ValueError(f"fold.read must be one of {READS}, got {read!r}")
    unknown = sorted(set(block) - _FIELDS[read])
    if unknown:
        raise ValueError(f"fold.{unknown[0]} is not a field of read={read!r} (its fields: {sorted(_FIELDS[read])})")
    if read == "stock":
        return ServeRead()
    window = block.get("window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"fold.window must be an integer >= 0 (context entries kept at exact positions), "
                         f"got {window!r}")
    alpha, training_length = 1.0, 4096
    if read == "fold":
        alpha = block.get("alpha", 2.0)
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not (
                math.isfinite(alpha) and 1 <= alpha <= MAX_ALPHA):
            raise ValueError(f"fold.alpha must be a number in [1, {MAX_ALPHA:g}], got {alpha!r}")
    if read == "rerope":
        training_length = block.get("training_length", 4096)
        if isinstance(training_length, bool) or not isinstance(training_length, int) or training_length < 2:
            raise ValueError(f"fold.training_length must be an integer >= 2, got {training_length!r}")
    return ServeRead(read, window, float(alpha), training_length)


def read_of(hf_config) -> ServeRead:
    """The :class:`ServeRead` of a drafter's (transformers) config object."""
    return parse_block(getattr(hf_config, "fold", None))


def configure(drafter_dir, out_dir, *, read="fold", window=None, alpha=None, training_length=None) -> Path:
    """Write ``out_dir``: the drafter of ``drafter_dir`` with a ``fold`` block in its config.json (every
    other file linked, not copied), so one checkpoint serves several reads. Returns ``out_dir``.

    Example::

        >>> fold.vllm.configure("drafter", "drafter-fold-2048", read="fold", window=2048, alpha=2.0)
    """
    src, out = Path(drafter_dir), Path(out_dir)
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ValueError(f"drafter_dir must hold a config.json, not found: {config_path}")
    block = {"read": read}
    for name, value in (("window", window), ("alpha", alpha), ("training_length", training_length)):
        if value is not None:
            block[name] = value
    parse_block(block)                                                  # refuse a bad block before writing
    config = json.loads(config_path.read_text())
    config["fold"] = block
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        target = out / item.name
        if item.name != "config.json" and not target.exists():
            os.symlink(item.resolve(), target)
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2))
    os.replace(tmp, out / "config.json")
    return out
