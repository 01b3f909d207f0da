"""``spec_decode.generate``: speculative decoding of a transformers target with a drafter.

One loop (:func:`_decode`) runs every kind of decoding; a proposer drafts, the target verifies::

    logits, hidden = session.prefill(prompt)                  # or a copy of a shared one (Prefills)
    proposer.start(session, prompt, hidden)                   # the drafter's context
    while not done:
        draft = proposer.draft(session, new)                  # chain or tree; nothing for plain decoding
        post  = session.verify([anchor] + draft)              # one target forward verifies all
        a     = longest prefix with draft[i] == post[i]       # greedy (rejection sampling above T = 0)
        commit draft[:a] + [post[a]];  session.commit(a + 1)  # or keep a tree's accepted path
        proposer.accept(session, verified rows)               # features in / drafter cache cropped

Proposers: :class:`BlockProposer` (DFlash/DSpark, chain or tree), :class:`GlideProposer` (LongSpec,
chain or beam tree) and :class:`Plain` (the AR baseline, nothing drafted). Greedy acceptance
commits only tokens the target itself picks, so the output equals the target's own greedy
generation (lossless); at temperature > 0 rejection sampling keeps the target's distribution.
Batch rows run one after another, each with its own :class:`fold.spec_decode.TargetSession`.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field

import torch

from fold.checks import check_bool, check_choice, check_float, check_int, is_int
from fold.spec_decode.drafter import Drafter
from fold.spec_decode.glide import GlideDrafter, glide_tree
from fold.spec_decode.loading import check_fits
from fold.spec_decode.policies import Read, make_read
from fold.spec_decode.session import Prefills, TargetSession
from fold.spec_decode.target import TargetFacts, check_target, dispatches_attention
from fold.spec_decode.tree import build_tree, verify_tree


@dataclass
class GenerateResult:
    sequences: torch.Tensor          # [batch, prompt + generated], right-padded after a stop
    tau: float                       # tokens committed per verification round, the target's included
    stats: dict = field(default_factory=dict)


def _check_common(target, input_ids, attention_mask, max_new_tokens, eos_token_id, temperature, generator) -> set[int]:
    """Arguments ``generate`` and ``autoregressive`` share, checked before any work; returns the eos set."""
    if not (isinstance(target, torch.nn.Module) and hasattr(target, "config")):
        raise TypeError(f"target must be a transformers causal LM (a torch.nn.Module with .config), "
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
    check_int("max_new_tokens", max_new_tokens, 1, expected="a positive int")
    check_float("temperature", temperature, 0, expected="a finite number >= 0 (0 is greedy)")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if eos_token_id is None:
        return set()
    ids = [eos_token_id] if is_int(eos_token_id) else eos_token_id
    if not isinstance(ids, (list, tuple, set, frozenset)) or not all(is_int(i) for i in ids):
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


def accept(drafts, draft_probs, target_logits, temperature, generator):
    """How many drafts to keep and the target's token after them.

    Greedy: the longest prefix equal to the target's argmax, then the target's argmax. Sampling:
    standard rejection sampling, keep x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first
    rejection draw from max(p_i - q_i, 0) renormalised; if all are kept, draw the bonus from p_n.
    ``target_logits``: ``[n + 1, V]``, a tensor or :class:`fold.spec_decode.session.LogitRows`; rows are read in order and
    only up to the first rejection.
    """
    if temperature == 0.0:
        a = 0
        while a < len(drafts) and drafts[a] == int(target_logits[a].argmax()):
            a += 1
        return a, int(target_logits[a].argmax())
    for i, x in enumerate(drafts):
        p = torch.softmax(target_logits[i].float() / temperature, dim=-1)
        u = torch.rand((), generator=generator, device=p.device)
        if u * draft_probs[i, x] < p[x]:
            continue
        residual = (p - draft_probs[i]).clamp(min=0)
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    p = torch.softmax(target_logits[len(drafts)].float() / temperature, dim=-1)
    return len(drafts), int(torch.multinomial(p, 1, generator=generator))


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


@dataclass
class Draft:
    """One round's proposal: a chain ``tokens`` (with the distributions ``probs [n, V]`` they were
    sampled from, None when greedy), or with ``parents``/``depths`` a tree whose node 0 is the anchor."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    parents: list[int] | None = None
    depths: list[int] | None = None

    @property
    def size(self) -> int:
        return len(self.tokens) - (self.parents is not None)


