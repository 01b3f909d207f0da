"""How the drafter reads its context: one ``read(q, k, v, layer) -> o`` per policy.

Every read gets the block's pre-RoPE queries ``q [1, n_q, Hq, d]`` and the layer's pre-RoPE cache
``k, v [1, L, Hkv, d]`` whose last ``n_q`` rows are the block (row r at true position ``n + r``),
and returns ``o [1, n_q, Hq, d]``. Settings follow the FOLD paper's Appendix B.3:

- ``dflash``: the original drafter, every entry at its true position (context keys rotated once and kept,
  as an engine caches them: :class:`CachedPlainRead`).
- ``window``: FOLD's window ``N_p`` alone (row r sees ``j > n + r - D``), one softmax.
- ``fold``: ``fold.attention`` (window ``W``, far memory at the shared position, ``alpha``); while a
  sequence fits in the window it runs the plain read (length dispatch).
- ``streaming``: StreamingLLM, the first 4 entries and the 2,044 most recent, renumbered
  consecutively, the block after them.
- ``yarn``: every entry at its true position under YaRN frequencies with the per-request factor
  ``s = max(1, ceil((P + G + Q) / 256) * 256 / R)`` on top of the drafter's own ``inv_freq``.
- ``rerope``: FOLD's window at true distances, every older entry at distance ``D`` from every row,
  one softmax, queries scaled by ``max(1, log(p + 1) / log(4096))``.

- ``infllm``, ``cmr``: the retrieval baselines (``fold.spec.retrieval``), stateful per sequence.
"""

from __future__ import annotations

import math

import torch

import fold
from fold._torch_backend import _rotate, fold_attention_torch
from fold.spec.retrieval import CMRRead, InfLLMRead

BUILT = ("dflash", "window", "fold", "streaming", "yarn", "rerope", "infllm", "cmr")
PLANNED: tuple[str, ...] = ()


def plain_read(q, k, v, rope, backend="auto"):
    """Every entry at its true position: FOLD with a window covering the whole cache."""
    return fold.attention(q, k, v, window=k.shape[1], rope=rope, alpha=1.0, backend=backend)


class CachedPlainRead:
    """Every entry at its true position, run as a DFlash engine runs it: each context key is rotated
    once, the first time it is read, and kept; only the block's rows are rotated every round. Same
    math as :func:`plain_read`. Stateful: one per sequence (the context only grows)."""

    def __init__(self, rope: fold.Rope):
        self.rope = rope
        self.rotated: dict[int, torch.Tensor] = {}      # layer -> [Hkv, capacity, d] rotated keys
        self.count: dict[int, int] = {}                 # layer -> context entries rotated so far

    def _rotate(self, x, start, work):
        # x [T, Hkv, d] at positions start .. start + T - 1 -> [Hkv, T, d]; angles in float64
        pos = torch.arange(start, start + x.shape[0], device=x.device, dtype=torch.float64)
        inv_freq = self.rope.inv_freq_on(x.device).double()
        return _rotate(x.transpose(0, 1).to(work), pos, inv_freq, self.rope.rotary_dim, self.rope.interleaved,
                       self.rope.attention_factor)

    def __call__(self, q, k, v, layer):
        _, n_q, heads_q, head_dim = q.shape
        n = k.shape[1] - n_q
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        done = self.count.get(layer, 0)
        buf = self.rotated.get(layer)
        if buf is None or done > n or buf.shape[1] < n or buf.dtype != work:
            done, buf = 0, torch.empty(k.shape[2], max(2 * n, 1024), head_dim, dtype=work, device=k.device)
        if n > done:
            buf[:, done:n] = self._rotate(k[0, done:n], done, work)
        self.rotated[layer], self.count[layer] = buf, n
        keys = torch.cat([buf[:, :n], self._rotate(k[0, n:], n, work)], dim=1)               # [Hkv, L, d]
        qs = self._rotate(q[0], n, work)                                                    # [Hq, n_q, d]
        values = v[0].transpose(0, 1).to(work)                                              # [Hkv, L, d]
        o = torch.nn.functional.scaled_dot_product_attention(qs[None], keys[None], values[None],
                                                             scale=head_dim ** -0.5, enable_gqa=True)
        return o[0].transpose(0, 1)[None].to(q.dtype)


def window_read(q, k, v, *, rope, window, softmax_scale=None):
    """FOLD without its far memory: row r sees ``j > n + r - D`` at true distances, one softmax."""
    _, n_q, heads_q, head_dim = q.shape
    length, heads_kv = k.shape[1], k.shape[2]
    n, d_pos = length - n_q, window + n_q
    lo = max(0, n - d_pos + 1)
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    inv_freq = rope.inv_freq_on(q.device).to(work)
    f = rope.attention_factor
    j = torch.arange(lo, length, device=q.device)
    r = torch.arange(n_q, device=q.device)
    # positions relative to the block start n: only differences matter
    ks = _rotate(k[0, lo:].transpose(0, 1).to(work), j - n, inv_freq, rope.rotary_dim, rope.interleaved, f)
    qs = _rotate(q[0].transpose(0, 1).to(work), r, inv_freq, rope.rotary_dim, rope.interleaved, f)
    group = heads_q // heads_kv
    s = torch.einsum("hrd,hjd->hrj", qs, ks.repeat_interleave(group, 0)) * scale          # [Hq, n_q, L']
    s = s.masked_fill(~(j[None, :] > (n + r - d_pos)[:, None]), float("-inf"))
    o = torch.softmax(s, dim=-1) @ v[0, lo:].transpose(0, 1).to(work).repeat_interleave(group, 0)
    return o.transpose(0, 1)[None].to(q.dtype)


