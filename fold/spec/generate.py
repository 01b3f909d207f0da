"""``spec.generate``: speculative decoding of a transformers target with a block drafter.

One round, per sequence::

    drafts = drafter(anchor + MASKs, its context, read by the policy)     # one forward
    post   = target([anchor] + drafts)                                    # one forward, verifies all
    a      = longest prefix with drafts[i] == post[i]                     # greedy acceptance
    commit drafts[:a] + [post[a]];  crop the target cache to the committed entries
    append the target features of anchor + a accepted drafts to the drafter's context

Greedy acceptance commits only tokens the target itself picks, so the output equals the target's
own greedy generation (lossless); at temperature > 0 rejection sampling keeps the target's
distribution. Batch rows run one after another, each with its own caches.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from fold.spec import _hf
from fold.spec.drafter import Drafter
from fold.spec.loading import check_fits
from fold.spec.policies import Read, make_read
from fold.spec.glide import glide_tree
from fold.spec.tree import tree_round, verify_tree


@dataclass
class GenerateResult:
    sequences: torch.Tensor          # [batch, prompt + generated], right-padded after a stop
    tau: float                       # tokens committed per verification round, the target's included
    stats: dict = field(default_factory=dict)


def _check_common(target, input_ids, attention_mask, max_new_tokens, eos_token_id, temperature, generator) -> set[int]:
    """Arguments ``generate`` and ``autoregressive`` share, checked before any work; returns the eos set."""
    if not (callable(target) and hasattr(target, "parameters") and hasattr(target, "config")):
        raise TypeError(f"target must be a transformers causal LM (callable, with .parameters() and .config), "
                        f"got {type(target).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise ValueError(f"input_ids must be a [batch, prompt_len] tensor, got {getattr(input_ids, 'shape', input_ids)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must hold at least one prompt token per row, got shape {tuple(input_ids.shape)}")
    device = next(target.parameters()).device
    if input_ids.device != device:
        raise ValueError(f"input_ids must be on the target's device {device}, got {input_ids.device}")
    vocab = getattr(getattr(target, "config", None), "vocab_size", None)
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}, "
                             f"got {getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
        if attention_mask.device != input_ids.device:
            raise ValueError(f"attention_mask must be on input_ids' device {input_ids.device}, got {attention_mask.device}")
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (prompt token)")
        empty = (attention_mask == 0).all(dim=1).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"attention_mask rows {empty} are all zeros: every row needs at least one prompt token")
    valid = input_ids if attention_mask is None else input_ids[attention_mask.bool()]
    if bool((valid < 0).any()) or (vocab is not None and bool((valid >= vocab).any())):
        raise ValueError(f"input_ids must lie in [0, vocab_size={vocab}), got values in "
                         f"[{int(valid.min())}, {int(valid.max())}]")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if eos_token_id is None:
        return set()
    ids = [eos_token_id] if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool) else eos_token_id
    if not isinstance(ids, (list, tuple, set, frozenset)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TypeError(f"eos_token_id must be an int or a list of ints (token ids, not text), got {eos_token_id!r}")
    bad = [i for i in ids if i < 0 or (vocab is not None and i >= vocab)]
    if bad:
        raise ValueError(f"eos_token_id {bad} out of the vocabulary [0, {vocab})")
    return set(ids)


def _sample(logits, temperature, generator):
    # logits [V] -> token; greedy at temperature 0
    if temperature == 0.0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=generator))


def _accept(drafts, draft_probs, target_logits, temperature, generator):
    """How many drafts to keep and the target's token after them.

    Greedy: the longest prefix equal to the target's argmax, then the target's argmax. Sampling:
    standard rejection sampling, keep x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first
    rejection draw from max(p_i - q_i, 0) renormalised; if all are kept, draw the bonus from p_n.
    """
    if temperature == 0.0:
        post = target_logits.argmax(-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == post[a]:
            a += 1
        return a, post[a]
    p = torch.softmax(target_logits.float() / temperature, dim=-1)             # [n + 1, V]
    for i, x in enumerate(drafts):
        u = torch.rand((), generator=generator, device=p.device)
        if u * draft_probs[i, x] < p[i, x]:
            continue
        residual = (p[i] - draft_probs[i]).clamp(min=0)
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[-1], 1, generator=generator))


def _commit(new: list[int], accepted: list[int], max_new_tokens: int, eos: set[int], bar) -> int:
    """Append a round's accepted tokens, stopping at max_new_tokens or an eos; returns how many."""
    before = len(new)
    for token in accepted:
        new.append(token)
        if len(new) >= max_new_tokens or token in eos:
            break
    if bar is not None:
        bar.update(len(new) - before)
    return len(new) - before