@dataclass
class Verified:
    """What the target kept of a round: ``tokens`` (accepted drafts + the target's own), the rows of
    the verification (``rows``, a slice or indices; anchor first) that are now committed entries, and
    the verification's ``hidden_states``."""

    tokens: list[int]
    rows: object
    last_row: int
    hidden_states: tuple


def _verify(session: TargetSession, anchor: int, draft: Draft, temperature, generator):
    """The target's half of a round: one forward over the anchor and the draft (a plain decoding step
    when nothing is drafted), acceptance, and the accepted entries committed."""
    if draft.parents is not None:
        path, token, kept, hidden_states = verify_tree(session, draft.tokens, draft.parents, draft.depths)
        return Verified([draft.tokens[i] for i in path] + [token], kept, kept[-1], hidden_states)
    if not draft.tokens:
        logits, hidden_states = session.decode(anchor)
        return Verified([_sample(logits, temperature, generator)], slice(0, 1), 0, hidden_states)
    rows, hidden_states = session.verify([anchor] + draft.tokens)
    a, token = accept(draft.tokens, draft.probs, rows, temperature, generator)
    session.commit(a + 1)                                     # anchor + accepted drafts stay
    return Verified(draft.tokens[:a] + [token], slice(0, a + 1), a, hidden_states)


@torch.no_grad()
def _decode(session, proposer, ids: torch.Tensor, max_new_tokens: int, eos: set[int], temperature: float,
            generator, bar=None):
    """One sequence, every kind of drafting: prefill, then rounds of draft -> verify -> accept ->
    commit -> roll back until ``max_new_tokens`` or an eos. ``proposer`` drafts (``start``, ``draft``)
    and takes the verified rows into its own context (``accept``); plain decoding drafts nothing."""
    t0 = time.perf_counter()
    logits, hidden_states = session.prefill(ids)
    proposer.start(session, ids, hidden_states)
    new = [_sample(logits, temperature, generator)]
    prefill_s = time.perf_counter() - t0
    rounds, committed, drafted = [], [], 0
    t1 = time.perf_counter()
    while len(new) < max_new_tokens and new[-1] not in eos:
        draft = proposer.draft(session, new)
        verified = _verify(session, new[-1], draft, temperature, generator)
        proposer.accept(session, verified)
        drafted += draft.size
        rounds.append(len(verified.tokens))
        committed.append(_commit(new, verified.tokens, max_new_tokens, eos, bar))
    return new, _stats(rounds, committed, drafted, new, prefill_s, time.perf_counter() - t1)


class Plain:
    """Plain autoregressive decoding: no drafts, one target forward per token, nothing recorded."""

    def start(self, session, ids, hidden_states) -> None:
        pass

    def draft(self, session, new) -> Draft:
        return Draft([])

    def accept(self, session, verified) -> None:
        pass


