"""Speculative decoding of a local target + drafter pair with one context policy.

    python examples/generate.py --target ~/models/Llama-3.1-8B-Instruct \\
        --drafter ~/models/LLaMA3.1-8B-Instruct-DFlash --policy fold --prompt-file long_prompt.txt

Both directories are read offline (``config.json`` + safetensors; the target's tokenizer from its
directory). Prints the generated text, τ, and with ``--compare-ar`` the speedup over the target alone
and whether the outputs are identical (they must be at temperature 0).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from fold import spec
from fold.spec.policies import BUILT


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--drafter", type=Path, required=True)
    parser.add_argument("--policy", choices=BUILT, default="fold")
    parser.add_argument("--prompt-file", type=Path, required=True)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--alpha", type=float, default=2.0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--compare-ar", action="store_true", help="also run the target alone and compare")
    args = parser.parse_args(argv)

    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.target)
    target = transformers.AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype)).to(device)
    target.eval()
    drafter = spec.load_drafter(args.drafter, target)
    ids = tokenizer(args.prompt_file.read_text(), return_tensors="pt").input_ids.to(device)
    print(f"prompt: {ids.shape[1]} tokens; drafter block {drafter.cfg.block_size}, taps {drafter.cfg.target_layer_ids}")
    options = dict(window=args.window, alpha=args.alpha) if args.policy in ("fold", "window", "rerope") else {}
    result = spec.generate(target, drafter, ids, max_new_tokens=args.max_new_tokens, policy=args.policy,
                           eos_token_id=tokenizer.eos_token_id, temperature=args.temperature, progress=True,
                           **options)
    print(tokenizer.decode(result.sequences[0, ids.shape[1]:], skip_special_tokens=True))
    stats = result.stats["per_sequence"][0]
    print(f"\npolicy {args.policy}: tau {result.tau:.2f} over {stats['rounds']} rounds, "
          f"TPOT {stats['tpot_s'] * 1e3:.1f} ms")
    if args.compare_ar:
        ar = spec.autoregressive(target, ids, max_new_tokens=args.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                 temperature=args.temperature)
        same = torch.equal(ar.sequences, result.sequences)
        print(f"AR TPOT {ar.stats['per_sequence'][0]['tpot_s'] * 1e3:.1f} ms; speedup "
              f"{spec.per_sequence_speedup(result, ar)[0]:.2f}x; identical output: {same}")


if __name__ == "__main__":
    main()