def _stats(accepted, committed, drafted, new, prefill_s, decode_s) -> dict:
    """``accepted[i]``: tokens round i verified (accepted drafts + the target's); ``committed[i]``: of
    those, the ones kept (fewer only in a sequence's last round, cut by max_new_tokens or an eos)."""
    return dict(rounds=len(accepted), accepted_per_round=accepted, committed_per_round=committed,
                drafted_tokens=drafted, prefill_s=prefill_s, decode_s=decode_s,
                tpot_s=decode_s / max(1, len(new) - 1), new_tokens=len(new))


@torch.no_grad()
def _generate_one(target, drafter: Drafter, ids: torch.Tensor, max_new_tokens: int, eos: set[int], read,
                  temperature: float, generator, bar=None, tree=None):
    t0 = time.perf_counter()
    logits, hidden_states, cache = _hf.forward(target, ids[None])
    state = drafter.new_state(len(ids) + max_new_tokens, ids.device, drafter.fc.weight.dtype)
    drafter.append_context(state, drafter.features(hidden_states))
    new = [_sample(logits[0, -1], temperature, generator)]
    prefill_s = time.perf_counter() - t0
    rounds: list[int] = []
    committed: list[int] = []
    drafted = 0
    t1 = time.perf_counter()
    while len(new) < max_new_tokens and new[-1] not in eos:
        anchor = new[-1]
        if tree is not None:
            path, n_nodes, hidden_states, last_row = tree_round(target, drafter, state, cache, anchor, read, tree)
            drafted += n_nodes
            drafts, a, token = path[:-1], len(path) - 1, path[-1]
        else:
            drafts, draft_probs = drafter.draft(state, anchor, read, temperature, generator)
            drafted += len(drafts)
            logits, hidden_states, cache = _hf.forward(target, torch.tensor([[anchor] + drafts], device=ids.device),
                                                       cache)
            a, token = _accept(drafts, draft_probs, logits[0], temperature, generator)
            _hf.crop(cache, state.length + a + 1)             # anchor + accepted drafts stay
            drafter.append_context(state, drafter.features(hidden_states)[:, :a + 1])
            last_row = a
        if hasattr(read, "after_verify"):                     # target-side retrieval (CMR)
            read.after_verify(target, hidden_states, cache, state.length, last_row)
        rounds.append(a + 1)
        committed.append(_commit(new, drafts[:a] + [token], max_new_tokens, eos, bar))
    return new, _stats(rounds, committed, drafted, new, prefill_s, time.perf_counter() - t1)


