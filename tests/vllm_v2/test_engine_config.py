"""A bad ``fold`` block on vLLM 0.34 stops the engine's config where the user's process makes it.

``fold.vllm.register()`` (done by the ``v2_process`` fixture, as vLLM's plug-in hook does in every
process) wraps ``EngineArgs.create_engine_config`` with :func:`fold.vllm.models.check_engine_config`;
the harness's own config (``harness.engine_config``: the tiny pair, block size 16, K = 3) is built
here with drafters whose config.json holds a bad block, written by hand (``fold.vllm.configure``
refuses a bad block before writing it).
"""

import json
import re

import pytest

from fold.vllm.models import check_engine_config
from tests.vllm_v2.harness import BLOCK, K, engine_config

# (the block, the message fold/vllm/config.py gives for it, in full up to the value)
BAD = {
    "window": ({"read": "fold", "window": -1},
               "fold.window must be an integer >= 0 (context entries kept at exact positions), got -1"),
    "alpha": ({"read": "fold", "window": 8, "alpha": 0.5}, "fold.alpha must be a number in [1, 10000], got 0.5"),
    "field": ({"read": "window", "window": 8, "alpha": 2.0},
              "fold.alpha is not a field of read='window' (its fields: ['backend', 'read', 'window'])"),
    "far_page": ({"read": "fold", "window": 8, "far_budget": 64, "far_page": 32},
                 f"fold.far_page must equal the drafter cache's block size {BLOCK} (its pages are the far pages), "
                 "got 32"),
    "far_budget": ({"read": "fold", "window": 8, "far_budget": 16},
                   f"fold.far_budget must hold at least 2 pages of {BLOCK} entries for a draft block of {K + 1} rows"),
}


@pytest.fixture(scope="module")
def pair(v2_process, tmp_path_factory):
    return v2_process.make_pair(tmp_path_factory.mktemp("v2-config"))


def drafter_with(pair, name, block):
    """The pair's drafter with ``block`` as its ``fold`` block, unchecked (every other file linked)."""
    path = pair["root"] / f"drafter-{name}"
    path.mkdir()
    for item in pair["drafter"].iterdir():
        if item.name != "config.json":
            (path / item.name).symlink_to(item.resolve())
    config = json.loads((pair["drafter"] / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, fold=block)))
    return path


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_block_stops_create_engine_config_naming_the_field(pair, name):
    block, words = BAD[name]
    drafter = drafter_with(pair, name, block)
    with pytest.raises(ValueError, match=re.escape(words)) as info:
        engine_config(pair["target"], drafter)
    # raised by fold's check on the config vLLM made, in this (the user's) process
    assert any(entry.name == "check_engine_config" for entry in info.traceback)


def test_without_folds_check_vllm_makes_the_config_and_a_good_block_passes(pair, monkeypatch):
    """What stops the bad block is fold's check alone: vLLM's own create_engine_config (the method fold
    wrapped) makes the config and hands the block to the drafter's hf_config, where the check finds it;
    a good block passes the wrapped method."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()      # once per process (the first EngineArgs does it): fold's register() then wraps again
    wrapped = EngineArgs.create_engine_config
    assert getattr(wrapped, "_fold_checked", False) and wrapped.__wrapped__ is not None
    block, words = BAD["window"]
    drafter = drafter_with(pair, "unchecked", block)
    monkeypatch.setattr(EngineArgs, "create_engine_config", wrapped.__wrapped__)
    config = engine_config(pair["target"], drafter)
    assert config.speculative_config.draft_model_config.hf_config.fold == block
    with pytest.raises(ValueError, match=re.escape(words)):
        check_engine_config(config)
    monkeypatch.undo()
    good = drafter_with(pair, "good", {"read": "fold", "window": 8, "alpha": 2.0, "far_budget": 32, "far_page": BLOCK})
    config = engine_config(pair["target"], good)
    assert config.speculative_config.draft_model_config.hf_config.fold["far_budget"] == 32


def test_draft_decode_context_parallelism_is_refused_by_name(v2_process, tmp_path):
    """V2's DFlash speculator builds its model under a copy of the config whose decode_context_parallel_size
    is ``draft_decode_context_parallel_size``; fold's install refuses that (fold's full-cache sliding layers
    would otherwise also pass V2's own refusal of sliding draft layers under DCP). TP 4 > the tiny target's
    2 KV heads, as vLLM asks of DCP; no world is needed to build the speculator's config."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.spec_decode import init_speculator

    from fold.vllm.models import install
    from tests.vllm_v2.harness import fold_pair

    pair = fold_pair(v2_process, tmp_path)
    config = engine_config(pair["target"], pair["fold"], tp=4, engine=dict(decode_context_parallel_size=2),
                           draft_decode_context_parallel_size=2)
    with set_current_vllm_config(config):
        spec = init_speculator(config, torch.device("cpu"), None)
    assert spec.vllm_config.parallel_config.decode_context_parallel_size == 2
    with pytest.raises(ValueError, match="draft_decode_context_parallel_size=1"):
        install(torch.nn.Module(), spec.vllm_config)
    assert install(torch.nn.Module(), engine_config(pair["target"], pair["drafter"], tp=4,
                                                    engine=dict(decode_context_parallel_size=2),
                                                    draft_decode_context_parallel_size=2)) == 0   # no fold block
