"""Speculative decoding of a local target + drafter pair with one context policy.

    python -m examples.generate --target ~/models/Llama-3.1-8B-Instruct \\
        --drafter ~/models/LLaMA3.1-8B-Instruct-DFlash --policy fold --prompt-file long_prompt.txt

    # the shipped demo pair (its BPE tokenizer lives in the target directory)
    python -m examples.generate --target fold/demo/artifacts/target --drafter fold/demo/artifacts/drafter \\
        --prompt-file fold/spec_decode/generate.py --dtype float32 --compare-ar

Both directories are read offline (``config.json`` + safetensors; the target's tokenizer from its
directory, or bytes with ``--tokenizer bytes``, the default for a target directory without
tokenizer files).
Prints the generated text, τ, and with ``--compare-ar`` the speedup over the target alone and
whether the outputs are identical (they must be at temperature 0).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# options each policy takes from the command line (the rest keep their defaults); its keys are
# fold.spec_decode.POLICIES (a test checks), written out so that a usage error needs no torch import
POLICY_OPTIONS = {"fold": ("window", "alpha"), "window": ("window",), "rerope": ("window",), "infllm": ("window",),
                  "streaming": (), "dflash": (), "yarn": (), "cmr": ()}


class ByteTokenizer:
    """Token i is byte i (a byte-level target); ids >= 256 (special tokens) decode to nothing."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: Path):
        import transformers

        self.tok = transformers.AutoTokenizer.from_pretrained(path)
        self.eos_token_id = self.tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tok(text).input_ids

    def decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def _argtype(name: str, *args, **kwargs):
    """``fold.argtypes.<name>(*args, **kwargs)``, imported when a value is parsed: a usage error is
    printed before torch (which ``fold`` imports) is loaded."""
    def parse(text: str):
        from fold import argtypes

        return getattr(argtypes, name)(*args, **kwargs)(text)
    return parse


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="a transformers causal-LM directory")
    parser.add_argument("--drafter", type=Path, required=True, help="a drafter directory (spec_decode.load_drafter)")
    parser.add_argument("--policy", choices=sorted(POLICY_OPTIONS), default="fold")
    parser.add_argument("--prompt-file", type=Path, required=True)
    parser.add_argument("--max-new-tokens", type=_argtype("at_least", 1), default=256)
    parser.add_argument("--window", type=_argtype("at_least", 0), default=2048,
                        help="W of fold/window/rerope/infllm (0: no context at exact positions)")
    parser.add_argument("--alpha", type=float, default=2.0, help="fold's alpha, in [1, 1e4]")
    parser.add_argument("--temperature", type=_argtype("at_least", 0, kind=float), default=0.0)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--tokenizer", choices=["auto", "hf", "bytes"], default="auto",
                        help="hf: the target directory's tokenizer; bytes: token i is byte i; "
                             "auto: hf when the target directory has tokenizer files, else bytes")
    parser.add_argument("--compare-ar", action="store_true", help="also run the target alone and compare")
    args = parser.parse_args(argv)
    for name in ("target", "drafter"):
        if not (getattr(args, name) / "config.json").is_file():
            parser.error(f"--{name} {getattr(args, name)} is not a model directory (no config.json)")
    if not args.prompt_file.is_file():
        parser.error(f"--prompt-file {args.prompt_file} does not exist")
    if not args.prompt_file.read_text().strip():
        parser.error(f"--prompt-file {args.prompt_file} is empty")
    has_tokenizer = any((args.target / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                              "tokenizer.model"))
    if args.tokenizer == "auto":
        args.tokenizer = "hf" if has_tokenizer else "bytes"
    if args.tokenizer == "hf" and not has_tokenizer:
        parser.error(f"--target {args.target} has no tokenizer files; pass --tokenizer bytes for a byte-level model")
    return args


def main(argv=None):
    args = parse_args(argv)                      # before any heavy import: a usage error is immediate
    import torch
    import transformers

    import fold.demo  # noqa: F401  (registers the demo's fold_toy target with transformers)
    from fold import spec_decode
    from fold.spec_decode.loading import check_target_dir

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:                                        # a bad pair, file or option: one line naming it, no traceback
        check_target_dir(args.target)           # a drafter passed as the target: refused before any weights load
        tokenizer = ByteTokenizer() if args.tokenizer == "bytes" else HFTokenizer(args.target)
        target = transformers.AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype))
        target = target.to(device).eval()
        drafter = spec_decode.load_drafter(args.drafter, target)
        spec_decode.make_read(args.policy, drafter.cfg.rope, request=dict(prompt_len=1, max_new_tokens=1, block_size=1),
                       **{name: getattr(args, name) for name in POLICY_OPTIONS[args.policy]})
    except (ValueError, TypeError, OSError) as exc:
        print(f"generate.py: error: {exc}", file=sys.stderr)
        return 2
    ids = torch.tensor([tokenizer.encode(args.prompt_file.read_text())], device=device)
    print(f"prompt: {ids.shape[1]} tokens; drafter block {drafter.cfg.block_size}, taps {drafter.cfg.target_layer_ids}")
    options = {name: getattr(args, name) for name in POLICY_OPTIONS[args.policy]}
    result = spec_decode.generate(target, drafter, ids, max_new_tokens=args.max_new_tokens, policy=args.policy,
                           eos_token_id=tokenizer.eos_token_id, temperature=args.temperature, progress=True,
                           **options)
    print(tokenizer.decode(result.sequences[0, ids.shape[1]:].tolist()))
    stats = result.stats["per_sequence"][0]
    print(f"\npolicy {args.policy}: tau {result.tau:.2f} over {stats['rounds']} rounds, "
          f"TPOT {stats['tpot_s'] * 1e3:.1f} ms")
    if args.compare_ar:
        ar = spec_decode.autoregressive(target, ids, max_new_tokens=args.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                 temperature=args.temperature)
        same = torch.equal(ar.sequences, result.sequences)
        print(f"AR TPOT {ar.stats['per_sequence'][0]['tpot_s'] * 1e3:.1f} ms; speedup "
              f"{spec_decode.per_sequence_speedup(result, ar)[0]:.2f}x; identical output: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