@torch.no_grad()
def _generate_one_glide(target, drafter, ids: torch.Tensor, max_new_tokens: int, eos: set[int], gamma: int,
                        temperature: float, generator, bar=None, tree=None):
    """The loop for an autoregressive GLIDE drafter: a chain of gamma drafts, or a beam tree, per round."""
    t0 = time.perf_counter()
    logits, _, cache = _hf.forward(target, ids[None])
    new = [_sample(logits[0, -1], temperature, generator)]
    state = drafter.new_state(len(ids) + max_new_tokens + gamma + 1)
    drafter.forward_tokens(state, ids, cache)
    prefill_s = time.perf_counter() - t0
    rounds, committed, drafted, prompt = [], [], 0, ids.tolist()
    t1 = time.perf_counter()
    while len(new) < max_new_tokens and new[-1] not in eos:
        anchor, t = new[-1], len(ids) + len(new) - 1              # the anchor's position = target cache length
        feed = torch.tensor((prompt + new)[state.length:t + 1], device=ids.device)   # tokens the drafter lacks
        row = drafter.forward_tokens(state, feed, cache)[-1]
        if tree is not None:
            tokens, parents, depths, _ = glide_tree(drafter, state, row, anchor, tree, cache)
            drafted += len(tokens) - 1
            path, token, _, _ = verify_tree(target, cache, tokens, parents, depths, t)
            drafter.crop(state, t + 1)                            # tree entries go; accepted ones are re-fed
            rounds.append(len(path) + 1)
            committed.append(_commit(new, [tokens[i] for i in path] + [token], max_new_tokens, eos, bar))
            continue
        drafts, probs = [], []
        for i in range(gamma):
            if temperature == 0.0:
                drafts.append(int(row.argmax()))
            else:
                probs.append(torch.softmax(row / temperature, dim=-1))
                drafts.append(int(torch.multinomial(probs[-1], 1, generator=generator)))
            if i < gamma - 1:
                row = drafter.forward_tokens(state, torch.tensor([drafts[-1]], device=ids.device), cache)[-1]
        drafted += len(drafts)
        logits, _, cache = _hf.forward(target, torch.tensor([[anchor] + drafts], device=ids.device), cache)
        a, token = _accept(drafts, torch.stack(probs) if probs else None, logits[0], temperature, generator)
        _hf.crop(cache, t + a + 1)
        drafter.crop(state, t + a + 1)                            # its entries for the accepted prefix stay
        rounds.append(a + 1)
        committed.append(_commit(new, drafts[:a] + [token], max_new_tokens, eos, bar))
    return new, _stats(rounds, committed, drafted, new, prefill_s, time.perf_counter() - t1)


