"""FOLD inside vLLM: a DFlash drafter whose attention layers read through fold, greedy, with the
engine's own spec-decode counters.

    python -m examples.serve_vllm --target TARGET --drafter DRAFTER --window 2048 --alpha 2.0

Run it in the vLLM environment (docs/vllm.md). The engine runs with vLLM's defaults (its dtype, its
compiled mode); ``--dtype`` and ``--eager`` change them, ``--backend triton`` reads through fold's
Triton kernels (on a CPU: set ``TRITON_INTERPRET=1``). The drafter directory is not changed:
``fold.vllm.configure`` writes a copy whose config.json carries the ``fold`` block (weights linked).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")     # one process: no __main__ guard needed
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True, help="HF directory of the target")
    ap.add_argument("--drafter", type=Path, required=True, help="z-lab DFlash directory for it")
    ap.add_argument("--read", choices=("fold", "window", "rerope", "stock"), default="fold")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=2.0)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="auto", help="vLLM's dtype (default: its own choice, bfloat16 here)")
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True (default: vLLM's compiled mode)")
    ap.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto",
                    help="fold.attention's backend in the engine (default: Triton on CUDA, torch on a CPU)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args(argv)

    import fold.vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    work = Path(tempfile.mkdtemp(prefix="fold-vllm-"))
    block = {"read": args.read}
    if args.read != "stock":
        block.update(window=args.window, backend=args.backend)
    if args.read == "fold":
        block["alpha"] = args.alpha
    drafter = fold.vllm.configure(args.drafter, work / "drafter-fold", **block, max_model_len=args.max_model_len)

    llm = LLM(model=str(args.target), dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=args.eager,
              skip_tokenizer_init=True, seed=0, disable_log_stats=False,
              speculative_config={"method": "dflash", "model": str(drafter), "num_speculative_tokens": args.k})
    prompts = [list(range(3, 200)), [5 + (7 * i) % 200 for i in range(400)]]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        print(f"prompt of {len(prompt)} tokens -> {list(out.outputs[0].token_ids)}")
    counts = {m.name.removeprefix("vllm:spec_decode_num_"): m.value for m in llm.get_metrics()
              if m.name.startswith("vllm:spec_decode_num_") and not m.name.endswith("per_pos")}
    drafts = counts.get("drafts", 0)
    print(f"read={args.read}: {drafts} drafts, {counts.get('accepted_tokens', 0)} draft tokens accepted, "
          f"acceptance length {1 + counts.get('accepted_tokens', 0) / max(drafts, 1):.2f}")


if __name__ == "__main__":
    main()
