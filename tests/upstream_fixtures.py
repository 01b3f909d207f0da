"""z-lab's reference loop (``dflash==0.1.0``: ``dflash_generate``) beside ``fold.spec_decode``, observed round by round.

Upstream is installed with ``pip install --no-deps dflash==0.1.0`` (its declared pins cannot resolve beside
ours). The tests that need it skip without it, except under ``CI=true`` (``.ci/run``), where its absence fails.
Nothing here changes upstream: its rounds are read off the target's forward calls (a forward pre-hook), and
its CUDA-only timer is replaced by the test that asks for stats (``monkeypatch``).
"""

import importlib
import os
import time

import pytest
import torch

from fold import spec_decode
from tests.spec_decode_fixtures import make_dflash2, make_drafter

# The drafters both loops are compared on. A kind is "<family>-<layers>": a family writes a checkpoint
# (``make(path, target, base, config_overrides)``; DFlash 2 with a seed whose random drafts are accepted
# often enough to compare acceptance) on one of three layer layouts (``make_drafter``'s base format and
# config fields): full attention; a causal sliding layer (window DRAFTER_WINDOW) before a full one; the
# same sliding layer bidirectional. A new drafter family is one entry in FAMILIES.
FAMILIES = {
    "dflash": lambda path, target, base, overrides: make_drafter(path, target, base, config_overrides=overrides),
    "dflash2": lambda path, target, base, overrides: make_dflash2(path, target, base=base, seed=4,
                                                                  config_overrides=overrides),
}
LAYERS = {"full": ("zlab", {}), "causal-sliding": ("zlab-swa", {}),
          "bidirectional-sliding": ("zlab-swa", {"is_causal": False})}
KINDS = [f"{family}-{layers}" for family in FAMILIES for layers in LAYERS]
# upstream's DFlash2DraftModel.from_pretrained maps the checkpoint's bare codebooks to ``<name>.weight``
UPSTREAM_NAMES = {f"candidate_selector.{n}.weight": f"candidate_selector.{n}"
                  for n in ("predecessor_codebook", "successor_codebook")}


def make_kind(kind: str, path, target, **config_overrides):
    """The checkpoint of ``kind`` (one of :data:`KINDS`) written under ``path``, ``config_overrides`` on top."""
    family, layers = kind.split("-", 1)
    base, overrides = LAYERS[layers]
    return FAMILIES[family](path, target, base, {**overrides, **config_overrides})


def checkpoint_state(drafter) -> dict:
    """An upstream drafter's ``state_dict`` under the checkpoint's tensor names."""
    return {UPSTREAM_NAMES.get(name, name): t for name, t in drafter.state_dict().items()}


def import_upstream():
    """``dflash.model``; skips the calling test module without it, fails it under ``CI=true``."""
    try:
        return importlib.import_module("dflash.model")
    except ImportError as e:
        message = f"z-lab's reference is not installed (pip install --no-deps dflash==0.1.0): {e}"
        if os.environ.get("CI") == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message, allow_module_level=True)


def upstream_drafter(upstream, path, dtype=torch.float64):
    """The checkpoint at ``path`` loaded by upstream's own class (``architectures[0]``), in eval mode."""
    import json

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    return getattr(upstream, arch).from_pretrained(path, dtype=dtype).eval()


def recorded_rounds(target, run):
    """``run()`` with every verification forward of ``target`` recorded -> ``(run's result, rounds)``;
    a round is ``(position, anchor, drafts)``: the anchor's position (the target's cache length before
    the call), the anchor and the drafted tokens it verifies. Forwards on an empty cache (prefills,
    probes) are not rounds."""
    calls = []

    def hook(module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        length = 0 if cache is None else cache.get_seq_length()
        if length:
            calls.append((length, int(ids[0, 0]), tuple(ids[0, 1:].tolist())))

    handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        result = run()
    finally:
        handle.remove()
    return result, calls


def run_upstream(upstream, drafter, target, ids, max_new_tokens, monkeypatch):
    """Upstream's ``dflash_generate`` (greedy) -> ``(output_ids [1, prompt + new], tokens committed per
    round, rounds)``; its timer reads the wall clock (it calls ``torch.cuda.synchronize()``)."""
    monkeypatch.setattr(upstream, "_cuda_time", time.perf_counter)
    out, rounds = recorded_rounds(target, lambda: upstream.dflash_generate(
        drafter, target, ids, max_new_tokens, None, return_stats=True))
    return out.output_ids, list(out.acceptance_lengths), rounds


def run_fold(target, drafter, ids, max_new_tokens, **options):
    """``fold.spec_decode.generate`` (greedy) -> ``(sequences [1, prompt + new], tokens committed per
    round, tokens verified per round (accepted drafts + 1), rounds)``."""
    result, rounds = recorded_rounds(target, lambda: spec_decode.generate(
        target, drafter, ids, max_new_tokens=max_new_tokens, **options))
    stats = result.stats["per_sequence"][0]
    return result.sequences, stats["committed_per_round"], stats["accepted_per_round"], rounds


def greedy_acceptance(rounds, greedy):
    """Per round, how many drafts match the target's greedy output ``greedy [prompt + new]`` after the
    anchor (what greedy verification accepts; drafts past the output's end match nothing)."""
    out = []
    for position, _, drafts in rounds:
        a = 0
        while a < len(drafts) and position + 1 + a < len(greedy) and drafts[a] == int(greedy[position + 1 + a]):
            a += 1
        out.append(a)
    return out
