"""An induction-style initialisation of a 2-layer z-lab DFlash drafter for a ``fold_toy`` target with a
context channel: a copy circuit, built in closed form from the target's layout.

A block slot ``k`` (position ``t + k``) drafts the token at ``t + k``. When the text repeats an
earlier span, that token is ``x_{i+k}`` where ``x_{i-m} = x_{t-m}``: the entry ``j = i + k`` whose
tokens at lags ``d = k, k+1, ...`` equal the tokens at lags ``d`` of the slot's own position. The
circuit finds ``j`` by content alone, so FOLD's far memory (every old entry at one shared position)
keeps it and a read that drops old entries loses it.

The target's hidden states end with a context channel (``FoldToyConfig.channel_lags``): a
constant 1, the code of the entry's token and the codes of the ``L`` tokens before it. Its
embedding rows hold the constant and the token's code too, so context rows (``c_j``) and block
rows (embeddings) share that layout:

- ``fc`` passes the first tapped layer through (``c_j = norm(h_j)``).
- Layer 0, query head ``h``: reads the row at distance ``d = h + 1`` from each slot by position
  (RoPE phases in the fast frequencies against the constant) and writes that row's token code into
  residual slice ``R_d``. For a slot ``k`` the row at distance ``d >= k`` is a context entry or the
  anchor; for ``d < k`` it is a MASK row, which takes the attention as a sink (its key sits in the
  slow frequencies, its value is zero), so ``R_d`` stays empty. The MLP removes the MASK embedding
  from a MASK row's residual.
- Layer 1: every query is ``sum_d M_d R_d``, every context key ``sum_d M_d code(x_{j-d})`` (``M_d``
  random orthonormal, in the slow frequencies, which hardly rotate within the training length);
  MASK rows are the sink when a slot knows nothing. The value is the entry's own code; the output
  projection maps a code to its token's logits through the target's LM head (least squares).

Training then starts from a drafter that copies, and learns the rest (text that is not a copy).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch


def _pair(p: int, head_dim: int):
    return [p, p + head_dim // 2]


def _unit_rms(w):
    return w / w.pow(2).mean().sqrt()


# with these amplitudes on the 8 fastest pairs (theta 1e6, head_dim 64), a row at any other
# distance up to 8K scores at most 0.83 of the peak (``examples/drafter_init.py`` docstring)
AMPLITUDES = (3.0, 2.0, 1.5, 1.0, 1.0, 1.0, 1.0, 1.0)


def _geometry(drafter, target_config, seed: int) -> SimpleNamespace:
    """What both layers of the copy circuit are built from: the target's channel layout (``code``: the
    dims holding the token ``lag`` rows back, ``resid``: the main dims a layer-0 head writes), the
    fast and slow RoPE pairs, and the MASK row's direction in layer 0's input (``on_mask``, ``not_mask``)."""
    cfg, tc = drafter.cfg, target_config
    if cfg.logit_softcap is not None:
        raise ValueError("the copy circuit fits a linear LM head; this drafter soft-caps its logits")
    hidden, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.heads_q, cfg.heads_kv
    lags, width, base = tc.channel_lags, tc.channel_width, tc.write_dims
    if not lags:
        raise ValueError("the copy circuit needs a target with a context channel (channel_lags > 0)")
    if cfg.num_layers != 2 or hq < lags:
        raise ValueError(f"the copy circuit needs 2 layers and >= {lags} query heads, got {cfg.num_layers}, {hq}")
    const = base                                                            # residual dim of the constant 1
    code = {lag: torch.arange(base + 1 + lag * width, base + 1 + (lag + 1) * width) for lag in range(lags + 1)}
    resid = {dist: torch.arange((dist - 1) * width, dist * width) for dist in range(1, lags + 1)}   # main dims
    fast = len(AMPLITUDES)
    inv_freq = cfg.rope.inv_freq_on(torch.device("cpu")).double()
    slow = [p for p in range(d // 2) if float(inv_freq[p]) * 2048 < 2.5]   # nearly unrotated within the training range
    if len(slow) < 8 or fast > min(slow):
        raise ValueError(f"head_dim {d} with this rope_theta leaves {len(slow)} slow frequency pairs")
    slow_dims = torch.tensor([i for p in slow for i in _pair(p, d)])
    gen = torch.Generator().manual_seed(seed)
    n_taps = len(cfg.target_layer_ids)
    fc = torch.zeros(hidden, n_taps * hidden, dtype=torch.float64)
    fc[:, :hidden] = torch.eye(hidden, dtype=torch.float64)
    drafter.fc.weight.copy_(fc)
    drafter.hidden_norm.weight.fill_(1.0)
    l0, l1 = drafter.layers
    for norm in (l0.input_layernorm, l1.input_layernorm, l0.post_attention_layernorm, l1.post_attention_layernorm,
                 drafter.norm):
        norm.weight.fill_(1.0)
    e_mask = drafter.embed(torch.tensor([cfg.mask_token_id])).double()[0]
    x_mask = l0.input_layernorm(e_mask.float()[None]).double()[0]            # a MASK row's layer-0 input
    on_mask = x_mask / x_mask.dot(x_mask)                                    # <on_mask, x_mask> = 1
    not_mask = torch.eye(hidden, dtype=torch.float64) - torch.outer(x_mask, on_mask)

    return SimpleNamespace(**{k: v for k, v in locals().items() if k not in ("drafter", "target_config", "seed")})


def _layer0(g: SimpleNamespace, scale0: float, sink_level: float) -> None:
    """Layer 0: head ``h`` reads the row ``h + 1`` back (its fast pairs phase-aligned to that distance, a
    sink in the slow pairs), writing that row's token code into the main dims; the MLP removes the MASK
    embedding from a MASK row."""
    hidden, d, hq, hkv, lags, width = g.hidden, g.d, g.hq, g.hkv, g.lags, g.width
    code, resid, fast, inv_freq, slow, l0 = g.code, g.resid, g.fast, g.inv_freq, g.slow, g.l0
    e_mask, x_mask, on_mask, not_mask, const = g.e_mask, g.x_mask, g.on_mask, g.not_mask, g.const
    a = l0.self_attn
    kf = torch.zeros(d, dtype=torch.float64)
    kf[:fast] = 1.0
    ks = torch.zeros(d, dtype=torch.float64)
    ks[slow] = 1.0
    kf, ks = _unit_rms(kf), _unit_rms(ks)
    amp = torch.tensor(AMPLITUDES, dtype=torch.float64)
    peak = float(amp @ kf[:fast])                                            # q . R_dist kf with the phases aligned
    rows = []
    for h in range(hq):
        dist = h + 1
        q = torch.zeros(d, dtype=torch.float64)
        if dist <= lags:
            for p in range(fast):
                i, j = _pair(p, d)
                phase = -dist * float(inv_freq[p])
                q[i], q[j] = amp[p] * math.cos(phase), amp[p] * math.sin(phase)
        sink = torch.zeros(d, dtype=torch.float64)
        sink[slow] = 1.0
        rows.append(_unit_rms(q + sink / float(sink @ ks) * sink_level * peak))
    a.q_proj.weight.copy_(torch.stack(rows).reshape(hq * d, 1) @ on_mask[None])        # a MASK row -> its query
    read_const = torch.zeros(hidden, dtype=torch.float64)
    read_const[const] = 1.0 / float(x_mask[const])                          # the constant as a row's input holds it
    # every row's key is kf (the constant); a MASK row's is ks instead
    k = kf[:, None] @ (read_const - read_const.dot(x_mask) * on_mask)[None] + ks[:, None] @ on_mask[None]
    a.k_proj.weight.copy_(k.repeat(hkv, 1))
    a.q_norm.weight.fill_(math.sqrt(scale0))
    a.k_norm.weight.fill_(math.sqrt(scale0))
    v = torch.zeros(d, hidden, dtype=torch.float64)
    v[torch.arange(width), code[0]] = 1.0
    a.v_proj.weight.copy_((v @ not_mask).repeat(hkv, 1))
    o = torch.zeros(hidden, hq * d, dtype=torch.float64)
    for h in range(min(hq, lags)):
        o[resid[h + 1], h * d + torch.arange(width)] = 1.0
    a.o_proj.weight.copy_(o)
    mlp = l0.mlp                                    # one unit: minus the MASK embedding on a MASK row
    for w in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight):
        w.zero_()
    beta = 8.0
    mlp.gate_proj.weight[0] = beta * on_mask
    mlp.up_proj.weight[0] = on_mask
    mlp.down_proj.weight[:, 0] = -e_mask / (beta * torch.sigmoid(torch.tensor(beta, dtype=torch.float64)))


def _layer1(drafter, g: SimpleNamespace, samples, scale1: float, copy_gain: float) -> dict:
    """Layer 1: every head matches a query's main dims against the entries' token codes in the slow
    pairs (a random orthogonal mix per distance) and returns the matched feature, mapped to its
    token's logits by a least-squares fit through the LM head. Returns the fit's decode accuracy."""
    hidden, d, hq, hkv, lags, width = g.hidden, g.d, g.hq, g.hkv, g.lags, g.width
    code, resid, fast, slow, slow_dims, gen, l1 = g.code, g.resid, g.fast, g.slow, g.slow_dims, g.gen, g.l1
    on_mask, not_mask = g.on_mask, g.not_mask
    b = l1.self_attn
    mixers = {dist: torch.linalg.qr(torch.randn(len(slow_dims), width, generator=gen, dtype=torch.float64))[0]
              for dist in range(1, lags + 1)}
    fast0 = torch.zeros(d, dtype=torch.float64)
    fast0[0] = 1.0
    qw = torch.zeros(d, hidden, dtype=torch.float64)
    kw = torch.zeros(d, hidden, dtype=torch.float64)
    for dist, m in mixers.items():
        qw[slow_dims[:, None], resid[dist][None, :]] += m
        kw[slow_dims[:, None], code[dist][None, :]] += m
    qw = qw + 0.5 * fast0[:, None] @ on_mask[None]           # a query with no content looks at the sink
    kw = kw @ not_mask + 3.0 * fast0[:, None] @ on_mask[None]  # MASK rows: the sink
    b.q_proj.weight.copy_(qw.repeat(hq, 1))
    b.k_proj.weight.copy_(kw.repeat(hkv, 1))
    b.q_norm.weight.fill_(math.sqrt(scale1))
    b.k_norm.weight.fill_(math.sqrt(scale1))
    # values: kv head g carries dims [g * d, (g + 1) * d) of the entry's feature (with GQA every group
    # attends alike), so the heads together return the whole matched feature; the output projection is
    # the least-squares map from a feature to its token's logits through the target's LM head
    full = torch.zeros(hkv * d, hidden, dtype=torch.float64)
    n_val = min(hkv * d, hidden)
    full[torch.arange(n_val), torch.arange(n_val)] = 1.0
    full = full @ not_mask                                                   # [hkv * d, H]
    b.v_proj.weight.copy_(full)
    lm = drafter.head(torch.eye(hidden, dtype=drafter.fc.weight.dtype)).double().T   # [V, H]: logits of unit rows
    taps, tokens = samples
    feats = drafter.hidden_norm(drafter.fc(taps.to(drafter.fc.weight.dtype))).double()      # [N, H]: c_j
    vals = feats @ full.T                                                    # [N, hkv * d]: what the heads return
    gram = vals.T @ vals
    gram += 1e-4 * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=torch.float64)
    target = torch.zeros(lm.shape[0], vals.shape[1], dtype=torch.float64).index_add_(0, tokens, vals)
    target -= vals.sum(0, keepdim=True) / lm.shape[0]                        # one-hot targets, centred
    out = torch.linalg.pinv(lm) @ torch.linalg.solve(gram, target.T).T       # [H, hkv * d]
    out = out / out.norm() * copy_gain * math.sqrt(hidden)
    group = hq // hkv
    ow = torch.zeros(hidden, hq * d, dtype=torch.float64)
    for h in range(hq):
        g = h // group
        ow[:, h * d:(h + 1) * d] = out[:, g * d:(g + 1) * d] / group
    b.o_proj.weight.copy_(ow)
    for w in (l1.mlp.gate_proj.weight, l1.mlp.up_proj.weight):
        torch.nn.init.normal_(w, std=0.02, generator=gen)
    l1.mlp.down_proj.weight.zero_()
    decode = (vals @ out.T @ lm.T).argmax(1) == tokens
    return dict(copy_decode_accuracy=round(float(decode.double().mean()), 4), slow_pairs=len(slow), fast_pairs=fast)


@torch.no_grad()
def copy_circuit_init(drafter, target_config, samples, *, scale0: float = 14.0, scale1: float = 4.0, sink_level: float = 0.88,
                      copy_gain: float = 3.0, seed: int = 0) -> dict:
    """Build the copy circuit into ``drafter`` (2 layers, qwen3 style) for a target with a context channel.

    ``samples = (features [N, H], tokens [N])``: context features ``c_j`` (``drafter``'s fc and norm
    applied after this init sets them, i.e. the normed first tap) and their tokens, to fit the output."""
    g = _geometry(drafter, target_config, seed)
    _layer0(g, scale0, sink_level)
    return _layer1(drafter, g, samples, scale1, copy_gain)