def streaming_read(q, k, v, *, rope, sinks=4, recent=2044, backend="auto"):
    """StreamingLLM: sinks and recent entries renumbered consecutively (pre-RoPE cache), block after."""
    n = k.shape[1] - q.shape[1]
    if n <= sinks + recent:
        return plain_read(q, k, v, rope, backend)
    keep = torch.cat([torch.arange(sinks), torch.arange(n - recent, k.shape[1])]).to(k.device)
    return plain_read(q, k[:, keep], v[:, keep], rope, backend)


def yarn_factor(prompt_len: int, max_new_tokens: int, block_size: int, reference_len: int) -> float:
    """The paper's per-request factor ``max(1, ceil((P + G + Q) / 256) * 256 / R)``."""
    return max(1.0, math.ceil((prompt_len + max_new_tokens + block_size) / 256) * 256 / reference_len)


def yarn_rope(rope: fold.Rope, factor: float, reference_len: int, theta: float, beta_fast=32.0, beta_slow=1.0):
    """YaRN (transformers' ramp over dimension index) applied on top of ``rope``'s own inv_freq."""
    if factor <= 1.0:
        return rope
    dim = rope.rotary_dim

    def correction_dim(rotations):
        return dim * math.log(reference_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = rope.inv_freq / factor * (1 - extrapolate) + rope.inv_freq * extrapolate
    mscale = 0.1 * math.log(factor) + 1.0
    return fold.Rope(inv_freq, rotary_dim=dim, interleaved=rope.interleaved,
                     attention_factor=rope.attention_factor * mscale)


def rerope_read(q, k, v, *, rope, window, training_length=4096):
    """ReRoPE as the paper adapts it: window at true distances, older entries at distance D, one softmax."""
    n_q = q.shape[1]
    n = k.shape[1] - n_q
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    p = torch.arange(n, n + n_q, device=q.device, dtype=torch.float64)                  # true positions
    q_scale = (torch.log(p + 1) / math.log(training_length)).clamp(min=1.0).to(work)     # [n_q]
    q = (q.to(work) * q_scale[None, :, None, None]).to(q.dtype)
    out, _ = fold_attention_torch(q, k, v, rope.inv_freq_on(q.device), None, window=window, alpha=1.0,
                                  softmax_scale=q.shape[-1] ** -0.5, rotary_dim=rope.rotary_dim,
                                  interleaved=rope.interleaved, attention_factor=rope.attention_factor,
                                  keys_rotated=False, return_lse=False, far_distance_per_row=False)
    return out


def make_read(policy: str, rope: fold.Rope, *, request: dict, window: int = 2048, alpha: float = 2.0,
              backend: str = "auto", sinks: int = 4, recent: int = 2044, reference_len: int = 4096,
              rope_theta: float | None = None, training_length: int = 4096, infllm_block: int = 128,
              infllm_init: int = 128, infllm_topk: int = 16, infllm_repr: int = 4, cmr_chunk: int = 32,
              cmr_top: int = 64, cmr_every: int = 8):
    """The read of ``policy``; ``request`` = dict(prompt_len, max_new_tokens, block_size) for YaRN."""
    if policy == "dflash":
        return CachedPlainRead(rope)
    if policy == "fold":
        short = CachedPlainRead(rope)

        def read(q, k, v, layer):
            if k.shape[1] - q.shape[1] <= window:          # length dispatch: nothing is far yet
                return short(q, k, v, layer)
            return fold.attention(q, k, v, window=window, rope=rope, alpha=alpha, backend=backend)
        return read
    if policy == "window":
        return lambda q, k, v, layer: window_read(q, k, v, rope=rope, window=window)
    if policy == "streaming":
        return lambda q, k, v, layer: streaming_read(q, k, v, rope=rope, sinks=sinks, recent=recent, backend=backend)
    if policy == "yarn":
        factor = yarn_factor(request["prompt_len"], request["max_new_tokens"], request["block_size"], reference_len)
        if rope_theta is None and rope.inv_freq.numel() < 2:
            raise ValueError("yarn needs rope_theta=... for a rotary_dim of 2 (it cannot be read off inv_freq)")
        # inv_freq[i] = theta ** (-2i / rotary_dim), so theta = inv_freq[1] ** (-rotary_dim / 2)
        theta = rope_theta if rope_theta is not None else float(rope.inv_freq[1]) ** (-rope.rotary_dim / 2)
        return CachedPlainRead(yarn_rope(rope, factor, reference_len, theta))
    if policy == "rerope":
        return lambda q, k, v, layer: rerope_read(q, k, v, rope=rope, window=window, training_length=training_length)
    if policy == "infllm":
        return InfLLMRead(rope, window=window, block=infllm_block, init=infllm_init, topk=infllm_topk,
                          repr_topk=infllm_repr)
    if policy == "cmr":
        return CMRRead(rope, chunk=cmr_chunk, top=cmr_top, every=cmr_every, backend=backend)
    if policy in PLANNED:
        raise ValueError(f"policy {policy!r} is not built yet; built: {BUILT}")
    raise ValueError(f"policy must be one of {BUILT + PLANNED}, got {policy!r}")
