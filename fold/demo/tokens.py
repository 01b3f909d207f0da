"""The demo's tokenizer and what is read off token sequences.

The tokenizer (:func:`train_tokenizer`) is a byte-level BPE trained with Hugging Face ``tokenizers``
on the training split; its pre-tokenizer keeps identifiers and hex words whole (``[A-Za-z0-9_]+``
with an optional leading space), so one token stands for a word piece, not a byte. :func:`encode`
reads text with it or with a transformers tokenizer; :func:`copy_mask` marks the positions of a
token sequence that an induction copy predicts (where copying is the only way to predict).
"""

from __future__ import annotations

from pathlib import Path

MASK_TOKEN = "<|mask|>"
EOS_TOKEN = "<|endoftext|>"
PRE_TOKENIZER_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z0-9_]+| ?[^\sA-Za-z0-9_]+|\s+(?!\S)|\s+"""


def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE (``tokenizers.Tokenizer``) with ``vocab_size`` entries, the last two
    special: ``<|endoftext|>`` and ``<|mask|>`` (the drafter's MASK)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([EOS_TOKEN, MASK_TOKEN])
    return tok


def save_tokenizer(tok, out: Path) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` that ``AutoTokenizer`` reads."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", eos_token=EOS_TOKEN, mask_token=MASK_TOKEN,
        model_max_length=1 << 20, clean_up_tokenization_spaces=False), indent=1))


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` (no special tokens added) with a ``tokenizers.Tokenizer`` or a transformers tokenizer."""
    if hasattr(tokenizer, "encode_batch"):                   # tokenizers.Tokenizer
        return tokenizer.encode(text, add_special_tokens=False).ids
    return tokenizer(text, add_special_tokens=False).input_ids


def fast_tokenizer(tokenizer):
    """The underlying ``tokenizers.Tokenizer`` (offsets, batch encoding)."""
    return tokenizer if hasattr(tokenizer, "encode_batch") else tokenizer.backend_tokenizer


def copy_mask(ids, order: int = 2, max_order: int | None = None):
    """``mask[p]`` is True where token ``p`` follows an earlier occurrence of the ``order`` tokens
    before it and equals the token that followed there: a position an induction copy predicts.
    With ``max_order`` (> ``order``), the earlier occurrence that predicts is the one whose match with
    the tokens before ``p`` is longest (up to ``max_order`` tokens; the latest of equally long ones),
    as a copy of a long span with common pairs of tokens inside it (digits, ``" of the"``) needs;
    by default the latest occurrence of the ``order`` tokens. ``ids`` [B, T] (tensor) -> bool [B, T]."""
    import torch

    max_order = order if max_order is None else max_order
    if max_order < order:
        raise ValueError(f"max_order must be >= order={order}, got {max_order}")
    out = torch.zeros(ids.shape, dtype=torch.bool)
    rows = ids.tolist()
    for b, row in enumerate(rows):
        seen: dict[tuple, list[int]] = {}                    # n-gram -> the positions that followed it
        for p in range(order, len(row)):
            key = tuple(row[p - order:p])
            after = seen.setdefault(key, [])
            if after:
                best, best_len = after[-1], -1
                for j in reversed(after):                    # latest first: a tie keeps the latest
                    k = order
                    while k < max_order and j - k - 1 >= 0 and row[j - k - 1] == row[p - k - 1]:
                        k += 1
                    if k > best_len:
                        best, best_len = j, k
                        if k == max_order:
                            break
                out[b, p] = row[best] == row[p]
            after.append(p)
    return out

