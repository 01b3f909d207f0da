"""How the drafter reads its context: one ``read(q, k, v, layer) -> o`` per policy.

Every read gets the block's pre-RoPE queries ``q [1, n_q, Hq, d]`` and the layer's pre-RoPE cache
``k, v [1, L, Hkv, d]`` whose last ``n_q`` rows are the block (row r at position ``n + r``), and
returns ``o [1, n_q, Hq, d]``.

Built: ``dflash`` (the original drafter: full context, true positions), ``window`` (FOLD's window
``N_p`` alone) and ``fold``. The paper's other baselines (``streaming``, ``yarn``, ``rerope``,
``infllm``, ``cmr``) are not built yet and are refused by name.
"""

from __future__ import annotations

import torch

import fold
from fold._torch_backend import _rotate

BUILT = ("dflash", "window", "fold")
PLANNED = ("streaming", "yarn", "rerope", "infllm", "cmr")


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


def make_read(policy: str, rope: fold.Rope, *, window: int = 2048, alpha: float = 2.0, backend: str = "auto"):
    """The read function of ``policy`` with its options (the paper's defaults: W = 2048, alpha = 2)."""
    if policy == "dflash":
        return lambda q, k, v, layer: fold.attention(q, k, v, window=k.shape[1], rope=rope, alpha=1.0, backend=backend)
    if policy == "fold":
        return lambda q, k, v, layer: fold.attention(q, k, v, window=window, rope=rope, alpha=alpha, backend=backend)
    if policy == "window":
        return lambda q, k, v, layer: window_read(q, k, v, rope=rope, window=window)
    if policy in PLANNED:
        raise ValueError(f"policy {policy!r} is not built yet; built: {BUILT}")
    raise ValueError(f"policy must be one of {BUILT + PLANNED}, got {policy!r}")
