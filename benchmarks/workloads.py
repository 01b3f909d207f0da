"""Drafter-shaped FOLD reads and the providers they are timed against: the workloads every benchmark,
the autotune sweep (``tuning``), the checks in ``tools/`` and ``examples/fold_vs_attention.py`` time.

:data:`DRAFTERS` names the drafter shapes (:class:`DrafterShape`). One setup (:func:`make_inputs`)
serves every provider, so each reads the same cache:

- ``fold_triton``, ``fold_torch``: ``fold.attention`` on either backend;
- ``reference``: the reference (``reference/``: dense, float64-capable; small lengths only);
- ``sdpa_full``: one ``scaled_dot_product_attention`` read of the whole rotated cache (GQA), what the
  original drafter pays;
- ``flash_full``: ``flash_attn_with_kvcache`` over the whole rotated cache (GPU, flash-attn);
- ``flash_paper_layout``: the paper's implementation: a second, unrotated side cache, one flash-attn
  call per branch (the window with a local window over the rotated cache, the far memory over the
  side cache at the shared position) and an LSE merge (GPU, flash-attn). Approximates the far set
  as ``j <= n - D`` for every row, which is what two plain flash calls can express; its time, not
  its output, is what is compared.
- ``torch_flash_full``, ``torch_flash_paper_layout``: the same two baselines through torch's own
  CUDA flash kernel (GQA packed), for GPUs without flash-attn.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import fold


@dataclass(frozen=True)
class DrafterShape:
    name: str
    n_q: int
    heads_q: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    window: int = 2048
    rope_theta: float = 500000.0
    rotary_dim: int | None = None       # partial RoPE; default head_dim


DRAFTERS = {
    "llama3.1-8b": DrafterShape("llama3.1-8b", n_q=10, window=2048),
    "qwen3-8b-b7": DrafterShape("qwen3-8b-b7", n_q=7, window=2048, rope_theta=1000000.0),
    "qwen3-8b-b8": DrafterShape("qwen3-8b-b8", n_q=8, window=2048, rope_theta=1000000.0),
    "qwen3.5-9b": DrafterShape("qwen3.5-9b", n_q=16, window=4096, rope_theta=10000000.0),
}


def _rotate(x, positions, rope):
    # x [L, H, d] -> R_pos x (fold's one RoPE: float64 angles, computed in float32, cast back)
    return fold.rope.rotate(x.transpose(0, 1), positions.to(x.device), rope).transpose(0, 1)


def make_inputs(shape: DrafterShape, length: int, *, batch: int = 1, dtype=torch.bfloat16, device="cpu",
                keys_rotated: bool = False, alpha: float = 2.0, seed: int = 0) -> dict:
    """Everything a provider needs for one read of ``length`` entries.

    Keys: ``q`` [B, n_q, Hq, d] pre-RoPE, ``k`` (the cache in the chosen layout), ``v``,
    ``k_rot``/``q_rot`` (true positions), ``k_side`` (unrotated keys, the paper's side cache), ``rope``,
    ``window``, ``alpha``, ``keys_rotated``.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    rope = fold.Rope.from_theta(shape.rope_theta, shape.head_dim, rotary_dim=shape.rotary_dim)
    q = torch.randn(batch, shape.n_q, shape.heads_q, shape.head_dim, generator=g).to(device, dtype)
    k = torch.randn(batch, length, shape.heads_kv, shape.head_dim, generator=g).to(device, dtype)
    v = torch.randn(batch, length, shape.heads_kv, shape.head_dim, generator=g).to(device, dtype)
    k_rot = torch.stack([_rotate(kb, torch.arange(length), rope) for kb in k])
    q_rot = torch.stack([_rotate(qb, torch.arange(length - shape.n_q, length), rope) for qb in q])
    return dict(q=q, k=k_rot if keys_rotated else k, v=v, k_rot=k_rot, q_rot=q_rot, k_side=k, rope=rope,
                window=shape.window, alpha=alpha, keys_rotated=keys_rotated)


def fold_call(inputs: dict, backend: str):
    return lambda: fold.attention(inputs["q"], inputs["k"], inputs["v"], window=inputs["window"], rope=inputs["rope"],
                                  alpha=inputs["alpha"], keys_rotated=inputs["keys_rotated"], backend=backend)


def reference_call(inputs: dict):
    from reference import fold_attention_ref

    return lambda: fold_attention_ref(inputs["q"], inputs["k"], inputs["v"], window=inputs["window"],
                                      rope=inputs["rope"], alpha=inputs["alpha"],
                                      keys_rotated=inputs["keys_rotated"], upcast=False)


def sdpa_full_call(inputs: dict):
    """SDPA with ``enable_gqa``: reads each KV head once per query head (group times)."""
    q, k, v = (inputs[n].transpose(1, 2) for n in ("q_rot", "k_rot", "v"))
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def sdpa_packed_call(inputs: dict):
    """The fair plain read: the GQA group packed into the query axis (``[B, Hkv, n_q * group, d]``), so
    each KV head is read once, as a DFlash engine (and fold's torch path) reads it."""
    k, v = inputs["k_rot"].transpose(1, 2), inputs["v"].transpose(1, 2)
    q = _pack_gqa(inputs["q_rot"], k.shape[1])
    return lambda: F.scaled_dot_product_attention(q, k, v)


def flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def flash_full_call(inputs: dict):
    from flash_attn import flash_attn_with_kvcache

    return lambda: flash_attn_with_kvcache(inputs["q_rot"], inputs["k_rot"], inputs["v"], causal=False)


def flash_paper_layout_call(inputs: dict):
    """Two flash-attn reads (window over the rotated cache, far memory over the side cache) + merge."""
    from flash_attn import flash_attn_with_kvcache

    q, k_rot, k_side, v = inputs["q"], inputs["k_rot"], inputs["k_side"], inputs["v"]
    n_q, length, window, alpha = q.shape[1], k_rot.shape[1], inputs["window"], inputs["alpha"]
    n = length - n_q
    d_pos = window + n_q
    far_len = max(0, n - d_pos + 1)
    q_win = inputs["q_rot"]
    q_far = _rotate(q[0], torch.arange(d_pos, d_pos + n_q), inputs["rope"])[None]
    scale = q.shape[-1] ** -0.5

    def run():
        o_w, lse_w = flash_attn_with_kvcache(q_win, k_rot, v, window_size=(d_pos - 1, n_q - 1),
                                             return_softmax_lse=True)
        if far_len == 0:
            return o_w
        o_f, lse_f = flash_attn_with_kvcache(q_far, k_side[:, :far_len], v[:, :far_len], softmax_scale=alpha * scale,
                                             return_softmax_lse=True)
        out, _ = fold.merge_states([o_w, o_f], [lse_w.transpose(1, 2), lse_f.transpose(1, 2) / alpha])
        return out

    return run


def _pack_gqa(x, heads_kv):
    # [B, n_q, Hq, d] -> [B, Hkv, n_q * group, d]: rows (r, h) of one KV head, read without a mask
    batch, n_q, heads_q, head_dim = x.shape
    group = heads_q // heads_kv
    return x.view(batch, n_q, heads_kv, group, head_dim).transpose(1, 2).reshape(batch, heads_kv, n_q * group, head_dim)


def _torch_flash(q, k, v, scale):
    # CUDA flash kernel through torch, returning the LSE; k, v [B, L, Hkv, d] read in place
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return out[0], out[1]


def torch_flash_full_call(inputs: dict):
    """The full read with torch's CUDA flash kernel, GQA packed (each KV head read once)."""
    k, v = inputs["k_rot"], inputs["v"]
    q = _pack_gqa(inputs["q_rot"], k.shape[2])
    scale = q.shape[-1] ** -0.5
    return lambda: _torch_flash(q, k, v, scale)[0]


def torch_flash_paper_layout_call(inputs: dict):
    """The paper's layout with torch's CUDA flash kernel: the window slice of the rotated cache and
    the far slice of the side cache, two reads, one merge (rows share the far boundary ``j <= n - D``)."""
    q, k_rot, k_side, v = inputs["q"], inputs["k_rot"], inputs["k_side"], inputs["v"]
    heads_kv, n_q, length = k_rot.shape[2], q.shape[1], k_rot.shape[1]
    d_pos = inputs["window"] + n_q
    far_len = max(0, length - n_q - d_pos + 1)
    q_win = _pack_gqa(inputs["q_rot"], heads_kv)
    q_far = _pack_gqa(torch.stack([_rotate(qb, torch.arange(d_pos, d_pos + n_q), inputs["rope"]) for qb in q]),
                      heads_kv)
    scale, alpha = q.shape[-1] ** -0.5, inputs["alpha"]

    def run():
        o_w, lse_w = _torch_flash(q_win, k_rot[:, far_len:], v[:, far_len:], scale)
        if far_len == 0:
            return o_w
        o_f, lse_f = _torch_flash(q_far, k_side[:, :far_len], v[:, :far_len], alpha * scale)
        return fold.merge_states([o_w, o_f], [lse_w, lse_f / alpha])[0]

    return run


PROVIDERS = {
    "fold_triton": lambda inputs: fold_call(inputs, "triton"),
    "fold_torch": lambda inputs: fold_call(inputs, "torch"),
    "reference": reference_call,
    "sdpa_packed": sdpa_packed_call,
    "sdpa_full": sdpa_full_call,
    "flash_full": flash_full_call,
    "flash_paper_layout": flash_paper_layout_call,
    "torch_flash_full": torch_flash_full_call,
    "torch_flash_paper_layout": torch_flash_paper_layout_call,
}


def timed_rows(fns: dict, repeats: int, sync=lambda: None) -> dict:
    """Median and (min, max) wall seconds of each function, alternated (ABC ABC ...) after a warm-up
    call each, so every row sees the same machine state."""
    for fn in fns.values():
        fn()
    sync()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(t), min(t), max(t)) for name, t in times.items()}