def generate(target, drafter, input_ids: torch.Tensor, *, max_new_tokens: int, policy=None,
             attention_mask: torch.Tensor | None = None, eos_token_id=None, temperature: float = 0.0,
             generator: torch.Generator | None = None, progress: bool = False, tree: tuple[int, ...] | None = None,
             gamma: int = 4, **policy_options) -> GenerateResult:
    """Speculative decoding; ``result.sequences`` equals the target's greedy generation.

    Args:
        target: a transformers causal LM with RoPE (Llama, Qwen3, ...), in eval mode.
        drafter: from :func:`fold.spec.load_drafter` for this target: a block drafter (DFlash/DSpark)
            or LongSpec's GLIDE (autoregressive, ``gamma`` drafts per round, reading the target's
            last-layer cache by cross-attention, so ``policy`` does not apply to it).
        input_ids: [batch, prompt_len]; with ``attention_mask`` [batch, prompt_len], padding (left or
            right) is dropped per row.
        max_new_tokens: per sequence.
        policy: how a block drafter reads its context. A name (``fold.spec.policies``): "fold"
            (default), "dflash", "window", "streaming", "yarn", "rerope", "infllm", "cmr"; or your own
            read, as a factory called once per sequence, ``policy(request) -> read`` with ``request``
            = dict(prompt_len, max_new_tokens, block_size, rope). The read is called per drafter layer
            as ``read(q, k, v, layer) -> o`` (``q [1, n_q, Hq, d]`` pre-RoPE, ``k, v [1, L, Hkv, d]``
            pre-RoPE with the block's rows last, row r at position ``L - n_q + r``; ``o [1, n_q, Hq,
            d]``); optionally ``read.sliding(q, k, v, layer, *, sliding_window, causal)`` for a
            sliding-window layer (default: the layer's native read) and ``read.after_verify(target,
            hidden_states, cache, committed, last_row)`` after each verification (as CMR uses it).
            :class:`fold.spec.Read` wraps plain functions. Policy options do not apply to a factory.
        eos_token_id: int or list of ints that stop a sequence (kept in the output).
        temperature: 0 is greedy (lossless: equals the target's greedy output); above 0 the drafts
            are sampled and verified by rejection sampling, so every token follows the target's
            distribution at that temperature.
        generator: a ``torch.Generator`` for reproducible sampling.
        progress: show a progress bar of generated tokens (tqdm).
        tree: ``(k1, k2, ...)`` verifies a token tree instead of a chain: level i keeps the best k_i
            paths by cumulative draft log-probability over the drafter's per-slot candidates, the
            target verifies every node in one forward (``fold.tree_attention`` inside it) and the
            longest path matching its greedy choices is accepted. Greedy only.
        **policy_options: ``window`` (default 2048), ``alpha`` (2.0), ``backend`` ("auto"), ``sinks`` (4),
            ``recent`` (2044), ``reference_len`` (YaRN's R, 4096), ``training_length`` (ReRoPE, 4096),
            ``infllm_block`` (128), ``infllm_init`` (128), ``infllm_topk`` (16), ``infllm_repr`` (4),
            ``cmr_chunk`` (32), ``cmr_top`` (64), ``cmr_every`` (8).

    Returns:
        :class:`GenerateResult`: ``sequences`` [batch, prompt + generated] right-padded with the
        first eos id (or 0); ``tau``, the tokens committed per verification round over all sequences
        (a sequence's last round may commit fewer tokens than it accepted: max_new_tokens or an eos
        cuts it); ``stats["per_sequence"]`` with ``accepted_per_round`` and ``committed_per_round``.

    Every argument is checked before any work; bad input raises ``ValueError``/``TypeError`` naming it.
    """
    eos = _check_common(target, input_ids, attention_mask, max_new_tokens, eos_token_id, temperature, generator)
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {type(progress).__name__}")
    from fold.spec.glide import GlideDrafter

    glide = isinstance(drafter, GlideDrafter)
    if not (glide or isinstance(drafter, Drafter)):
        raise TypeError(f"drafter must come from fold.spec.load_drafter (a block drafter or GLIDE), "
                        f"got {type(drafter).__name__}")
    check_fits(drafter.cfg, target.config, "the drafter does not fit this target (loaded for another?): ")
    if glide:
        if policy not in (None, "dflash") or policy_options:
            raise ValueError("a GLIDE drafter reads the target's cache by cross-attention at true positions; "
                             f"context policies do not apply (got policy={policy!r}, options {sorted(policy_options)})")
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"gamma must be a positive int, got {gamma!r}")
    _hf.check_target(target, tree=tree is not None)           # layer types it can roll back (and tree-verify)
    policy = "fold" if policy is None else policy
    if not (isinstance(policy, str) or callable(policy)):
        raise TypeError(f"policy must be a policy name or a read factory policy(request) -> read, "
                        f"got {type(policy).__name__}")
    if not isinstance(policy, str) and policy_options:
        raise ValueError(f"policy options {sorted(policy_options)} apply to named policies only; "
                         "configure your read factory instead")
    if tree is not None:
        if not (isinstance(tree, (tuple, list)) and tree
                and all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in tree)):
            raise ValueError(f"tree must be a non-empty tuple of positive ints (paths kept per level), got {tree!r}")
        if temperature != 0.0:
            raise ValueError("tree verification is greedy; use temperature=0.0 or a chain (tree=None)")
        if not getattr(target, "_supports_attention_backend", False):
            raise ValueError(f"tree verification runs fold.tree_attention through transformers' AttentionInterface; "
                             f"{type(target).__name__} does not dispatch its attention there, so use a chain "
                             "(tree=None)")
    if not glide and isinstance(policy, str):
        make_read(policy, drafter.cfg.rope, request=dict(prompt_len=1, max_new_tokens=1, block_size=1),
                  **policy_options)                               # bad policy or option: fail before any work
    rows, all_stats = [], []
    label = "glide" if glide else policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")
    bar = _progress_bar(input_ids.shape[0] * max_new_tokens, label) if progress else None
    for b in range(input_ids.shape[0]):
        ids = input_ids[b] if attention_mask is None else input_ids[b][attention_mask[b].bool()]
        if glide:
            new, stats = _generate_one_glide(target, drafter, ids, max_new_tokens, eos, gamma, float(temperature),
                                             generator, bar, None if tree is None else tuple(tree))
            rows.append(torch.cat([ids, torch.tensor(new, dtype=ids.dtype, device=ids.device)]))
            all_stats.append(stats)
            continue
        request = dict(prompt_len=len(ids), max_new_tokens=max_new_tokens, block_size=drafter.cfg.block_size)
        read = _build_read(policy, drafter, request, policy_options)
        new, stats = _generate_one(target, drafter, ids, max_new_tokens, eos, read, float(temperature), generator, bar,
                                   None if tree is None else tuple(tree))
        rows.append(torch.cat([ids, torch.tensor(new, dtype=ids.dtype, device=ids.device)]))
        all_stats.append(stats)
    if bar is not None:
        bar.close()
    return _assemble(rows, all_stats, eos, input_ids)


