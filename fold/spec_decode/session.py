"""One sequence's target: its cache and the verbs the loop uses on it.

    session = TargetSession(target)
    logits, hidden = session.prefill(prompt)            # [V] of the last position, hidden_states
    rows, hidden = session.verify([anchor, *drafts])    # recorded, so that it can be rolled back
    session.commit(kept)                                # keep the first ``kept`` verified entries
    logits, hidden = session.decode(token)              # a plain decoding step (committed at once)

A verification stays pending until the loop commits it (:meth:`commit`, or :meth:`keep_path` for
a tree); nothing commits implicitly, and a forward while one is pending is refused. The facts the
session needs about its target (:class:`fold.spec_decode.target.TargetFacts`) are probed once and shared
by the sessions given them. :class:`Prefills` shares prompt forwards across runs, and
:class:`LogitRows` computes a verification's logits a row at a time where the head's cost follows
its rows (a CPU).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch

from fold.checks import check_bool, check_int
from fold.spec_decode import rollback
from fold.spec_decode.target import TargetFacts


class LogitRows:
    """Logits ``[T, V]`` of one sequence, each row computed the first time it is read (``rows[i] ->
    [V]``) as ``head(hidden[i:i + 1])[0]``: acceptance reads a verification's rows only up to the first
    mismatch, and a chain with a cutoff a drafter's only up to the first unsure slot, so each pays its
    LM head for the rows it looks at. ``first``: row 0 if already computed (by the model's forward)."""

    def __init__(self, hidden: torch.Tensor, head, first: torch.Tensor | None = None):
        self._rows = {} if first is None else {0: first}
        self._hidden, self._head = hidden, head           # final hidden states [T, H], [k, H] -> [k, V]

    def __len__(self) -> int:
        return self._hidden.shape[0]

    @property
    def computed(self) -> frozenset[int]:
        """The rows computed so far."""
        return frozenset(self._rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        if i not in self._rows:
            with torch.no_grad():
                self._rows[i] = self._head(self._hidden[i:i + 1])[0]
        return self._rows[i]


class TargetSession:
    """One sequence's target (see the module docstring). ``facts``: the target's, probed once and
    shared (default: probed here); ``prefills``: a :class:`Prefills` whose prompt forwards it copies.

    Attributes: ``target``, ``facts``, ``device``, ``cache`` (transformers' cache object), ``length``
    (entries the cache holds: the position of the next token), ``pending`` (tokens of a verification
    not yet committed, 0 when none)."""

    def __init__(self, target, prefills: Prefills | None = None, facts: TargetFacts | None = None):
        self.target, self.prefills = target, prefills
        self.facts = facts or (prefills.facts if prefills is not None else TargetFacts.probe(target))
        self.device = next(target.parameters()).device
        self.cache = None
        self.length = 0
        self._pending: rollback.Replay | int | None = None     # a verification not yet committed

    @property
    def pending(self) -> int:
        p = self._pending
        return 0 if p is None else p if isinstance(p, int) else p.new_tokens

    @property
    def can_swap_attention(self) -> bool:
        """Whether the target dispatches its attention through transformers' ``AttentionInterface``."""
        return self.facts.swappable

    def prefill(self, ids) -> tuple[torch.Tensor, tuple]:
        """The prompt ``ids [T]``: its forward (or a copy of the shared one, see :class:`Prefills`) ->
        ``(logits of its last position [V], hidden_states)``."""
        self._check_idle("prefill")
        if self.cache is not None:
            raise RuntimeError("prefill starts a sequence; this session already holds one")
        if self.prefills is not None:
            return self.prefills.prefill(self, ids)
        out = self._forward(ids, record=False)
        return out.logits[0, -1], out.hidden_states

    def decode(self, token: int) -> tuple[torch.Tensor, tuple]:
        """One plain decoding step: ``token`` appended and committed -> ``(logits [V], hidden_states)``."""
        self._check_idle("decode")
        out = self._forward(torch.tensor([token], device=self.device), record=False)
        return out.logits[0, -1], out.hidden_states

    def verify(self, ids, position_ids=None) -> tuple[torch.Tensor | LogitRows, tuple]:
        """A verification forward of ``ids [T]`` (``position_ids [T]`` for a tree), recorded so that any
        suffix can be dropped -> ``(rows [T, V], hidden_states)``: for a chain on a CPU, with a target
        whose logits are plain ``lm_head(last hidden state)``, a :class:`LogitRows` (row 0 computed by
        the forward, the rest when read); else the logits tensor (a tree reads every row). Pending
        until :meth:`commit` (a chain) or :meth:`keep_path` (a tree)."""
        self._check_idle("verify")
        ids = torch.as_tensor(ids, device=self.device)
        lazy = (position_ids is None and self.device.type == "cpu" and self.facts.plain_head
                and self.facts.logits_to_keep)
        from fold.spec_decode.swap import grouped_verification

        # several query rows over a cache read it grouped, not repeated (a tree's swap leaves it alone)
        with grouped_verification(self.target) if self.cache is not None and len(ids) > 1 else nullcontext():
            out = self._forward(ids, record=True, position_ids=position_ids,
                                rows=torch.zeros(1, dtype=torch.long, device=self.device) if lazy else None)
        if lazy:
            head = self.target.get_output_embeddings()
            return LogitRows(out.hidden_states[-1][0], head, first=out.logits[0, 0]), out.hidden_states
        return out.logits[0], out.hidden_states

    def commit(self, kept: int) -> None:
        """Keep the first ``kept`` entries of the pending verification, drop the rest."""
        if self._pending is None:
            raise RuntimeError("commit: no verification is pending")
        pending, replay = self.pending, self._pending
        if not 0 <= kept <= pending:
            raise ValueError(f"commit: kept must lie in [0, {pending}] (the verification's tokens), got {kept}")
        self._pending = None
        rollback.crop(self.target, self.cache, self.length - pending + kept,
                      replay if isinstance(replay, rollback.Replay) else None)
        self.length += kept - pending

    def keep_path(self, kept) -> None:
        """After a tree verification: keep the committed entries and the tree nodes ``kept`` (indices
        into the verified nodes, in order) in every full and sliding layer."""
        if self._pending is None:
            raise RuntimeError("keep_path: no verification is pending")
        n_tree, self._pending = self.pending, None
        rollback.keep_path(self.cache, n_tree, kept)
        self.length += len(kept) - n_tree

    def attention(self, fn):
        """Within the block, every attention layer of the target runs ``fn(module, query, key, value,
        attention_mask, **kwargs)`` (transformers' ``AttentionInterface`` signature)."""
        from fold.spec_decode.swap import attention_swapped

        return attention_swapped(self.target, fn)

    def _check_idle(self, verb: str) -> None:
        if self._pending is not None:
            raise RuntimeError(f"{verb}: the last verification ({self.pending} tokens) is not committed; call "
                               "commit(kept) or keep_path(kept) first")

    def _forward(self, ids, *, record: bool, position_ids=None, rows=None):
        """``target(ids[None])`` on the cache; ``record``: a verification (pending until committed);
        ``rows``: transformers' ``logits_to_keep`` (an int: that many last rows; an index tensor: those rows)."""
        kwargs = {}
        if self.cache is not None:
            kwargs[self.facts.cache_kwarg] = self.cache
        if position_ids is not None:
            kwargs["position_ids"] = torch.as_tensor(position_ids, device=self.device)[None]
        if rows is not None:
            kwargs["logits_to_keep"] = rows
        snapshots = rollback.record(self.cache, record) if self.cache is not None else {}
        out = self.target(ids[None], use_cache=True, output_hidden_states=True, **kwargs)
        self.cache = out["cache"] if "cache" in out else out["past_key_values"]
        self.length += ids.shape[0]
        if record:
            self._pending = rollback.Replay(snapshots, out.hidden_states, ids.shape[0]) if snapshots else ids.shape[0]
        return out


class Prefills:
    """Prompt forwards shared by every run on ``target`` that passes this object (``spec_decode.generate`` /
    ``spec_decode.autoregressive``'s ``prefill=``): each prompt is run once and every later run starts from a
    copy of its cache, so rows, policies and drafters compared on the same prompts pay one prefill
    (TPOT excludes it, so no number changes). ``keep`` bounds the prompts held (oldest dropped
    first; None keeps all); ``last_logits_only`` runs the prompt with ``logits_to_keep=1`` (the loop
    reads the last row; a long prompt's full logits are large) for targets that take it. It also
    holds the target's :class:`TargetFacts`, probed once for every session that uses it.

    Example::

        >>> shared = spec_decode.Prefills(target)
        >>> ar = spec_decode.autoregressive(target, ids, max_new_tokens=64, prefill=shared)
        >>> runs = {p: spec_decode.generate(target, drafter, ids, max_new_tokens=64, policy=p, prefill=shared)
        ...         for p in ("dflash", "fold")}                  # one prompt forward per prompt in all
    """

    def __init__(self, target, keep: int | None = None, last_logits_only: bool = False):
        check_int("keep", keep, 1, none_ok=True, expected="a positive int or None")
        check_bool("last_logits_only", last_logits_only)
        self.target, self.keep, self.last_logits_only = target, keep, last_logits_only
        self._facts: TargetFacts | None = None    # probed at the first prompt
        self._held: dict[tuple, tuple] = {}       # prompt -> (last logits, hidden_states, cache)

    @property
    def facts(self) -> TargetFacts:
        """The target's :class:`TargetFacts`, probed once (at first use) for every session given this object."""
        if self._facts is None:
            self._facts = TargetFacts.probe(self.target)
        return self._facts

    def prefill(self, session: TargetSession, ids) -> tuple[torch.Tensor, tuple]:
        key = tuple(ids.tolist())
        if key not in self._held:
            fresh = TargetSession(self.target, facts=self.facts)
            keep_one = self.last_logits_only and self.facts.logits_to_keep
            out = fresh._forward(ids, record=False, rows=1 if keep_one else None)
            if self.keep is not None and len(self._held) >= self.keep:
                self._held.pop(next(iter(self._held)))
            self._held[key] = (out.logits[0, -1].clone(), out.hidden_states, fresh.cache)
        logits, hidden_states, cache = self._held[key]
        session.cache, session.length = copy.deepcopy(cache), len(key)
        return logits, hidden_states