class BlockProposer:
    """A block drafter (DFlash/DSpark): its context holds the target features of every committed
    entry; ``tree`` drafts a token tree from the per-slot candidates instead of a chain."""

    def __init__(self, drafter: Drafter, read, max_new_tokens: int, temperature: float, generator, tree=None,
                 draft_len: int | None = None, cutoff: float = 0.0, tail: str = "full"):
        self.drafter, self.read, self.max_new_tokens, self.tree = drafter, read, max_new_tokens, tree
        self.temperature, self.generator = temperature, generator
        self.draft_len, self.cutoff, self.tail = draft_len, cutoff, tail

    def start(self, session, ids, hidden_states) -> None:
        d = self.drafter
        self.state = d.new_state(len(ids) + self.max_new_tokens, ids.device, d.fc.weight.dtype)
        d.append_context(self.state, d.features(hidden_states))

    def draft(self, session, new) -> Draft:
        d, anchor = self._block(new), new[-1]
        if self.tree is None:
            return Draft(*d.draft(self.state, anchor, self.read, self.temperature, self.generator,
                                  max_drafts=self.draft_len, cutoff=self.cutoff))
        markov = d.markov_bias if d.cfg.markov_rank else None
        if d.candidate_selector is not None:                  # DFlash 2: children rescored given their parent
            tokens, parents, depths = d.selector_tree(self.state, anchor, self.read, self.tree)
        else:
            tokens, parents, depths = build_tree(d.slot_logits(self.state, anchor, self.read), self.tree, anchor,
                                                 markov)
        return Draft(tokens, None, parents, depths)

    def _block(self, new) -> Drafter:
        """The drafter; with ``tail="shrink"``, in the last rounds the same drafter with a block of only
        the slots the tokens still to generate need (upstream DFlash's rule: ``[anchor, MASK x (left - 1)]``
        for a z-lab drafter, ``left`` rows when every slot drafts)."""
        cfg = self.drafter.cfg
        rows = min(cfg.block_size, self.max_new_tokens - len(new) + (not cfg.sample_from_anchor))
        if self.tail == "full" or rows == cfg.block_size:
            return self.drafter
        shorter = copy.copy(self.drafter)                      # shares every module and buffer
        shorter.cfg = dataclasses.replace(cfg, block_size=rows)
        return shorter

    def accept(self, session, verified: Verified) -> None:
        self.drafter.append_context(self.state, self.drafter.features(verified.hidden_states)[:, verified.rows])
        if hasattr(self.read, "after_verify"):                # target-side retrieval (CMR)
            self.read.after_verify(session.target, verified.hidden_states, session.cache, self.state.length,
                                   verified.last_row)


class GlideProposer:
    """LongSpec's GLIDE: a chain of ``gamma`` drafts, or a beam ``tree``, drafted autoregressively
    while reading the target's last-layer cache; the tokens it lacks are fed at the next round."""

    def __init__(self, drafter, gamma: int, max_new_tokens: int, temperature: float, generator, tree=None,
                 cutoff: float = 0.0):
        self.drafter, self.gamma, self.max_new_tokens, self.tree = drafter, gamma, max_new_tokens, tree
        self.temperature, self.generator, self.cutoff = temperature, generator, cutoff

    def start(self, session, ids, hidden_states) -> None:
        self.prompt = ids.tolist()
        self.state = self.drafter.new_state(len(ids) + self.max_new_tokens + self.gamma + 1)
        self.drafter.forward_tokens(self.state, ids, session.cache)

    def draft(self, session, new) -> Draft:
        anchor, t, device = new[-1], session.length, session.device     # the anchor's position
        feed = torch.tensor((self.prompt + new)[self.state.length:t + 1], device=device)   # tokens it lacks
        row = self.drafter.forward_tokens(self.state, feed, session.cache)[-1]
        if self.tree is not None:
            tokens, parents, depths, _ = glide_tree(self.drafter, self.state, row, anchor, self.tree, session.cache)
            return Draft(tokens, None, parents, depths)
        drafts, probs = [], []
        for i in range(self.gamma):
            dist = torch.softmax(row / (self.temperature or 1.0), dim=-1) if self.cutoff or self.temperature else None
            if self.cutoff and float(dist.max()) < self.cutoff:
                break                                 # see Drafter.draft: the rule never looks at a drawn token
            if self.temperature == 0.0:
                drafts.append(int(row.argmax()))
            else:
                probs.append(dist)
                drafts.append(int(torch.multinomial(dist, 1, generator=self.generator)))
            if i < self.gamma - 1:
                row = self.drafter.forward_tokens(self.state, torch.tensor([drafts[-1]], device=device),
                                                  session.cache)[-1]
        return Draft(drafts, torch.stack(probs) if probs else None)

    def accept(self, session, verified: Verified) -> None:
        # a chain keeps its entries for the accepted prefix; a tree's go (the accepted ones are re-fed)
        self.drafter.crop(self.state, session.length - (len(verified.tokens) - 1 if self.tree is not None else 0))