def _build_read(policy, drafter, request: dict, options: dict):
    """One sequence's read: a named policy's, or the user's factory's (wrapped in :class:`Read` when it
    brings no sliding-layer rule of its own, so those layers keep their native read)."""
    if isinstance(policy, str):
        return make_read(policy, drafter.cfg.rope, request=request, **options)
    read = policy({**request, "rope": drafter.cfg.rope})
    if not callable(read):
        raise TypeError(f"the policy factory must return a callable read(q, k, v, layer), got {type(read).__name__}")
    return read if hasattr(read, "sliding") else Read(read, rope=drafter.cfg.rope)


def _progress_bar(total, desc):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tok")


def _assemble(rows, all_stats, eos, input_ids) -> GenerateResult:
    pad = min(eos) if eos else 0
    width = max(len(r) for r in rows)
    sequences = torch.full((len(rows), width), pad, dtype=input_ids.dtype, device=input_ids.device)
    for b, r in enumerate(rows):
        sequences[b, :len(r)] = r
    committed = sum(sum(s["committed_per_round"]) for s in all_stats)
    n_rounds = sum(s["rounds"] for s in all_stats)
    return GenerateResult(sequences=sequences, tau=committed / max(1, n_rounds), stats=dict(per_sequence=all_stats))


@torch.no_grad()
def autoregressive(target, input_ids: torch.Tensor, *, max_new_tokens: int, attention_mask=None, eos_token_id=None,
                   temperature: float = 0.0, generator: torch.Generator | None = None) -> GenerateResult:
    """The target alone, one token per forward: the baseline TPOT and output of ``generate``.

    Same arguments and result as :func:`generate` (``tau`` is 1, ``stats`` per sequence).
    """
    eos = _check_common(target, input_ids, attention_mask, max_new_tokens, eos_token_id, temperature, generator)
    rows, all_stats = [], []
    for b in range(input_ids.shape[0]):
        ids = input_ids[b] if attention_mask is None else input_ids[b][attention_mask[b].bool()]
        t0 = time.perf_counter()
        logits, _, cache = _hf.forward(target, ids[None])
        new = [_sample(logits[0, -1], temperature, generator)]
        prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        while len(new) < max_new_tokens and new[-1] not in eos:
            logits, _, cache = _hf.forward(target, torch.tensor([[new[-1]]], device=ids.device), cache,
                                           rollback=False)
            new.append(_sample(logits[0, -1], temperature, generator))
        decode_s = time.perf_counter() - t1
        rows.append(torch.cat([ids, torch.tensor(new, dtype=ids.dtype, device=ids.device)]))
        all_stats.append(_stats([1] * (len(new) - 1), [1] * (len(new) - 1), 0, new, prefill_s, decode_s))
    return _assemble(rows, all_stats, eos, input_ids)
