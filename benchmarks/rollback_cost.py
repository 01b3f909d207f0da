"""What rolling back the target's cache costs per verification round: ``python -m benchmarks.rollback_cost``.

Builds a random Qwen3.5-shaped target (Gated DeltaNet + full attention) and a Gemma-4-shaped one
(sliding + full attention) from configs, at the widths of the paper's targets but with few layers,
and times one verification round of ``--block`` tokens with its rollback: the verification forward,
the state copy ``TargetSession.verify`` makes before it, and the rollback ``TargetSession.commit``
after it, for an all-rejected round (the longest replay: the anchor alone is kept) and a
half-accepted one. Prints
bytes per layer and milliseconds, and the per-sequence copy for the full-size models.
"""

from __future__ import annotations

import argparse
import time

import torch

from fold.spec_decode.rollback import copy_linear_states
from fold.spec_decode.session import TargetSession


def _qwen35(layers: int):
    import transformers

    # Qwen3.5-9B's text widths (families.md): hidden 4096, head_dim 256, GDN 16 key / 32 value heads of 128, kernel 4
    return transformers.AutoConfig.for_model(
        "qwen3_5_text", vocab_size=4096, hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        layer_types=["linear_attention"] * (layers - 1) + ["full_attention"])


def _gemma4(layers: int, window: int):
    import transformers

    return transformers.AutoConfig.for_model(
        "gemma4_text", vocab_size=4096, hidden_size=3840, intermediate_size=7680, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=4096, sliding_window=window,
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"])


def _ms(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


@torch.no_grad()
def measure(config, *, prompt: int, block: int, repeats: int, dtype):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    ids = torch.randint(0, config.vocab_size, (1, prompt))
    verify = torch.randint(0, config.vocab_size, (1, block))
    rows = {}
    for kept in (1, block // 2, block):
        def round_trip(kept=kept):
            session = TargetSession(model)
            session.prefill(ids[0])
            t0 = time.perf_counter()
            session.verify(verify[0])
            t1 = time.perf_counter()
            session.commit(kept)
            t2 = time.perf_counter()
            return t1 - t0, t2 - t1, session.cache
        times = [round_trip() for _ in range(repeats)]
        rows[kept] = (1e3 * min(t[0] for t in times), 1e3 * min(t[1] for t in times))
        cache = times[-1][2]
    snapshot = copy_linear_states(cache)
    copy_bytes = sum(c.numel() * c.element_size() + r.numel() * r.element_size() for c, r in snapshot.values())
    copy_ms = _ms(lambda: copy_linear_states(cache), repeats)
    return rows, copy_bytes, len(snapshot), copy_ms


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (the last one full attention)")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--block", type=int, default=16, help="tokens verified per round")
    parser.add_argument("--window", type=int, default=128, help="Gemma-4 sliding window of the measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, prompt {args.prompt}, "
          f"block {args.block}, {args.layers} layers")
    for name, config in (("qwen3_5", _qwen35(args.layers)), ("gemma4", _gemma4(args.layers, args.window))):
        rows, copy_bytes, n_linear, copy_ms = measure(config, prompt=args.prompt, block=args.block,
                                                      repeats=args.repeats, dtype=dtype)
        for kept, (verify_ms, crop_ms) in rows.items():
            print(f"{name}: verify forward {verify_ms:8.1f} ms, rollback keeping {kept:2d} of {args.block}: "
                  f"{crop_ms:7.2f} ms ({100 * crop_ms / verify_ms:.1f}% of the forward)")
        if n_linear:
            per_layer = copy_bytes / n_linear
            print(f"{name}: state copy before each verification: {per_layer / 2**20:.2f} MiB per linear layer, "
                  f"{copy_ms:.2f} ms for {n_linear} layers; Qwen3.5-9B (24 linear layers): "
                  f"{24 * per_layer / 2**20:.1f} MiB per sequence")


if __name__ == "__main__":
    main()