def generate(target, drafter, input_ids: torch.Tensor, *, max_new_tokens: int, policy=None,
             attention_mask: torch.Tensor | None = None, eos_token_id=None, temperature: float = 0.0,
             generator: torch.Generator | None = None, progress: bool = False, tree: tuple[int, ...] | None = None,
             gamma: int = 4, prefill: Prefills | None = None, draft_len: int | None = None,
             draft_cutoff: float = 0.0, tail: str = "full", **policy_options) -> GenerateResult:
    """Speculative decoding; ``result.sequences`` equals the target's greedy generation.

    Args:
        target: a transformers causal LM with RoPE (Llama, Qwen3, ...), in eval mode.
        drafter: from :func:`fold.spec_decode.load_drafter` for this target: a block drafter (DFlash/DSpark)
            or LongSpec's GLIDE (autoregressive, ``gamma`` drafts per round, reading the target's
            last-layer cache by cross-attention, so ``policy`` does not apply to it).
        input_ids: [batch, prompt_len]; with ``attention_mask`` [batch, prompt_len], padding (left or
            right) is dropped per row.
        max_new_tokens: per sequence.
        policy: how a block drafter reads its context. A name (``fold.spec_decode.policies``): "fold"
            (default), "dflash", "window", "streaming", "yarn", "rerope", "infllm", "cmr"; or your own
            read, as a factory called once per sequence, ``policy(request) -> read`` with ``request``
            = dict(prompt_len, max_new_tokens, block_size, rope). The read is called per drafter layer
            as ``read(q, k, v, layer) -> o`` (``q [1, n_q, Hq, d]`` pre-RoPE, ``k, v [1, L, Hkv, d]``
            pre-RoPE with the block's rows last, row r at position ``L - n_q + r``; ``o [1, n_q, Hq,
            d]``); optionally ``read.sliding(q, k, v, layer, *, sliding_window, causal)`` for a
            sliding-window layer (default: the layer's native read) and ``read.after_verify(target,
            hidden_states, cache, committed, last_row)`` after each verification (as CMR uses it).
            :class:`fold.spec_decode.Read` wraps plain functions. Policy options do not apply to a factory.
        eos_token_id: int or list of ints that stop a sequence (kept in the output).
        temperature: 0 is greedy (lossless: equals the target's greedy output); above 0 the drafts
            are sampled and verified by rejection sampling, so every token follows the target's
            distribution at that temperature.
        generator: a ``torch.Generator`` for reproducible sampling.
        progress: show a progress bar of generated tokens (tqdm).
        tree: ``(k1, k2, ...)`` verifies a token tree instead of a chain: level i keeps the best k_i
            paths by cumulative draft log-probability over the drafter's per-slot candidates (a DFlash 2
            drafter's: each node's ``top_k`` children rescored given its token by the selector), the
            target verifies every node in one forward (``fold.tree_attention`` inside it) and the
            longest path matching its greedy choices is accepted. Greedy only.
        prefill: a :class:`fold.spec_decode.Prefills` for ``target``: every prompt it has seen starts from a
            copy of that prompt's cache instead of a new forward (share one across the runs that
            compare policies or drafters on the same prompts).
        draft_len: a block drafter verifies at most this many drafts per round (default: every slot of
            its block; GLIDE's is ``gamma``). Chains only.
        draft_cutoff: in [0, 1): a chain ends before the first slot whose draft distribution's top
            probability is under it (0, the default, never ends one early); a round whose first slot is
            unsure verifies the anchor alone, a plain decoding step. Where a verification's cost grows
            with its length (a CPU) this trades unlikely drafts for time. Lossless: greedy output is
            unchanged, and at temperature > 0 the rule never looks at a drawn token. Chains only.
        tail: a block drafter's last rounds, where fewer tokens are left than its block drafts.
            ``"full"`` (default): the whole block is drafted and verified, and only the tokens left are
            committed. ``"shrink"``: the block holds only the slots still needed (``[anchor, MASK x
            (left - 1)]``, upstream DFlash's ``dflash_generate``), so the verification is shorter too;
            the block attends bidirectionally, so its drafts can differ from the full block's. Either
            is lossless (docs/spec_decode.md has the cost of each).
        **policy_options: ``window`` (default 2048), ``alpha`` (2.0), ``backend`` ("auto"), ``far_budget``
            (None: ``fold`` reads every far entry; an int N: its far branch reads at most ``N // far_page``
            pages, chosen per sequence and KV head by per-page key bounds the drafter's cache keeps as it
            grows, on full and sliding-window layers alike; ``fold`` only; N must hold the pages a block straddles, ``N // far_page >= ceil((block_size - 1) / far_page) + 1``;
            with N at least the far memory's size the drafts equal ``fold``'s without a budget),
            ``far_page`` (64, entries per far page), ``far_rank`` ("bound": pages ranked by their key
            bounds; "keys": by their keys' far logits, ``fold.attention``'s), ``sinks`` (4),
            ``recent`` (2044), ``reference_len`` (YaRN's R, 4096), ``rope_theta`` (YaRN's base, None:
            read off the drafter's inv_freq), ``training_length`` (ReRoPE, 4096), ``infllm_block`` (128),
            ``infllm_init`` (128), ``infllm_topk`` (16), ``infllm_repr`` (4), ``cmr_chunk`` (32),
            ``cmr_top`` (64), ``cmr_every`` (8); each policy's rules: ``fold.spec_decode.policies.POLICIES``.

    Returns:
        :class:`GenerateResult`: ``sequences`` [batch, prompt + generated] right-padded with the
        first eos id (or 0); ``tau``, the tokens committed per verification round over all sequences
        (a sequence's last round may commit fewer tokens than it accepted: max_new_tokens or an eos
        cuts it); ``stats["per_sequence"]`` with ``accepted_per_round`` and ``committed_per_round``.

    Every argument is checked before any work; bad input raises ``ValueError``/``TypeError`` naming it.
    """
    eos = _check_common(target, input_ids, attention_mask, max_new_tokens, eos_token_id, temperature, generator)
    _check_prefill(prefill, target)
    check_bool("progress", progress)
    glide = _check_drafting(target, drafter, policy, policy_options, tree, temperature, gamma)
    _check_chain_options(draft_len, draft_cutoff, tree, glide)
    _check_tail(tail, glide)
    policy = "fold" if policy is None else policy
    label = "glide" if glide else policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")
    bar = _progress_bar(input_ids.shape[0] * max_new_tokens, label) if progress else None
    tree = None if tree is None else tuple(tree)

    def proposer(ids):
        if glide:
            return GlideProposer(drafter, gamma, max_new_tokens, float(temperature), generator, tree,
                                 float(draft_cutoff))
        request = dict(prompt_len=len(ids), max_new_tokens=max_new_tokens, block_size=drafter.cfg.block_size)
        read = _build_read(policy, drafter, request, policy_options)
        return BlockProposer(drafter, read, max_new_tokens, float(temperature), generator, tree, draft_len,
                             float(draft_cutoff), tail)
    result = _run_rows(target, proposer, input_ids, attention_mask, max_new_tokens, eos, temperature, generator,
                       bar, prefill)
    if bar is not None:
        bar.close()
    return result


