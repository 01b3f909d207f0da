"""The embedded demo: a tiny target with a BPE tokenizer and its drafters, trained on this kind of machine.

``TARGET_DIR`` is a transformers directory (``model_type = "fold_toy"``, registered on import) with
its ``tokenizer.json``; ``DRAFTER_DIR`` and ``ANCHOR_DRAFTER_DIR`` are z-lab DFlash directories for
it (the second trained with LongSpec's anchor-offset position indices). Load them the way real
checkpoints load::

    import fold.demo, transformers
    from fold import spec_decode
    target = transformers.AutoModelForCausalLM.from_pretrained(fold.demo.TARGET_DIR).float().eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(fold.demo.TARGET_DIR)
    drafter = spec_decode.load_drafter(fold.demo.DRAFTER_DIR, target)
"""

from pathlib import Path

from fold.demo.model import FoldToyConfig, FoldToyForCausalLM, register

ARTIFACTS = Path(__file__).parent / "artifacts"
TARGET_DIR = ARTIFACTS / "target"
DRAFTER_DIR = ARTIFACTS / "drafter"
ANCHOR_DRAFTER_DIR = ARTIFACTS / "drafter_anchor"

register()

__all__ = ["ARTIFACTS", "TARGET_DIR", "DRAFTER_DIR", "ANCHOR_DRAFTER_DIR", "FoldToyConfig", "FoldToyForCausalLM",
           "register"]
