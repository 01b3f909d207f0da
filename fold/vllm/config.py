"""The ``fold`` block of a drafter's config.json: which read vLLM's drafter layers use.

vLLM hands the drafter's config.json to the drafter model (the speculative config's dict
``hf_overrides`` reach the target only), so that is where the choice lives::

    "fold": {"read": "fold", "window": 2048, "alpha": 2.0}
    "fold": {"read": "fold", "window": 2048, "alpha": 2.0, "far_budget": 1024}     # "far_page": block size
    "fold": {"read": "fold", "window": 2048, "alpha": 2.0, "far_budget": 1024, "far_rank": "keys"}
    "fold": {"read": "window", "window": 2048}
    "fold": {"read": "rerope", "window": 2048, "training_length": 4096}
    "fold": {"read": "stock"}

No block (or ``"read": "stock"``) leaves vLLM's own drafter read in place. Every read also takes
``"backend"``: ``"auto"`` (default: fold's Triton kernels on CUDA, its torch path on a CPU),
``"triton"`` (the kernels; on a CPU only under ``TRITON_INTERPRET=1``, which then runs exactly the
launches a GPU would) or ``"torch"``. ``"far_budget"`` N (``fold`` only) has the far branch read at
most ``N // far_page`` pages per request and KV head, chosen by per-page key bounds the backend keeps
beside the cache (``"far_rank": "keys"``: ranked by the pages' keys, ``fold.attention``'s ``far_rank``);
``"far_page"`` must equal the drafter cache's block size (its pages are the far pages) and defaults to it. A block with a bad value stops the engine at start with a
``ValueError`` naming the field, raised in the process the user started (:func:`check_engine_config`).
This module imports no vLLM.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from fold.checks import check_int
from fold.files import write_text_atomically
from fold.read_options import BACKENDS, MAX_ALPHA, RANKS, ReadOptions, straddled_pages

READS = ("fold", "window", "rerope", "stock")
_FIELDS = {"fold": {"read", "window", "alpha", "backend", "far_budget", "far_page",
                    "far_rank"}, "window": {"read", "window", "backend"},
           "rerope": {"read", "window", "training_length", "backend"}, "stock": {"read"}}
# the read options as the block's errors word them (ReadOptions.check holds the rules)
_WORDS = {"alpha": f"a number in [1, {MAX_ALPHA:g}]", "backend": f"one of {BACKENDS}", "far_budget": "an integer >= 1",
          "far_page": "an integer >= 1", "far_rank": f"one of {RANKS}"}


@dataclass(frozen=True)
class ServeRead:
    """A validated ``fold`` block: ``read`` in :data:`READS`; ``window`` W (context entries kept at exact
    positions); ``alpha`` (``fold`` only); ``training_length`` (``rerope``'s query scaling
    ``max(1, log(p + 1) / log(training_length))``); ``backend`` (``fold.attention``'s); ``far_budget``
    (``fold`` only: None reads every far entry, N at most ``N // far_page`` far pages) and ``far_page``
    (None: the cache's block size, which it must equal), ``far_rank`` (``fold.attention``'s)."""

    read: str = "stock"
    window: int = 0
    alpha: float = 1.0
    training_length: int = 4096
    backend: str = "auto"
    far_budget: int | None = None
    far_page: int | None = None
    far_rank: str = "bound"

    def check_pages(self, block_size: int, n_q: int | None = None) -> None:
        """``far_page`` against the drafter cache's ``block_size``, and ``far_budget`` against the pages a
        block of ``n_q`` query rows straddles (``ValueError`` naming the field)."""
        if self.far_budget is None:
            return
        if self.far_page is not None and self.far_page != block_size:
            raise ValueError(f"fold.far_page must equal the drafter cache's block size {block_size} (its pages are "
                             f"the far pages), got {self.far_page}")
        if n_q is not None:
            need = straddled_pages(n_q, block_size)
            if self.far_budget // block_size < need:
                raise ValueError(f"fold.far_budget must hold at least {need} pages of {block_size} entries for a "
                                 f"draft block of {n_q} rows (the pages its rows straddle are always read), i.e. "
                                 f">= {need * block_size}; got {self.far_budget}")

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
    window = check_int("fold.window", block.get("window"), 0,
                       expected="an integer >= 0 (context entries kept at exact positions)")
    alpha = _read_option(block, "alpha", 2.0) if read == "fold" else 1.0
    training_length = 4096
    if read == "rerope":
        training_length = check_int("fold.training_length", block.get("training_length", 4096), 2,
                                    expected="an integer >= 2")
    backend = _read_option(block, "backend", "auto")
    far_budget = _read_option(block, "far_budget", None)
    far_page = None if block.get("far_page") is None else _read_option(block, "far_page", None)
    if far_page is not None and far_budget is None:
        raise ValueError("fold.far_page sizes the pages of far_budget; give far_budget too")
    far_rank = _read_option(block, "far_rank", "bound")
    if "far_rank" in block and far_budget is None:
        raise ValueError("fold.far_rank ranks the pages of far_budget; give far_budget too")
    return ServeRead(read, window, alpha, training_length, backend, far_budget, far_page, far_rank)


def _read_option(block: dict, name: str, default):
    """The block's read option ``name`` (``default`` when absent), checked by the rule of
    :class:`fold.read_options.ReadOptions`; a bad value is a ``ValueError`` naming the field."""
    value = block.get(name, default)
    try:
        return ReadOptions.check(name, value)
    except (TypeError, ValueError):
        raise ValueError(f"fold.{name} must be {_WORDS[name]}, got {value!r}") from None


def read_of(hf_config) -> ServeRead:
    """The :class:`ServeRead` of a drafter's (transformers) config object."""
    return parse_block(getattr(hf_config, "fold", None))


def configure(drafter_dir, out_dir, *, read="fold", window=None, alpha=None, training_length=None, backend=None,
              far_budget=None, far_page=None, far_rank=None, max_model_len=None, raise_max_position=False) -> Path:
    """Write ``out_dir``: the drafter of ``drafter_dir`` with a ``fold`` block in its config.json (every
    other file linked, not copied), so one checkpoint serves several reads. Returns ``out_dir``.

    ``max_model_len``: the length the engine will serve. vLLM drafts nothing (for the whole batch)
    once a request passes the drafter's ``max_position_embeddings``; a longer ``max_model_len`` warns
    saying so, and with ``raise_max_position=True`` the configured drafter's ``max_position_embeddings``
    is raised to it (FOLD reads any length; refused for dynamic NTK RoPE, whose frequencies vLLM forms
    from that number).

    Example::

        >>> fold.vllm.configure("drafter", "drafter-fold-2048", read="fold", window=2048, alpha=2.0,
        ...                     max_model_len=131072, raise_max_position=True)
    """
    src, out = Path(drafter_dir), Path(out_dir)
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ValueError(f"drafter_dir must hold a config.json, not found: {config_path}")
    block = {"read": read}
    for name, value in (("window", window), ("alpha", alpha), ("training_length", training_length),
                        ("backend", backend), ("far_budget", far_budget), ("far_page", far_page),
                        ("far_rank", far_rank)):
        if value is not None:
            block[name] = value
    parse_block(block)                                                  # refuse a bad block before writing
    config = json.loads(config_path.read_text())
    config["fold"] = block
    _fit_max_position(config, max_model_len, raise_max_position)
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        target = out / item.name
        if item.name != "config.json" and not target.exists():
            os.symlink(item.resolve(), target)
    write_text_atomically(out / "config.json", json.dumps(config, indent=2))
    return out


def _fit_max_position(config: dict, max_model_len, raise_max_position: bool) -> None:
    """Check (and with ``raise_max_position`` raise) the drafter config's ``max_position_embeddings``
    against the ``max_model_len`` to be served."""
    if max_model_len is None:
        if raise_max_position:
            raise ValueError("raise_max_position needs max_model_len (the length to raise it to)")
        return
    check_int("max_model_len", max_model_len, 1, expected="a positive int")
    limit = config.get("max_position_embeddings")
    if limit is None or max_model_len <= limit:
        return
    if not raise_max_position:
        warnings.warn(f"max_model_len {max_model_len} exceeds the drafter's max_position_embeddings {limit}: past "
                      f"position {limit} vLLM drafts nothing for the whole batch (every round verifies empty "
                      "drafts). Pass raise_max_position=True to raise it in the configured drafter.", stacklevel=3)
        return
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) == "dynamic":
        raise ValueError("raise_max_position: this drafter uses dynamic NTK RoPE, whose frequencies vLLM forms from "
                         "max_position_embeddings; raising it would change the drafter's positions")
    config["max_position_embeddings"] = max_model_len