def _check_drafting(target, drafter, policy, policy_options, tree, temperature, gamma) -> bool:
    """``generate``'s drafter, policy and tree arguments, checked before any work; True for GLIDE."""
    glide = isinstance(drafter, GlideDrafter)
    if not (glide or isinstance(drafter, Drafter)):
        raise TypeError(f"drafter must come from fold.spec_decode.load_drafter (a block drafter or GLIDE), "
                        f"got {type(drafter).__name__}")
    check_fits(drafter.cfg, target.config, "the drafter does not fit this target (loaded for another?): ")
    if glide:
        if policy not in (None, "dflash") or policy_options:
            raise ValueError("a GLIDE drafter reads the target's cache by cross-attention at true positions; "
                             f"context policies do not apply (got policy={policy!r}, options {sorted(policy_options)})")
        check_int("gamma", gamma, 1, expected="a positive int")
    check_target(target, tree=tree is not None)               # layer types it can roll back (and tree-verify)
    policy = "fold" if policy is None else policy
    if not (isinstance(policy, str) or callable(policy)):
        raise TypeError(f"policy must be a policy name or a read factory policy(request) -> read, "
                        f"got {type(policy).__name__}")
    if not isinstance(policy, str) and policy_options:
        raise ValueError(f"policy options {sorted(policy_options)} apply to named policies only; "
                         "configure your read factory instead")
    if tree is not None:
        if not (isinstance(tree, (tuple, list)) and tree
                and all(is_int(k) and k >= 1 for k in tree)):
            raise ValueError(f"tree must be a non-empty tuple of positive ints (paths kept per level), got {tree!r}")
        if temperature != 0.0:
            raise ValueError("tree verification is greedy; use temperature=0.0 or a chain (tree=None)")
        if not dispatches_attention(target):
            raise ValueError(f"tree verification runs fold.tree_attention through transformers' AttentionInterface; "
                             f"{type(target).__name__} does not dispatch its attention there, so use a chain "
                             "(tree=None)")
    if not glide and isinstance(policy, str):
        make_read(policy, drafter.cfg.rope, request=dict(prompt_len=1, max_new_tokens=1,
                                                         block_size=drafter.cfg.block_size),
                  **policy_options)                               # bad policy or option: fail before any work
    return glide


def _check_chain_options(draft_len, draft_cutoff, tree, glide) -> None:
    """``draft_len`` and ``draft_cutoff``, checked before any work."""
    if check_int("draft_len", draft_len, 1, none_ok=True,
                 expected="a positive int or None (every slot of the block)") is not None and glide:
        raise ValueError("draft_len is a block drafter's; a GLIDE drafter drafts gamma tokens per round")
    check_float("draft_cutoff", draft_cutoff, 0, 1, open_high=True,
                expected="a number in [0, 1) (a draft distribution's top probability)")
    if tree is not None and (draft_len is not None or draft_cutoff):
        raise ValueError("draft_len and draft_cutoff shape a chain; a tree's shape is its tree=(k1, k2, ...)")


TAILS = ("full", "shrink")


def _check_tail(tail, glide) -> None:
    """``tail``, checked before any work."""
    check_choice("tail", tail, TAILS)
    if glide and tail != "full":
        raise ValueError("tail='shrink' shapes a block drafter's block; a GLIDE drafter drafts gamma tokens one at a "
                         "time (use tail='full')")


def _run_rows(target, proposer, input_ids, attention_mask, max_new_tokens, eos, temperature, generator, bar,
              prefill) -> GenerateResult:
    """Every batch row through :func:`_decode`, one after another, each with its own session (the
    target's facts probed once for them all)."""
    rows, all_stats = [], []
    facts = prefill.facts if prefill is not None else TargetFacts.probe(target)
    for b in range(input_ids.shape[0]):
        ids = input_ids[b] if attention_mask is None else input_ids[b][attention_mask[b].bool()]
        session = TargetSession(target, prefill, facts)
        new, stats = _decode(session, proposer(ids), ids, max_new_tokens, eos, float(temperature), generator, bar)
        rows.append(torch.cat([ids, torch.tensor(new, dtype=ids.dtype, device=ids.device)]))
        all_stats.append(stats)
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


def autoregressive(target, input_ids: torch.Tensor, *, max_new_tokens: int, attention_mask=None, eos_token_id=None,
                   temperature: float = 0.0, generator: torch.Generator | None = None,
                   prefill: Prefills | None = None) -> GenerateResult:
    """The target alone, one token per forward: the baseline TPOT and output of ``generate``.

    Same arguments and result as :func:`generate` (``tau`` is 1, ``stats`` per sequence); it is the
    same loop with nothing drafted.
    """
    eos = _check_common(target, input_ids, attention_mask, max_new_tokens, eos_token_id, temperature, generator)
    _check_prefill(prefill, target)
    return _run_rows(target, lambda ids: Plain(), input_ids, attention_mask, max_new_tokens, eos, temperature,
                     generator, None, prefill)


def _check_prefill(prefill, target) -> None:
    if prefill is not None and not (isinstance(prefill, Prefills) and prefill.target is target):
        raise ValueError(f"prefill must be a fold.spec_decode.Prefills made for this target (Prefills(target)), "
                         f"got {prefill!r}")
